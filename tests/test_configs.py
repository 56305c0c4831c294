"""Every config file the repository ships names only options that exist.

Paths inside them (outputs/demo/...) are made by the demo, so the files are checked by their
keys, not run: a renamed or misspelt option fails here instead of minutes into an ablation.
"""

from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from kvdistill.commands.ablate import load_ablation_config
from kvdistill.commands.ablate.run import train_config_for
from kvdistill.train.config import KVDistillConfig, TeacherConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TRAIN_KEYS = {f.name for f in fields(KVDistillConfig)}
TEACHER_KEYS = {f.name for f in fields(TeacherConfig)}
# configs/accelerate and configs/lm_eval hold other tools' formats (lm-eval tasks use `!function` tags)
OURS = sorted(p for p in CONFIGS.glob("**/*.yaml") if not {"accelerate", "lm_eval"} & set(p.parts))
ABLATIONS = [p for p in OURS if "base_config" in (yaml.safe_load(p.read_text()) or {})]
DEMO_SETTINGS = [p for p in OURS if p.name == "demo.yaml"]  # `demo --task`'s settings (kvdistill.lab.regimes)
PROBES = [p for p in OURS if p.stem.endswith(("probe", "probe_plain"))]  # `kvdistill probe --config`
EVALS = [p for p in OURS if p.stem.endswith("_eval")]  # `kvdistill eval --config`
TRAIN_YAMLS = [p for p in OURS if p not in ABLATIONS + DEMO_SETTINGS + PROBES + EVALS]


def _check_train_config(cfg: dict, where: str) -> None:
    unknown = set(cfg) - TRAIN_KEYS
    assert not unknown, f"{where}: unknown options {sorted(unknown)}"
    for teacher in cfg.get("teachers") or []:
        assert not set(teacher) - TEACHER_KEYS, f"{where}: unknown teacher keys {set(teacher) - TEACHER_KEYS}"


def test_there_are_configs_to_check():
    assert len(TRAIN_YAMLS) >= 5 and len(ABLATIONS) >= 1


@pytest.mark.parametrize("path", TRAIN_YAMLS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_train_config_keys_exist(path):
    _check_train_config(yaml.safe_load(path.read_text()) or {}, str(path))


@pytest.mark.parametrize("path", DEMO_SETTINGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_demo_settings_keys_exist(path):
    from kvdistill.lab.regimes import check_data, read_settings

    for quick in (False, True):  # configs/demo/<task>/demo.yaml: its data knobs are the task's
        check_data(path.parent.name, read_settings(path, quick=quick).data)


@pytest.mark.parametrize("path", PROBES + EVALS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_command_configs_parse(path):
    """`kvdistill probe --config` and `kvdistill eval --config` files name only their command's options."""
    from kvdistill.commands.eval import EvalConfig
    from kvdistill.commands.probe import ProbeConfig

    config = ProbeConfig if path in PROBES else EvalConfig
    cfg = yaml.safe_load(path.read_text())
    assert not set(cfg) - {f.name for f in fields(config)}, f"{path}: unknown {config.__name__} options"
    assert config(**cfg).output_dir


@pytest.mark.parametrize("path", ABLATIONS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_ablation_run_has_valid_keys(path):
    cfg = load_ablation_config(path)
    assert len(cfg.variants) >= 2
    for variant in cfg.variants:
        for seed in cfg.seeds:
            _check_train_config(train_config_for(cfg, variant, seed), f"{path}:{variant.name}:{seed}")


@pytest.mark.parametrize("name", ["relation.yaml", "privileged.yaml", "tiny.yaml"])
def test_example_configs_train_on_the_tiny_world(name, tiny_world, tmp_path):
    """The shipped examples run through the CLI as written, with only paths and steps swapped."""
    from kvdistill.cli import main

    m = tiny_world.models
    teachers = f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher_alt_tok']}}}]"
    argv = ["train", "--config", str(CONFIGS / name), "--student", str(m["student"]), "--teachers", teachers,
            "--data", str(tiny_world.data_dir), "--output_dir", str(tmp_path / "run"), "--max_steps", "2",
            "--logging_steps", "1", "--disable_tqdm", "true"]
    if "layer_map: cka" in (CONFIGS / name).read_text():
        argv += ["--layer_map", "proportional"]
    assert main(argv) == 0
    assert (tmp_path / "run" / "train_summary.json").exists()
