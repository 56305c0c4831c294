"""`kvdistill dry-run`: the GPU recipe's real models on the meta device, checked against hand counts."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from kvdistill.align.aligner import KVAligner
from kvdistill.align.layer_map import proportional_map
from kvdistill.cache import KVCache
from kvdistill.commands.dry_run import dry_run, main, parse_dry_run
from kvdistill.config import ConfigError
from kvdistill.memory import GIB, model_config_path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "qwen2.5-0.5b_from_qwen2-1.5b+7b.yaml"


def qwen2_params(h: int, inter: int, L: int, kv: int, V: int, tied: bool) -> int:
    """Qwen2 by hand: q/k/v with bias, o, SwiGLU MLP, two RMSNorms per layer; embeddings (+ lm_head)."""
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * inter + 2 * h
    return L * layer + V * h * (1 if tied else 2) + h


def llama_params(h: int, inter: int, L: int, q: int, kv: int, V: int, tied: bool) -> int:
    """Llama by hand: no biases; q width H*D, k/v width H_kv*D."""
    layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
    return L * layer + V * h * (1 if tied else 2) + h


def meta_count(name: str) -> int:
    """sum(p.numel()) of the shipped config's model, built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "configs" / "models" / name))
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """`main` on the GPU recipe as shipped (its maps/*.json do not exist): stdout and dry_run.json."""
    out, buf = tmp_path_factory.mktemp("dry_run"), io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["--config", str(RECIPE), "--output_dir", str(out)]) == 0
    return buf.getvalue(), json.loads((out / "dry_run.json").read_text())


def test_recipe_parameter_counts_are_the_published_sizes(recipe):
    _, report = recipe
    params = {m["name"]: m["params"] for m in report["models"]}
    expected = {
        "Qwen2.5-0.5B": qwen2_params(896, 4864, 24, 128, 151936, tied=True),  # 0.49 B
        "Qwen2-1.5B": qwen2_params(1536, 8960, 28, 256, 151936, tied=True),  # 1.54 B
        "Qwen2-7B": qwen2_params(3584, 18944, 28, 512, 152064, tied=False),  # 7.62 B
    }
    assert params == expected
    assert params == {name: meta_count(name) for name in expected}
    assert params["Qwen2.5-0.5B"] == 494_032_768 and params["Qwen2-1.5B"] == 1_543_714_304
    assert params["Qwen2-7B"] == 7_615_616_512


def test_recipe_kv_shapes(recipe):
    _, report = recipe
    shapes = {m["name"]: m["kv_shape"] for m in report["models"]}  # [L, B, H_kv, T, D]
    assert shapes == {
        "Qwen2.5-0.5B": [24, 2, 2, 512, 64],
        "Qwen2-1.5B": [28, 2, 2, 512, 128],
        "Qwen2-7B": [28, 2, 4, 512, 128],
    }


def _aligner_by_probe(teacher: list[int], student: list[int], **kwargs) -> KVAligner:
    """An aligner sized the way `kvdistill train` sizes it: `setup` on (tiny) probe caches."""

    def cache(L: int, H: int, D: int) -> KVCache:
        x = torch.zeros(L, 1, H, 3, D)  # [L, B, H_kv, T, D]
        return KVCache(x, x, torch.ones(1, 3, dtype=torch.long))

    aligner = KVAligner(time_mode="segment", dropout=0.0, init="xavier", share_layers=True,
                        direction="teacher_to_student", trainable=True, **kwargs)
    aligner.setup(cache(*teacher), cache(*student))
    return aligner


def test_recipe_aligners_match_aligners_built_from_probe_caches(recipe):
    _, report = recipe
    rows = {r["teacher"]: r for r in report["aligners"]}
    built = {
        "Qwen2-1.5B": _aligner_by_probe([28, 2, 128], [24, 2, 64], mode="flat", projector="linear", mlp_ratio=1.0,
                                        layer_map=proportional_map(24, 28)),
        "Qwen2-7B": _aligner_by_probe([28, 4, 128], [24, 2, 64], mode="flat", projector="elastic", mlp_ratio=2.0,
                                      layer_map=proportional_map(24, 28)),
    }  # fmt: skip
    for name, aligner in built.items():
        counts = aligner.param_counts()
        assert (rows[name]["total"], rows[name]["trainable"]) == (counts["total"], counts["trainable"])
        assert rows[name]["layer_map"] == "cka -> proportional [24, 28]"
    assert rows["Qwen2-1.5B"]["total"] == 2 * (256 * 128 + 128)  # linear K and V projectors, 256 -> 128


