"""Linear probes (probe.py): ridge math, item split, controls, targets from text, a model built to carry a fact."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

from kvdistill.data import DistillCollator, load_records
from kvdistill.fields import IGNORE
from kvdistill.lab import probe
from kvdistill.models import load_model, load_tokenizer


def test_ridge_equals_lstsq_on_the_augmented_system():
    # min (1/n)|XW - Y|^2 + lam |W|^2  ==  least squares on [X; sqrt(n lam) I] W = [Y; 0]
    g = torch.Generator().manual_seed(1)
    X = torch.randn(3, 50, 7, generator=g, dtype=torch.float64)
    Y = torch.randn(50, 4, generator=g, dtype=torch.float64)
    lambdas = (0.01, 0.5, 3.0)
    W = probe.ridge(X, Y, lambdas)  # [Λ, G, F, C]
    assert W.shape == (3, 3, 7, 4)
    for j, lam in enumerate(lambdas):
        for i in range(3):
            A = np.vstack([X[i].numpy(), np.sqrt(50 * lam) * np.eye(7)])
            B = np.vstack([Y.numpy(), np.zeros((7, 4))])
            ref = np.linalg.lstsq(A, B, rcond=None)[0]
            np.testing.assert_allclose(W[j, i].numpy(), ref, rtol=1e-9, atol=1e-10)
    # a per-problem target gives the same as the shared one
    torch.testing.assert_close(probe.ridge(X, Y.expand(3, 50, 4), lambdas), W)


def _items(n_items: int, rows_per_item: int) -> torch.Tensor:
    return torch.arange(n_items).repeat_interleave(rows_per_item)  # [N]


def _carrying_features(labels: torch.Tensor, layer: int, L: int = 4, F: int = 12, seed: int = 0) -> torch.Tensor:
    """`[L, N, F]` noise, except that layer `layer` holds the labels' one-hot through a random linear map."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(L, labels.numel(), F, generator=g)
    onehot = torch.nn.functional.one_hot(labels, int(labels.max()) + 1).float()
    X[layer] = onehot @ torch.randn(onehot.shape[1], F, generator=g) + 0.1 * X[layer]
    return X


def test_probe_finds_the_layer_that_carries_the_target_and_the_controls_do_not():
    g = torch.Generator().manual_seed(2)
    items = _items(60, 5)
    labels = torch.randint(0, 5, (items.numel(),), generator=g)
    X = _carrying_features(labels, layer=2)
    res = probe.fit_probe(X, labels, items, probe.split_items(60, 0.7, seed=0), seed=0)
    score, shuffled, base = res["score"], res["shuffled"], res["baseline"]
    assert score[2] > 0.95
    others = score[[0, 1, 3]]
    assert torch.all(others < base + 0.15), (others, base)
    # the shuffled control is at chance where the probe is perfect: it fits a map, not a fact
    assert torch.all((shuffled - base).abs() < 0.15), (shuffled, base)
    assert res["n_train_items"] == 42 and res["n_test_items"] == 18
    assert res["n_train"] + res["n_test"] == items.numel()


def test_regression_probe_reports_r2_of_the_carrying_layer():
    g = torch.Generator().manual_seed(3)
    items = _items(50, 4)
    y = torch.randint(0, 100, (items.numel(),), generator=g)
    X = torch.randn(3, items.numel(), 6, generator=g)
    X[1, :, 0] = y.float() + 0.5 * X[1, :, 0]  # layer 1 holds the value (plus noise) on one feature
    res = probe.fit_probe(X, y, items, probe.split_items(50, 0.7), classification=False)
    assert res["score"][1] > 0.99
    assert torch.all(res["score"][[0, 2]] < 0.1)
    assert torch.all(res["shuffled"] < 0.1)
    assert res["baseline"] <= 0.0 + 1e-6 or abs(res["baseline"]) < 0.05  # the train mean explains nothing


def test_labels_independent_of_the_features_score_at_chance():
    g = torch.Generator().manual_seed(4)
    items = _items(80, 4)
    labels = torch.randint(0, 2, (items.numel(),), generator=g)
    X = torch.randn(2, items.numel(), 16, generator=g)
    res = probe.fit_probe(X, labels, items, probe.split_items(80, 0.7))
    assert torch.all((res["score"] - 0.5).abs() < 0.12)


def test_the_split_is_by_item_so_a_probe_cannot_memorise_items():
    # every item has its own random feature vector and one random label: a token-level split would read
    # each test row's label off its item's train rows (accuracy ~1); split by item it is at chance
    g = torch.Generator().manual_seed(5)
    n_items, per = 60, 6
    items = _items(n_items, per)
    item_vec = torch.randn(n_items, 32, generator=g)
    item_label = torch.randint(0, 2, (n_items,), generator=g)
    X = (item_vec[items] + 0.01 * torch.randn(items.numel(), 32, generator=g))[None]  # [1, N, 32]
    train_items = probe.split_items(n_items, 0.7, seed=1)
    res = probe.fit_probe(X, item_label[items], items, train_items)
    assert res["score"][0] < 0.75
    train_rows = train_items[items]
    assert not set(items[train_rows].tolist()) & set(items[~train_rows].tolist())  # no item on both sides
    assert res["n_train_items"] + res["n_test_items"] == n_items


def test_split_items_is_seeded_and_keeps_both_sides():
    a, b = probe.split_items(10, 0.7, seed=3), probe.split_items(10, 0.7, seed=3)
    assert torch.equal(a, b) and int(a.sum()) == 7
    assert 1 <= int(probe.split_items(3, 0.99).sum()) == 2  # a test item is always left
    assert not torch.equal(a, probe.split_items(10, 0.7, seed=4))


