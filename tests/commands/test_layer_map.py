"""`kvdistill layer-map`: CKA maps on the tiny models, JSON round-trip, heatmap, the command end to end."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from kvdistill.align.layer_map import LAYER_MAP_FORMAT, load_layer_map
from kvdistill.commands.layer_map import (
    LayerMapConfig,
    compute_layer_map,
    layer_similarity,
    main,
    output_paths,
    sample_records,
    write_layer_map,
)
from kvdistill.config import ConfigError
from kvdistill.data import load_records
from kvdistill.models import config_hash, load_model, load_tokenizer
from kvdistill.plots import plot_cka_heatmap

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = {"batch_size": 3, "max_length": 64, "progress": False}


@pytest.fixture(scope="module")
def world(tiny_world):
    load = {name: (load_model(p, dtype="fp32"), load_tokenizer(p)) for name, p in tiny_world.models.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "example cut to max_length" is expected at 64 tokens
        records = load_records(tiny_world.data_dir, split="test", limit=6)
    return tiny_world, load, records


@pytest.fixture(autouse=True)
def _quiet_truncation():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*was cut to max_length.*")
        yield


@pytest.mark.parametrize("representation", ["kv", "hidden", "keys", "values"])
def test_model_paired_with_itself_gives_the_identity_map(world, representation):
    _, load, records = world
    model, tok = load["qwen2_teacher"]
    res = compute_layer_map(model, model, tok, tok, records, k=1, representation=representation, **SMALL)
    S = res["similarity"]
    torch.testing.assert_close(S.diag(), torch.ones(S.shape[0], dtype=torch.float64), atol=1e-6, rtol=0)
    assert torch.equal(res["matrix"], torch.eye(S.shape[0]))
    torch.testing.assert_close(S, S.T, atol=1e-6, rtol=0)


def test_padding_does_not_change_the_similarity(world):
    # one sample per batch (no padding) vs three per batch (right padding): identical rows, identical S
    _, load, records = world
    (s, s_tok), (t, t_tok) = load["student"], load["llama_teacher_alt_tok"]
    for pooling in ("tokens", "mean"):
        kw = {"pooling": pooling, "minibatch_size": None, "max_length": 64, "progress": False}
        one, c1 = layer_similarity(s, t, s_tok, t_tok, records, batch_size=1, **kw)
        three, c3 = layer_similarity(s, t, s_tok, t_tok, records, batch_size=3, **kw)
        torch.testing.assert_close(one, three, atol=1e-5, rtol=0)
        assert c1["rows"] == c3["rows"] == (c1["rows"] if pooling == "tokens" else len(records))


def test_skip_tokens_leaves_each_samples_first_tokens_out(world):
    _, load, records = world
    (s, s_tok), (t, t_tok) = load["student"], load["llama_teacher_alt_tok"]
    kw = {"pooling": "tokens", "minibatch_size": None, **SMALL}
    rows = {n: layer_similarity(s, s, s_tok, s_tok, records, skip_tokens=n, **kw)[1]["rows"] for n in (0, 2)}
    assert rows[0] - rows[2] == 2 * len(records)  # one tokenizer: exactly the first two tokens per sample
    # another tokenizer: a student token is also left out when it reads the teacher's first tokens
    other = {n: layer_similarity(s, t, s_tok, t_tok, records, skip_tokens=n, **kw)[1]["rows"] for n in (0, 2)}
    assert other[0] - other[2] >= 2 * len(records)
    # kv is the mean of the keys' and the values' CKA
    sims = {r: layer_similarity(s, t, s_tok, t_tok, records, representation=r, **kw)[0] for r in ("kv", "keys", "values")}
    torch.testing.assert_close(sims["kv"], (sims["keys"] + sims["values"]) / 2)


def test_config_rejects_a_bad_skip_tokens():
    base = {"student": "s", "teacher": ["t"], "output_file": "m.json", "max_length": 64}
    assert LayerMapConfig(**base).skip_tokens == 1 and LayerMapConfig(**base).representation == "kv"
    for bad in (-1, 64):
        with pytest.raises(ConfigError, match="skip_tokens"):
            LayerMapConfig(**base, skip_tokens=bad)


def test_other_tokenizer_is_aligned_to_student_tokens(world):
    _, load, records = world
    (s, s_tok), (t, t_tok) = load["student"], load["llama_teacher_alt_tok"]
    res = compute_layer_map(s, t, s_tok, t_tok, records, k=2, debiased=True, monotonic=True, **SMALL)
    n_student_tokens = sum(min(len(s_tok(r["question"] + r["answer"])["input_ids"]), 64) for r in records)
    assert res["provenance"]["rows"] > 0.8 * n_student_tokens  # the student's tokens are the CKA rows
    assert res["matrix"].shape == (2, 3)
    torch.testing.assert_close(res["matrix"].sum(1), torch.ones(2))


def test_json_round_trip_and_heatmap(world, tmp_path):
    _, load, records = world
    (s, s_tok), (t, t_tok) = load["student"], load["qwen2_teacher"]
    res = compute_layer_map(s, t, s_tok, t_tok, records, k=2, pooling="mean", seed=3, **SMALL)
    json_path, png_path = write_layer_map(res, tmp_path / "pair.json")
    M = load_layer_map(json_path, 2, 4, student_hash=config_hash(s), teacher_hash=config_hash(t))
    torch.testing.assert_close(M, res["matrix"])
    doc = json.loads(json_path.read_text())
    assert doc["format"] == LAYER_MAP_FORMAT
    torch.testing.assert_close(torch.tensor(doc["similarity"]), res["similarity"].float())
    prov = doc["provenance"]
    for key in (
        "student",
        "teacher",
        "student_config_hash",
        "teacher_config_hash",
        "samples",
        "k",
        "seed",
        "representation",
        "pooling",
        "date",
        "kvdistill_version",
    ):
        assert key in prov, key
    assert (prov["samples"], prov["k"], prov["seed"], prov["pooling"]) == (len(records), 2, 3, "mean")
    with pytest.raises(ValueError, match="another teacher"):
        load_layer_map(json_path, 2, 4, teacher_hash="0" * 16)
    assert png_path == tmp_path / "pair.png"
    assert png_path.read_bytes()[:8] == PNG_MAGIC


def test_plot_cka_heatmap_writes_a_png(tmp_path):
    S = torch.rand(5, 7)
    M = torch.zeros(5, 7)
    M[torch.arange(5), torch.arange(5)] = 1.0
    path = plot_cka_heatmap(S, M, tmp_path / "sub" / "h.png", title="t")
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert plot_cka_heatmap(S.tolist(), None, tmp_path / "h2.png").read_bytes()[:8] == PNG_MAGIC


def test_output_paths_and_sampling():
    assert output_paths("m/map.json", ["org/Qwen2-7B"]) == [output_paths("m/map.json", ["x"])[0]]
    two = output_paths("m/map.json", ["org/Qwen2-7B", "/models/qwen2_teacher/"])
    assert [p.name for p in two] == ["map.Qwen2-7B.json", "map.qwen2_teacher.json"]
    same = output_paths("map.json", ["a/t", "b/t"])
    assert len({p.name for p in same}) == 2
    recs = [{"i": i} for i in range(50)]
    assert sample_records(recs, 10, 0) == sample_records(recs, 10, 0) != sample_records(recs, 10, 1)
    assert [r["i"] for r in sample_records(recs, 10, 0)] == sorted(
        r["i"] for r in sample_records(recs, 10, 0)
    )
    assert sample_records(recs, None, 0) == recs


def test_command_end_to_end_two_teachers(tiny_world, tmp_path, capsys):
    m = tiny_world.models
    out = tmp_path / "maps" / "map.json"
    argv = [
        "--student", str(m["student"]),
        "--teacher", str(m["qwen2_teacher"]), str(m["llama_teacher_alt_tok"]),
        "--data", str(tiny_world.data_dir), "--samples", "6", "--top-k", "2", "--batch-size", "3",
        "--max-length", "64", "--debiased", "--monotonic", "--temperature", "0.1", "--dtype", "fp32",
        "--cka-dtype", "float32", "--representation", "hidden", "--skip-tokens", "2", "--standardize",
        "--out", str(out), "--no-progress", "--device", "cpu",
    ]  # fmt: skip
    assert main(argv) == 0
    student = load_model(m["student"], dtype="fp32")
    for name, L_t in (("qwen2_teacher", 4), ("llama_teacher_alt_tok", 3)):
        path = out.with_name(f"map.{name}.json")
        teacher = load_model(m[name], dtype="fp32")
        M = load_layer_map(path, 2, L_t, student_hash=config_hash(student), teacher_hash=config_hash(teacher))
        torch.testing.assert_close(M.sum(1), torch.ones(2))
        assert path.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
        prov = json.loads(path.read_text())["provenance"]
        assert prov["teacher"] == str(m[name]) and prov["debiased"] and prov["monotonic"]
        assert prov["cka_dtype"] == "float32"
        assert (prov["representation"], prov["skip_tokens"], prov["standardize"]) == ("hidden", 2, True)
    assert "llama_teacher_alt_tok" in capsys.readouterr().out