def test_recipe_memory_follows_the_formulas(recipe):
    text, report = recipe
    mem = {i["item"]: i["bytes"] for i in report["memory"]}
    P_s = 494_032_768
    assert mem["student weights"] == P_s * 4  # student_dtype fp32
    assert mem["student grads"] == P_s * 4
    assert mem["student AdamW (2 states)"] == P_s * 8
    assert mem["student bf16 autocast copy"] == P_s * 2
    # B*T*(L*(4h + 2*H*D + 4*H_kv*D + 4*I)*a + V*(a + 8)), a = 2 under bf16
    per_layer = 4 * 896 + 2 * 896 + 4 * 128 + 4 * 4864
    assert mem["student activations (rough)"] == 2 * 512 * (24 * per_layer * 2 + 151936 * 10)
    assert mem["teacher Qwen2-7B weights"] == 7_615_616_512 * 2
    assert mem["teacher Qwen2-7B outputs (1 micro-batch)"] == 2 * 28 * 4 * 128 * 2 * 512 * 2  # 56 MiB
    aligner_params = 2 * (256 * 128 + 128) + 1_315_072
    assert mem["aligners (fp32 weights + grads + AdamW)"] == aligner_params * 16
    assert report["total_gib"] == pytest.approx(sum(mem.values()) / GIB)
    assert 27 < report["total_gib"] < 29 and report["fits"] == {"24 GiB": False, "40 GiB": True, "48 GiB": True,
                                                                "80 GiB": True}
    assert "cka" in text and "proportional map of the same shape" in text and "| **total** |" in text


def test_offload_and_4bit_count_what_sits_on_the_gpu():
    teachers = "[{path: Qwen/Qwen2-1.5B, dtype: bf16}, {path: Qwen/Qwen2-7B, dtype: bf16, quantization: 4bit}]"
    cfg, planned = parse_dry_run(["--config", str(RECIPE), "--teachers", teachers, "--teacher_offload", "true"])
    items = {i["item"]: i for i in dry_run(cfg, planned)["memory"]}
    q4 = items["teacher Qwen2-7B weights"]
    assert q4["counted"]  # quantized teachers are never moved off the GPU
    P_lin = 28 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944)  # q, o, k, v, gate, up, down
    assert q4["bytes"] == int(P_lin * 0.5625 + (7_615_616_512 - P_lin) * 2)  # embeddings + lm_head stay bf16
    assert items["teacher Qwen2-1.5B weights"]["counted"]  # the largest (here: only) unquantized teacher

    cfg, planned = parse_dry_run(["--config", str(RECIPE), "--teacher_offload", "true"])
    items = {i["item"]: i for i in dry_run(cfg, planned)["memory"]}
    assert items["teacher Qwen2-7B weights"]["counted"]
    assert not items["teacher Qwen2-1.5B weights (offloaded)"]["counted"]


LLAMA_PAIR = """\
student: meta-llama/Llama-3.2-1B
student_dtype: bf16
teachers:
  - path: meta-llama/Llama-3.2-3B
    dtype: bf16
kv_weight: 0.1
layer_map: proportional
head_mode: structured
projector: linear
max_length: 256
per_device_train_batch_size: 1
bf16: true
"""


def test_llama_pair(tmp_path, capsys):
    (tmp_path / "llama.yaml").write_text(LLAMA_PAIR)
    assert main(["--config", str(tmp_path / "llama.yaml"), "--output_dir", str(tmp_path)]) == 0
    assert "Llama-3.2-3B" in capsys.readouterr().out
    report = json.loads((tmp_path / "dry_run.json").read_text())
    models = {m["name"]: m for m in report["models"]}
    one_b = llama_params(2048, 8192, 16, 32 * 64, 8 * 64, 128256, tied=True)  # 1.24 B
    three_b = llama_params(3072, 8192, 28, 24 * 128, 8 * 128, 128256, tied=True)  # 3.21 B
    assert models["Llama-3.2-1B"]["params"] == one_b == meta_count("Llama-3.2-1B") == 1_235_814_400
    assert models["Llama-3.2-3B"]["params"] == three_b == meta_count("Llama-3.2-3B") == 3_212_749_824
    assert models["Llama-3.2-1B"]["kv_shape"] == [16, 1, 8, 256, 64]
    assert models["Llama-3.2-3B"]["kv_shape"] == [28, 1, 8, 256, 128]
    counts = _aligner_by_probe([28, 8, 128], [16, 8, 64], mode="structured", projector="linear", mlp_ratio=1.0,
                               layer_map=proportional_map(16, 28)).param_counts()
    assert report["aligners"][0]["total"] == counts["total"]
    mem = {i["item"]: i["bytes"] for i in report["memory"]}
    assert mem["student weights"] == one_b * 2 and "student bf16 autocast copy" not in mem  # a bf16 student