def test_too_few_items_or_one_class_is_refused():
    items = torch.tensor([0, 0, 1, 1])
    X = torch.randn(1, 4, 3)
    with pytest.raises(ValueError, match="train and"):
        probe.fit_probe(X, torch.tensor([0, 1, 0, 1]), items, torch.tensor([True, False]))
    with pytest.raises(ValueError, match="one class"):
        probe.fit_probe(torch.randn(1, 6, 3), torch.tensor([1, 1, 1, 1, 0, 0]), torch.tensor([0, 0, 1, 1, 2, 2]),
                        torch.tensor([True, True, False]))


def test_parse_target_and_rows():
    assert probe.parse_target("field:value") == ("field", "value")
    assert probe.parse_rows("results") == ("results", None)
    for bad in ("next_token", "field:"):
        with pytest.raises(ValueError, match="not one of"):
            probe.parse_target(bad)
    with pytest.raises(ValueError, match="not one of"):
        probe.parse_rows("answers")


def test_text_spans_mark_numbers_results_and_the_final_answer():
    text = "Question: Tom has 12 apples and 2.5 kg. He gets 1,000.\nAnswer: 12 + 1,000 = 1,012.\n#### 1012"
    off = text.find("Tom")
    spans = probe.text_spans(text, off, "1012")
    numbers = {text[s + off: e + off]: v for s, e, v in spans[probe.NUMBER]}
    assert numbers == {"12": 12, "1,000": 1000, "1,012": 1012, "1012": 1012}  # 2.5 has no integer value
    assert [text[s + off: e + off] for s, e, _ in spans[probe.RESULT]] == ["1,012", "1012"]
    assert [text[s + off: e + off] for s, e, _ in spans[probe.FINAL]] == ["1012"]


@pytest.fixture(scope="module")
def tiny(tiny_world):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        records = load_records(tiny_world.data_dir, split="train", limit=40)
    path = tiny_world.models["llama_teacher"]
    return load_model(path, dtype="fp32"), load_tokenizer(path), records


def test_targets_land_on_the_right_tokens(tiny):
    _, tok, records = tiny
    recs = [probe.with_text_fields(r) for r in records[:4]]
    batch = DistillCollator(tok)(recs)
    nxt = probe.token_targets(batch, "next_answer_token")  # [B, T]
    value = probe.token_targets(batch, "number_value")
    results = probe.row_mask(batch, "results")
    for b, r in enumerate(records[:4]):
        final = r["answer"].rsplit("####", 1)[1].strip()
        at = (nxt[b] != IGNORE).nonzero().flatten()
        assert tok.decode(batch["input_ids"][b, at + 1]).strip() == final  # the tokens after: the final answer
        assert torch.equal(nxt[b, at], batch["input_ids"][b, at + 1])  # the target is the next token's id
        written = tok.decode(batch["input_ids"][b][value[b] != IGNORE])
        assert re.sub(r"\s", "", written) == "".join(re.findall(r"\d+", r["question"] + r["answer"]))
        result_values = set(value[b][results[b]].tolist())
        assert int(final) in result_values and result_values <= set(value[b][value[b] != IGNORE].tolist())
    assert not (probe.row_mask(batch, "answer") & (batch["segment_ids"] != 2)).any()


def test_a_model_whose_only_value_projection_is_at_layer_1_carries_the_field_only_there(tiny):
    # a task field (the parity of each number in the question, on the token of its last digit) is a function
    # of that token; with the value projection of layers 0 and 2 zeroed, only V at layer 1 can hold it
    model, tok, records = tiny
    recs = []
    for r in records:
        spans = [[m.end() - 1, m.end(), int(m.group()) % 2] for m in re.finditer(r"\d+", r["question"])]
        recs.append({**r, "token_fields": {"parity": spans}})
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            if i != 1:
                layer.self_attn.v_proj.weight.zero_()
    rows = probe.collect_rows(model, tok, recs, "field:parity", kinds=["v", "hidden"], progress=False)
    assert rows.features["v"].shape[:2] == (3, rows.labels.numel())
    res = probe.probe_rows(rows, 0.7)
    v = res["v"]
    assert v["score"][1] > 0.9 > v["baseline"] + 0.2
    assert torch.all(v["score"][[0, 2]] == v["baseline"])  # zero features: the majority class, nothing more
    assert v["heads"]["score"].shape == (3, 2)
    assert torch.all(v["shuffled"] < v["baseline"] + 0.2)


def test_ridge_solves_on_two_threads():
    """torch 2.13's batched LU solve fails on 2 CPU threads here (MKL: "SLASWP parameter 6", minutes a call):
    the probe's solve must hold the normal equations there, as a user's `kvdistill probe` runs (a subprocess:
    the suite itself runs on one thread)."""
    import subprocess
    import sys

    code = ("import torch; torch.set_num_threads(2); from kvdistill.lab import probe\n"
            "X = torch.randn(18, 30, 256); Y = torch.randn(30, 10); W = probe.ridge(X, Y, (1e-3, 1.0))\n"
            "A = X.mT @ X / 30; B = X.mT @ Y / 30\n"
            "for W_l, lam in zip(W, (1e-3, 1.0)):\n"
            "    r = ((A + lam * torch.eye(256)) @ W_l - B).abs().max() / B.abs().max()\n"
            "    assert r < 1e-3, float(r)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]
    assert "MKL ERROR" not in done.stderr
