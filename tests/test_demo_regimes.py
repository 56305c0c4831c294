"""`kvdistill.lab.regimes`: a regime's data splits and the models its models.json names, built as written."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from kvdistill.config import ConfigError
from kvdistill.data import tokenize_example
from kvdistill.fields import IGNORE
from kvdistill.io import REPO_ROOT
from kvdistill.lab.regimes import (
    ASSETS,
    MANIFEST,
    build_models,
    check_shipped,
    probe_summary,
    read_models,
    read_settings,
    teachers_of,
    write_data,
)
from kvdistill.lab.tasks import binding
from kvdistill.models import load_model, load_tokenizer

SPLITS = {"teacher_pool", "train", "dev", "teacher_dev", "test", "other_task", "other_task_dev"}
MODULAR = dict(n_dev=10, n_test=10, n_teacher_dev=10, p=11, min_equations=2, max_equations=3)
BINDING = dict(n_pool=60, n_train=20, n_dev=8, n_test=8, n_teacher_dev=8)


@pytest.fixture(scope="module")
def modular_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("modular") / "data"
    write_data("modular", MODULAR, out, seed=3)
    return out


def test_write_data_writes_every_split_once_and_refuses_other_options(tmp_path):
    out = tmp_path / "data"
    sizes = write_data("binding", BINDING, out, seed=1)
    assert set(sizes) == SPLITS and sizes["train"] == 20 and sizes["teacher_pool"] == 60
    assert all(len((out / f"{s}.jsonl").read_text().splitlines()) == n for s, n in sizes.items())
    before = (out / "dev.jsonl").stat().st_mtime_ns
    assert write_data("binding", BINDING, out, seed=1) == sizes  # reused, not rewritten
    assert (out / "dev.jsonl").stat().st_mtime_ns == before
    with pytest.raises(ConfigError, match=r"made with other options .* delete"):
        write_data("binding", {**BINDING, "n_dev": 9}, out, seed=1)
    with pytest.raises(ConfigError, match=r"unknown \['modulus'\]; they are the keyword arguments of kvdistill.lab.tasks.binding.make_splits"):
        write_data("binding", {**BINDING, "modulus": 7}, tmp_path / "other")
    with pytest.raises(ConfigError, match=r"task 'sorting' has no regime data; choose one of \['binding', 'modular'\]"):
        write_data("sorting", {}, tmp_path / "other")
    assert not (tmp_path / "other").exists()  # nothing half-written


@pytest.mark.parametrize("task", ["modular", "binding"])
def test_models_json_is_honoured(task, modular_data, tmp_path):
    data = modular_data
    if task == "binding":
        data = tmp_path / "data"
        write_data("binding", BINDING, data)
    spec_path = REPO_ROOT / "configs" / "demo" / task / "models.json"
    spec = read_models(spec_path)
    paths = build_models(spec_path, data, tmp_path / "init", seed=0)
    assert set(paths) == set(spec.models) >= {"teacher_qwen2", "teacher_other", "student"}
    vocab = {}
    for name, m in spec.models.items():
        cfg = json.loads((paths[name] / "config.json").read_text())
        assert cfg["model_type"] == m.model_type and cfg["tie_word_embeddings"] is m.tie_word_embeddings
        assert {k: cfg[k] for k in m.sizes} == m.sizes
        tok = load_tokenizer(paths[name])
        assert cfg["vocab_size"] == len(tok)
        vocab[name] = (m.tokenizer, len(tok))
        with safe_open(str(paths[name] / "model.safetensors"), "pt") as f:  # untied: the output matrix is saved
            assert ("lm_head.weight" in set(f.keys())) is not m.tie_word_embeddings
        numbers_whole = spec.tokenizers[m.tokenizer].get("numbers_whole", 0)
        assert all(len(tok(str(n), add_special_tokens=False)["input_ids"]) == 1 for n in range(numbers_whole))
        if numbers_whole:  # and one token wherever it stands: the number's field is on one token per number
            rec = json.loads((data / "dev.jsonl").read_text().splitlines()[0])
            ex = tokenize_example(tok, rec)
            on = (ex["field:number"] != IGNORE).nonzero().flatten()
            assert len(on) == len(rec["token_fields"]["number"])
            assert [tok.decode(ex["input_ids"][i]) for i in on] == [str(v) for _, _, v in rec["token_fields"]["number"]]
        if spec.tokenizers[m.tokenizer].get("char_level"):  # one token per byte
            assert len(tok("k=b. q=4.", add_special_tokens=False)["input_ids"]) == 9
        if spec.tokenizers[m.tokenizer].get("word_level"):  # one token per line
            assert len(tok("k=b. q=4.", add_special_tokens=False)["input_ids"]) == 2
        if m.init == "compositional":  # crossed lines add up alike: a=x + c=y == a=y + c=x (tasks.binding.compose_lines)
            emb, ids = load_model(paths[name]).get_input_embeddings().weight, tok.get_vocab()
            lines = [w for w in ids if binding.LINE.fullmatch(w)]
            a, x, c, y = next((p[0], p[2], q[0], q[2]) for p in lines for q in lines if p[0] != q[0] and p[2] != q[2]
                              and f"{p[0]}={q[2]}." in ids and f"{q[0]}={p[2]}." in ids)
            assert torch.allclose(emb[ids[f"{a}={x}."]] + emb[ids[f"{c}={y}."]], emb[ids[f"{a}={y}."]] + emb[ids[f"{c}={x}."]],
                                  atol=1e-6)
    # models naming one tokenizer share it
    assert vocab["student"] == vocab["teacher_qwen2"] == vocab["teacher_other"]
    if task == "modular":
        assert all(m.tie_word_embeddings is False for m in spec.models.values())
        assert all(t.get("numbers_whole", 0) >= 11 for t in spec.tokenizers.values())  # MODULAR's p


def test_built_models_are_reused_and_refused_when_built_otherwise(modular_data, tmp_path):
    spec_path = REPO_ROOT / "configs" / "demo" / "modular" / "models.json"
    paths = build_models(spec_path, modular_data, tmp_path / "init", seed=0)
    before = (paths["student"] / "model.safetensors").read_bytes()
    mtime = (paths["student"] / "model.safetensors").stat().st_mtime_ns
    assert build_models(spec_path, modular_data, tmp_path / "init", seed=0) == paths
    assert (paths["student"] / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(ConfigError, match=r"built from another models.json, seed or data .* delete"):
        build_models(spec_path, modular_data, tmp_path / "init", seed=1)
    # the same file and seed elsewhere: the same bytes; another seed: other weights
    assert (build_models(spec_path, modular_data, tmp_path / "again")["student"] / "model.safetensors"
            ).read_bytes() == before
    assert (build_models(spec_path, modular_data, tmp_path / "seed1", seed=1)["student"] / "model.safetensors"
            ).read_bytes() != before


@pytest.mark.parametrize("content, message", [
    (None, "is missing: a regime needs its models.json"),
    ("{", "is not JSON"),
    ({"models": {}}, "needs two objects, tokenizers"),
    ({"tokenizers": {"t": {"vocab_size": 9, "merges": 3}}, "models": {}}, "tokenizer t: needs vocab_size"),
    ({"tokenizers": {"t": {"vocab_size": 9}}, "models": {"s": {"model_type": "qwen2", "tokenizer": "t"}}},
     r"model s needs exactly the keys \['model_type', 'tokenizer', 'tie_word_embeddings', 'data', 'sizes'\]"),
    ({"tokenizers": {"t": {"vocab_size": 9}}, "models": {"s": {"model_type": "qwen2", "tokenizer": "u",
                                                               "tie_word_embeddings": False, "data": "train",
                                                               "sizes": {}}}},
     "model s names tokenizer 'u', not one of"),
    ({"tokenizers": {"t": {"vocab_size": 9}}, "models": {"s": {"model_type": "qwen2", "tokenizer": "t",
                                                               "tie_word_embeddings": False, "data": "train",
                                                               "sizes": {}, "init": "fourier"}}},
     r"model s: init 'fourier' is not one of \['compositional', 'random'\]"),
    ({"tokenizers": {"t": {"vocab_size": 9}}, "models": {}}, "names no model"),
])
def test_a_bad_models_json_is_refused_in_one_line(tmp_path, content, message):
    path = tmp_path / "models.json"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ConfigError, match=message):
        build_models(path, tmp_path, tmp_path / "init")
    assert not (tmp_path / "init").exists()


def test_build_models_needs_the_teacher_pool(tmp_path):
    with pytest.raises(ConfigError, match=r"no records in .*teacher_pool.jsonl"):
        build_models(REPO_ROOT / "configs" / "demo" / "binding" / "models.json", tmp_path, tmp_path / "init")


def test_demo_settings_apply_quick_key_by_key_and_refuse_unknown_keys(tmp_path):
    settings = read_settings(REPO_ROOT / "configs" / "demo" / "modular" / "demo.yaml")
    quick = read_settings(REPO_ROOT / "configs" / "demo" / "modular" / "demo.yaml", quick=True)
    assert settings.gate > 0.9 and quick.gate == 0.0 and quick.teacher_steps < settings.teacher_steps
    assert quick.data["p"] < settings.data["p"] and quick.data["labelled"] == settings.data["labelled"]  # merged
    assert quick.probe["target"] == settings.probe["target"] and quick.probe["samples"] < settings.probe["samples"]
    # at any depth: quick sets teacher_other's steps and keeps its learning rate
    assert quick.teacher_overrides["teacher_other"] == {**settings.teacher_overrides["teacher_other"], "max_steps": 3}
    path = tmp_path / "demo.yaml"
    path.write_text("data: {}\nteacher_steps: 1\ngate: 0.5\ncurve_steps: 2\ncurve_every: 1\ncurve_items: 2\n"
                    "probe: {}\nteacher_step: 3\n")
    with pytest.raises(ConfigError, match=r"missing \[\], unknown \['teacher_step'\]"):
        read_settings(path)
    path.write_text(path.read_text().replace("teacher_step: 3\n", "").replace("gate: 0.5", "gate: 90"))
    with pytest.raises(ConfigError, match="gate 90 is not an accuracy"):
        read_settings(path)
    valid = path.read_text().replace("gate: 90", "gate: 0.5")
    for key in ("teacher_overrides", "layout"):
        path.write_text(valid + f"{key}: {{teacher_other: 17}}\n")
        with pytest.raises(ConfigError, match=f"{key} maps a teacher's name to its options"):
            read_settings(path)
    for students in ("students.yaml", "{seeds: [0]}"):  # a bare file name, or no `config:`
        path.write_text(valid + f"students: {students}\n")
        with pytest.raises(ConfigError, match=r"students needs `config:`, the ablation YAML beside demo\.yaml"):
            read_settings(path)
    path.write_text(valid + "students: {config: students.yaml, seeds: [0]}\n")
    assert read_settings(path).students == {"config": "students.yaml", "seeds": [0]}


def test_demo_teachers_pick_who_is_trained_and_unknown_names_are_refused(tmp_path):
    models = read_models(REPO_ROOT / "configs" / "demo" / "modular" / "models.json")
    assert set(teachers_of(models)) == {"teacher_qwen2", "teacher_llama", "teacher_other"}  # default: all
    assert teachers_of(models, ["teacher_other"]) == {"teacher_other": ("other_task", "other_task_dev")}
    for bad in (["teacher_gpt"], ["student"]):
        with pytest.raises(ConfigError, match=rf"demo.yaml teachers: \['{bad[0]}'\] are not teachers"):
            teachers_of(models, bad)
    path = tmp_path / "demo.yaml"  # optional: without it every teacher is trained
    path.write_text("data: {}\nteacher_steps: 1\ngate: 0.5\ncurve_steps: 2\ncurve_every: 1\ncurve_items: 2\n"
                    "probe: {}\n")
    assert read_settings(path).teachers is None
    path.write_text(path.read_text() + "teachers: [teacher_qwen2]\n")
    assert read_settings(path).teachers == ["teacher_qwen2"]


def test_probe_summary_names_the_best_cell_and_the_one_training_added_most_to():
    def cell(model, kind, layer, score):
        return {"model": model, "kind": kind, "layer": layer, "score": score, "shuffled": 0.1}

    probe = {"models": [{"name": "t", "untrained": False, "baseline": 0.2},
                        {"name": "t (untrained)", "untrained": True, "baseline": 0.2}],
             "cells": [cell("t", "k_pre", 0, 0.9), cell("t", "v", 1, 0.7),
                       cell("t (untrained)", "k_pre", 0, 0.88), cell("t (untrained)", "v", 1, 0.3)]}
    (row,) = probe_summary(probe)
    assert (row["kind"], row["layer"], row["score"], row["untrained"]) == ("k_pre", 0, 0.9, 0.88)
    assert row["gain_at"] == "v @ 1" and row["gain"] == pytest.approx(0.4)


def test_every_shipped_teacher_matches_its_manifest(tmp_path):
    """assets/ as committed: every file a manifest lists (the demo's teachers, the two-hop teacher of
    scripts/depth2.sh) has the bytes its SHA-256 says; one changed byte is named."""
    assert (ASSETS / "binding" / "depth2" / MANIFEST).is_file()
    assert check_shipped(ASSETS) == []
    copy = tmp_path / "assets"
    shutil.copytree(ASSETS / "binding" / "depth2", copy / "depth2")
    weights = copy / "depth2" / "teacher_llama_d2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    assert check_shipped(copy) == [str(weights)]