def test_the_dry_run_allocates_no_real_memory(tmp_path):
    (tmp_path / "llama.yaml").write_text(LLAMA_PAIR)
    report = dry_run(*parse_dry_run(["--config", str(tmp_path / "llama.yaml")]))
    params = [p for module in report["_modules"] for p in module.parameters()]
    assert len(report["_modules"]) == 3 and len(params) > 100
    assert all(p.is_meta for p in params)


def test_a_missing_model_config_names_it_and_the_fix(tmp_path, capsys):
    (tmp_path / "x.yaml").write_text(LLAMA_PAIR.replace("meta-llama/Llama-3.2-3B", "my-org/NoSuchModel-7B"))
    with pytest.raises(ConfigError, match=r"NoSuchModel-7B.*configs/models/NoSuchModel-7B/config\.json"):
        main(["--config", str(tmp_path / "x.yaml")])
    from kvdistill.cli import main as cli_main

    assert cli_main(["dry-run", "--config", str(tmp_path / "x.yaml")]) == 2
    assert "NoSuchModel-7B" in capsys.readouterr().err


def test_an_output_dir_that_is_a_file_is_refused_before_the_tables_are_printed(tmp_path, capsys):
    (tmp_path / "llama.yaml").write_text(LLAMA_PAIR)
    (tmp_path / "out").write_text("a file")
    with pytest.raises(ConfigError, match=r"output_dir .*out is a file, not a directory"):
        main(["--config", str(tmp_path / "llama.yaml"), "--output_dir", str(tmp_path / "out")])
    assert capsys.readouterr().out == ""


def test_a_local_model_directory_wins_over_the_shipped_config(tmp_path):
    local = tmp_path / "Qwen2-7B"
    local.mkdir()
    (local / "config.json").write_text("{}")
    assert model_config_path(str(local)) == local / "config.json"
    assert model_config_path("Qwen/Qwen2-7B") == ROOT / "configs" / "models" / "Qwen2-7B" / "config.json"


def test_the_training_doc_shows_the_recipes_dry_run_output(recipe):
    """docs/training.md section 4 pastes the command's output: one source for both (re-run it if this fails)."""
    text, _ = recipe
    doc = (ROOT / "docs" / "training.md").read_text()
    pasted = doc.split("pasted unchanged: re-run it after changing the recipe -->")[1].split("<!-- end of")[0]
    body = text.split("\n", 1)[1].split("report written to")[0]  # after the config line, before the JSON path
    assert pasted.strip().split("\n", 1)[1].strip() == body.strip()


def test_the_one_teacher_gpu_recipe_dry_runs(tmp_path, capsys):
    """The README's "distil your own pair" recipe as shipped: its config validates and sizes on the meta device."""
    assert main(["--config", str(ROOT / "configs" / "qwen2.5-0.5b_from_qwen2-1.5b.yaml"), "--output_dir",
                 str(tmp_path)]) == 0
    report = json.loads((tmp_path / "dry_run.json").read_text())
    assert [m["name"] for m in report["models"]] == ["Qwen2.5-0.5B", "Qwen2-1.5B"]


def test_the_recipes_read_the_map_names_layer_map_writes():
    """One `kvdistill layer-map` over both teachers writes the files the two-teacher recipe names."""
    import yaml

    from kvdistill.commands.layer_map import output_paths

    recipe = yaml.safe_load(RECIPE.read_text())
    teachers = [t["path"] for t in recipe["teachers"]]
    assert [str(p) for p in output_paths("maps/qwen.json", teachers)] == [t["layer_map"] for t in recipe["teachers"]]
