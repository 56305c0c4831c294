"""`kvdistill ablate`: variants, resumable runner, statistics and report (synthetic runs), and
one end-to-end ablation on the tiny fixtures with the real trainer and evaluator."""

import copy
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import yaml

from kvdistill.commands import ablate
from kvdistill.commands.ablate import (
    BUILTIN_VARIANTS,
    VARIANT_SETS,
    AblationError,
    load_ablation_config,
    main,
    resolve_variants,
    run_ablation,
)
from kvdistill.config import ConfigError
from kvdistill.lab.prereg import METRIC_NAMES, parse_primary
from kvdistill.report import fmt_signed


def test_builtin_variants_are_valid_train_overrides():
    from kvdistill.train import config as tc

    names = {f.name for f in fields(tc.KVDistillConfig)}
    choices = {
        "time_mode": tc.TIME_MODES,
        "layer_map": tc.LAYER_MAPS,
        "head_mode": tc.HEAD_MODES,
        "projector": tc.PROJECTORS,
        "kv_loss": tc.KV_LOSSES,
    }
    for name, (_, overrides) in BUILTIN_VARIANTS.items():
        for key, value in overrides.items():
            assert key in names, f"{name}: {key} is not a train config field"
            if key in choices:
                assert value in choices[key], f"{name}: {key}={value}"
        if overrides.get("kv_loss") == "structural":
            assert overrides["head_mode"] == "structured"
    assert BUILTIN_VARIANTS["baseline"][1] == {"kv_weight": 0.0}
    assert BUILTIN_VARIANTS["untrained_teacher"][1]["teacher_control"] == "untrained"
    for members in VARIANT_SETS.values():
        assert all(m in BUILTIN_VARIANTS for m in members)


def test_resolve_variants():
    vs = resolve_variants(
        [
            "core",
            "kv",
            {"name": "kv_w1", "base": "kv", "overrides": {"kv_weight": 1.0}},
            {"name": "mine", "overrides": {"kv_weight": 0.3}, "label": "Mine"},
        ]
    )
    names = [v.name for v in vs]
    assert names == [*VARIANT_SETS["core"], "kv_w1", "mine"]  # duplicates keep the first
    kv_w1 = vs[names.index("kv_w1")]
    assert kv_w1.overrides == {**BUILTIN_VARIANTS["kv"][1], "kv_weight": 1.0}
    assert vs[-1].label == "Mine" and vs[-1].overrides == {"kv_weight": 0.3}
    assert [v.name for v in resolve_variants({"a": {"kv_weight": 0}, "b": None})] == ["a", "b"]
    with pytest.raises(AblationError, match="unknown variant"):
        resolve_variants(["nope"])
    with pytest.raises(AblationError, match="directory name"):
        resolve_variants([{"name": "a/b", "overrides": {}}])
    with pytest.raises(AblationError, match="unknown keys"):
        resolve_variants([{"name": "a", "overides": {}}])


# ----------------------------------------------------------------------------- synthetic runs


def _write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


class FakeRuns:
    """train_fn / eval_fn that write what the real ones do, with chosen accuracies."""

    def __init__(self, acc: dict[str, float], n_items: int = 200, nll: dict[str, float] | None = None):
        self.acc, self.n_items, self.nll = acc, n_items, nll or {}
        self.trained: list[str] = []
        self.evaluated: list[str] = []

    def train(self, argv):
        cfg = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text())
        # a run killed mid-training goes on from its newest complete checkpoint (tests/train/test_crash_safety.py)
        assert argv[argv.index("--resume_from_checkpoint") + 1] == "last"
        out = Path(cfg["output_dir"])
        self.trained.append(str(out))
        kv = cfg.get("kv_weight", 0) > 0
        rows = [
            {"step": s, "loss": 2.0 / s, "ce": 2.0 / s, **({"cos_sim/t": 0.5 + 0.04 * s} if kv else {})}
            for s in range(1, 11)
        ]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        final = {"ce": 0.2, "kv_loss": 0.1 if kv else None, "cos_sim": 0.9 if kv else None}
        (out / "train_summary.json").write_text(json.dumps({"final": final, "global_step": 10}))
        return 0

    def eval(self, model_dir, out_dir, settings):
        self.evaluated.append(model_dir)
        variant, seed = Path(model_dir).parent.name, int(Path(model_dir).name.split("_")[1])
        rng = np.random.default_rng(seed)
        correct = rng.random(self.n_items) < self.acc[variant]
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "items.jsonl").write_text(
            "".join(json.dumps({"index": i, "correct": bool(c)}) + "\n" for i, c in enumerate(correct))
        )
        (out / "summary.json").write_text(
            json.dumps(
                {
                    "accuracy": float(correct.mean()),
                    "ci_low": 0.0,
                    "ci_high": 1.0,
                    "n": self.n_items,
                    "perplexity": 3.0,
                    # the variant's answer NLL, seed noise of ±0.05 around it
                    **({"answer_nll": self.nll[variant] + 0.05 * rng.standard_normal()} if self.nll else {}),
                }
            )
        )


def test_runner_report_and_resume_with_synthetic_runs(tmp_path):
    base = _write_yaml(tmp_path / "train.yaml", {"student": "s", "teachers": [{"path": "t"}], "kv_weight": 0.1,
                                                   "max_steps": 99})
    abl = _write_yaml(
        tmp_path / "ablation.yaml",
        {
            "base_config": "train.yaml",  # relative to the ablation YAML
            "output_dir": str(tmp_path / "out"),
            "seeds": [0, 1, 2],
            "variants": ["baseline", "kv", {"name": "same", "overrides": {"kv_weight": 0.0}}],
            "overrides": {"max_steps": 10},
            "eval": {"limit": 200},
            "n_resamples": 2000,
        },
    )
    cfg = load_ablation_config(abl)
    assert cfg.base_config == str(base) and cfg.baseline == "baseline"
    # same seed -> same item draws: `same` gets the identical per-item correctness as the baseline
    fake = FakeRuns({"baseline": 0.3, "kv": 0.7, "same": 0.3})
    report = run_ablation(cfg, train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    assert len(fake.trained) == len(fake.evaluated) == 9

    out = tmp_path / "out"
    train_cfg = yaml.safe_load((out / "runs" / "kv" / "seed_1" / "train_config.yaml").read_text())
    assert train_cfg["max_steps"] == 10 and train_cfg["seed"] == 1 and train_cfg["student"] == "s"
    assert train_cfg["time_mode"] == "global" and train_cfg["output_dir"].endswith("kv/seed_1")
    assert (
        yaml.safe_load((out / "runs" / "baseline" / "seed_0" / "train_config.yaml").read_text())["kv_weight"]
        == 0
    )

    kv = report["variants"]["kv"]
    assert kv["vs_baseline"]["ttest"]["p_value"] < 0.05
    assert kv["vs_baseline"]["permutation_p"] < 0.05
    assert kv["vs_baseline"]["items"] == 600
    assert kv["cos_sim"]["mean"] == pytest.approx(0.9)
    same = report["variants"]["same"]["vs_baseline"]
    assert same["ttest"]["p_value"] == 1.0 and same["permutation_p"] == 1.0
    assert "vs_baseline" not in report["variants"]["baseline"]

    md = (out / "ablation.md").read_text()
    assert "| +KV | 3 |" in md and "Baseline (SFT)" in md and "ablation_accuracy.png" in md
    assert "Note:** only 3 seed(s)" in md
    saved = json.loads((out / "ablation.json").read_text())  # strict JSON: no NaN
    assert saved["variants"]["baseline"]["cos_sim"]["mean"] is None
    for png in ("ablation_accuracy.png", "ablation_curves.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"

    # re-run: everything finished, nothing trained or evaluated
    fake2 = FakeRuns(fake.acc)
    run_ablation(cfg, train_fn=fake2.train, eval_fn=fake2.eval, log=lambda s: None)
    assert fake2.trained == [] and fake2.evaluated == []
    # a run trained but not evaluated: only its evaluation is redone
    (out / "runs" / "kv" / "seed_2" / "eval" / "summary.json").unlink()
    run_ablation(cfg, train_fn=fake2.train, eval_fn=fake2.eval, log=lambda s: None)
    assert fake2.trained == [] and fake2.evaluated == [str(out / "runs" / "kv" / "seed_2")]
    # bookkeeping (checkpointing, logging) may change between a run and its resumption ...
    cfg.overrides.update(save_strategy="steps", save_steps=5, logging_steps=3)
    run_ablation(cfg, train_fn=fake2.train, eval_fn=fake2.eval, log=lambda s: None)
    # ... and so may the ablation's output_dir: finished runs copied into another one are reused
    import shutil

    shutil.copytree(out / "runs", tmp_path / "out2" / "runs")
    moved = copy.deepcopy(cfg)
    moved.output_dir = str(tmp_path / "out2")
    run_ablation(moved, train_fn=fake2.train, eval_fn=fake2.eval, log=lambda s: None)
    assert fake2.trained == [] and (tmp_path / "out2" / "ablation.md").exists()
    # ... other settings in the same output_dir are refused, never mixed with the old runs
    cfg.overrides["max_steps"] = 20
    with pytest.raises(AblationError, match="max_steps differ"):
        run_ablation(cfg, train_fn=fake2.train, eval_fn=fake2.eval, log=lambda s: None)


def test_kept_records_resume_a_sweep_on_a_machine_without_its_outputs(tmp_path):
    """scripts/keep_runs.sh keeps each evaluated run's records (no weights) and restores them into an empty
    output_dir, where the same ablation trains nothing it had finished and reports the same numbers."""
    _write_yaml(tmp_path / "train.yaml", {"student": "s", "teachers": [{"path": "t"}], "kv_weight": 0.1})
    abl = _write_yaml(tmp_path / "ablation.yaml", {"base_config": "train.yaml", "output_dir": str(tmp_path / "out"),
                                                    "seeds": [0, 1], "variants": ["baseline", "kv"],
                                                    "n_resamples": 200})
    fake = FakeRuns({"baseline": 0.3, "kv": 0.7})
    first = run_ablation(load_ablation_config(abl), train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    (tmp_path / "out" / "runs" / "kv" / "seed_0" / "model.safetensors").write_bytes(b"weights")
    shutil.rmtree(tmp_path / "out" / "runs" / "kv" / "seed_1" / "eval")  # trained, not evaluated: not kept
    script, record = Path(__file__).parents[2] / "scripts" / "keep_runs.sh", tmp_path / "record"
    keep = subprocess.run(["bash", str(script), str(tmp_path / "out"), str(record)], capture_output=True, text=True)
    assert keep.returncode == 0 and "kept 3 evaluated runs" in keep.stdout, keep.stderr
    assert not list(record.rglob("model.safetensors")) and not (record / "runs" / "kv" / "seed_1").exists()
    shutil.rmtree(tmp_path / "out")  # the next machine has none of it
    back = subprocess.run(["bash", str(script), "--restore", str(tmp_path / "out"), str(record)], capture_output=True,
                          text=True)
    assert back.returncode == 0, back.stderr
    again = FakeRuns(fake.acc)
    second = run_ablation(load_ablation_config(abl), train_fn=again.train, eval_fn=again.eval, log=lambda s: None)
    assert again.trained == [str(tmp_path / "out" / "runs" / "kv" / "seed_1")]  # only the run that was not kept
    assert second["variants"]["kv"]["runs"] == first["variants"]["kv"]["runs"]
    missing = subprocess.run(["bash", str(script), str(tmp_path / "nowhere"), str(record)], capture_output=True,
                             text=True)
    assert missing.returncode == 1 and "no preregistration.json" in missing.stderr


def test_failed_run_raises_or_is_reported(tmp_path):
    _write_yaml(tmp_path / "train.yaml", {"student": "s", "teachers": [{"path": "t"}], "kv_weight": 0})
    abl = _write_yaml(
        tmp_path / "a.yaml",
        {
            "base_config": str(tmp_path / "train.yaml"),
            "output_dir": str(tmp_path / "o"),
            "seeds": [0],
            "variants": ["baseline", "kv"],
        },
    )
    fake = FakeRuns({"baseline": 0.3, "kv": 0.5})
    with pytest.raises(RuntimeError, match="exited with code 2"):
        run_ablation(
            load_ablation_config(abl), train_fn=lambda argv: 2, eval_fn=fake.eval, log=lambda s: None
        )
    report = run_ablation(
        load_ablation_config(abl, keep_going=True),
        train_fn=lambda argv: fake.train(argv) if "kv/" in argv[1] else 2,
        eval_fn=fake.eval,
        log=lambda s: None,
    )
    assert len(report["failures"]) == 1 and "baseline seed 0" in report["failures"][0]
    assert "Failed runs" in (tmp_path / "o" / "ablation.md").read_text()


@pytest.mark.parametrize("keep", [True, False])
def test_keep_checkpoints_false_removes_a_finished_runs_checkpoints_only(tmp_path, keep):
    _write_yaml(tmp_path / "train.yaml", {"student": "s", "teachers": [{"path": "t"}], "kv_weight": 0})
    abl = _write_yaml(tmp_path / "a.yaml", {"base_config": str(tmp_path / "train.yaml"),
                                             "output_dir": str(tmp_path / "o"), "seeds": [0],
                                             "variants": ["baseline"], "keep_checkpoints": keep})
    fake = FakeRuns({"baseline": 0.3})

    def train(argv):  # a run that saved a checkpoint and its final model
        out = Path(argv[1]).parent
        (out / "checkpoint-10").mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"final")
        return fake.train(argv)

    run_ablation(load_ablation_config(abl), train_fn=train, eval_fn=fake.eval, log=lambda s: None)
    run = tmp_path / "o" / "runs" / "baseline" / "seed_0"
    assert (run / "checkpoint-10").exists() == keep
    assert (run / "model.safetensors").exists() and (run / "eval" / "summary.json").exists()


def test_failed_capture_fails_only_the_runs_that_read_it(tmp_path, monkeypatch):
    _write_yaml(tmp_path / "train.yaml", {"student": "s", "teachers": [{"path": "t"}]})
    abl = _write_yaml(tmp_path / "a.yaml", {
        "base_config": "train.yaml", "output_dir": str(tmp_path / "o"), "seeds": [0, 1],
        "variants": ["baseline", "kv", "relation"], "capture": True,
    })

    def fake_capture(rdir, made):
        if "/kv/" in rdir:
            raise FileNotFoundError("teacher t not found")
        return {**made, rdir: {}}, [f"capture: {rdir}"]

    monkeypatch.setattr(ablate.run, "make_capture", fake_capture)
    fake = FakeRuns({"baseline": 0.3, "kv": 0.5, "relation": 0.5})
    with pytest.raises(FileNotFoundError):
        run_ablation(load_ablation_config(abl), train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    assert fake.trained == []  # captures come before any run in one process
    report = run_ablation(load_ablation_config(abl, keep_going=True), train_fn=fake.train, eval_fn=fake.eval,
                          log=lambda s: None)
    assert sorted(f.split(":")[0] for f in report["failures"]) == [
        str(tmp_path / "o" / "captures" / "kv"), "kv seed 0", "kv seed 1"]
    assert len(fake.trained) == 4 and not any("/kv/" in r for r in fake.evaluated)


def test_on_policy_variants_get_no_capture(tmp_path):
    """lmbda > 0 and seq_kd runs teach on text generated while training: they read live teachers, so
    `capture: true` hands them no capture (their config would refuse one); off-policy KD keeps its capture."""
    _write_yaml(tmp_path / "train.yaml", {"student": "s", "teachers": [{"path": "t"}], "kv_weight": 0,
                                          "logit_kd_weight": 1.0})
    abl = _write_yaml(tmp_path / "a.yaml", {
        "base_config": "train.yaml", "output_dir": str(tmp_path / "o"), "seeds": [0], "capture": True,
        "variants": [{"name": "off", "overrides": {}}, {"name": "gkd", "overrides": {"lmbda": 0.5}},
                     {"name": "seqkd", "overrides": {"seq_kd": True}}],
    })
    cfg = load_ablation_config(abl)
    dirs = {v.name: ablate.run.capture_dir_for(cfg, v, ablate.run.train_config_for(cfg, v, 0)) for v in cfg.variants}
    assert dirs == {"off": tmp_path / "o" / "captures" / "off", "gkd": None, "seqkd": None}


def test_the_runs_table_gives_each_runs_training_time(tmp_path):
    """`train s` is the sum of the wall times a run's finished `train()` calls logged (a resumed run logs one
    per call); a run that logged none reads `–` (cost per arm beside its accuracy, e.g. on-policy's)."""

    class Timed(FakeRuns):
        def train(self, argv):
            rc = super().train(argv)
            out = Path(yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text())["output_dir"])
            if out.parent.name == "kv":  # killed after step 5, resumed to step 10
                rows = [{"step": 5, "train_runtime": 1.25}, {"step": 10, "train_runtime": 2.5}]
                with (out / "metrics.jsonl").open("a") as f:
                    f.write("".join(json.dumps(r) + "\n" for r in rows))
            return rc

    _write_yaml(tmp_path / "train.yaml", {"student": "s", "teachers": [{"path": "t"}], "kv_weight": 0})
    abl = _write_yaml(tmp_path / "a.yaml", {"base_config": "train.yaml", "output_dir": str(tmp_path / "o"),
                                            "seeds": [0], "variants": ["baseline", "kv"], "n_resamples": 100})
    fake = Timed({"baseline": 0.3, "kv": 0.5})
    report = run_ablation(load_ablation_config(abl), train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    runs = {v: next(iter(report["variants"][v]["runs"].values())) for v in ("baseline", "kv")}
    assert runs["kv"]["train_runtime"] == 3.75 and runs["baseline"]["train_runtime"] is None
    rows = [line for line in (tmp_path / "o" / "ablation.md").read_text().splitlines() if "| 0 |" in line]
    assert "| train s |" in (tmp_path / "o" / "ablation.md").read_text()
    assert rows[0].endswith("| – |") and rows[1].endswith("| 4 |"), rows


def test_seed_placeholder_reads_each_runs_seed(tmp_path):
    """`{seed}` in an override (common or a variant's, nested too) becomes the run's seed: each seed starts
    from its own checkpoint of an earlier sweep; other strings and keys stay as written."""
    _write_yaml(tmp_path / "train.yaml", {"student": "s", "teachers": [{"path": "t"}], "kv_weight": 0})
    abl = _write_yaml(tmp_path / "a.yaml", {
        "base_config": "train.yaml", "output_dir": str(tmp_path / "o"), "seeds": [3, 4],
        "overrides": {"student": "sft/seed_{seed}/checkpoint-9", "run_name": "plain"},
        "variants": [{"name": "v", "overrides": {"teachers": [{"path": "t_{seed}", "name": "t"}]}}],
    })
    cfg = load_ablation_config(abl)
    runs = {s: ablate.run.train_config_for(cfg, cfg.variants[0], s) for s in (3, 4)}
    assert [r["student"] for r in runs.values()] == ["sft/seed_3/checkpoint-9", "sft/seed_4/checkpoint-9"]
    assert runs[4]["teachers"] == [{"path": "t_4", "name": "t"}] and runs[4]["run_name"] == "plain"
    assert cfg.overrides["student"] == "sft/seed_{seed}/checkpoint-9"  # the design (and its hash) keep the template


def test_config_errors(tmp_path):
    _write_yaml(tmp_path / "train.yaml", {"student": "s", "teachers": [{"path": "t"}], "kv_weight": 0})
    with pytest.raises(ConfigError, match="unknown key 'sedes'; did you mean 'seeds'"):
        load_ablation_config(_write_yaml(tmp_path / "a.yaml", {"base_config": "train.yaml", "sedes": [1]}))
    with pytest.raises(AblationError, match="baseline"):
        load_ablation_config(_write_yaml(tmp_path / "b.yaml", {"base_config": "train.yaml", "baseline": "x"}))
    with pytest.raises(AblationError, match="not found"):
        load_ablation_config(_write_yaml(tmp_path / "c.yaml", {"base_config": "nope.yaml"}))
    with pytest.raises(AblationError, match="eval"):
        load_ablation_config(
            _write_yaml(tmp_path / "d.yaml", {"base_config": "train.yaml", "eval": {"lim": 1}})
        )


def test_list_variants_cli(capsys):
    assert main(["--list-variants"]) == 0
    out = capsys.readouterr().out
    assert "untrained_teacher" in out and "set core" in out
    with pytest.raises(ConfigError, match="base_config"):
        main([])


# ----------------------------------------------------------------------------- end to end


def test_ablation_end_to_end_on_tiny_fixtures(tiny_world, tmp_path, capsys):
    m = tiny_world.models
    _write_yaml(
        tmp_path / "train.yaml",
        {
            "student": str(m["student"]),
            "teachers": [{"path": str(m["qwen2_teacher"])}],
            "data": str(tiny_world.data_dir),
            "max_length": 160,
            "max_steps": 3,
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 1,
            "learning_rate": 1e-3,
            "kv_warmup_steps": 0,
            "logging_steps": 1,
            "save_steps": 1000,
            "use_cpu": True,
            "dataloader_num_workers": 0,
            "disable_tqdm": True,
            "report_to": "none",
        },
    )
    abl = _write_yaml(
        tmp_path / "ablation.yaml",
        {
            "base_config": "train.yaml",
            "output_dir": str(tmp_path / "abl"),
            "seeds": [0, 1],
            "variants": ["baseline", "kv"],
            "eval": {"limit": 6, "batch_size": 6, "max_new_tokens": 8},
            "n_resamples": 500,
        },
    )
    assert main(["--config", str(abl)]) == 0
    out = tmp_path / "abl"
    for variant in ("baseline", "kv"):
        for seed in (0, 1):
            rdir = out / "runs" / variant / f"seed_{seed}"
            assert (rdir / "config.json").exists()  # the saved student
            assert json.loads((rdir / "eval" / "summary.json").read_text())["n"] == 6
    report = json.loads((out / "ablation.json").read_text())
    assert report["variants"]["kv"]["cos_sim"]["n"] == 2  # the KV runs logged a cos-sim
    assert report["variants"]["kv"]["vs_baseline"]["items"] == 12
    assert "| +KV | 2 |" in (out / "ablation.md").read_text()
    assert (out / "ablation_accuracy.png").exists() and (out / "ablation_curves.png").exists()
    # re-run: every run is skipped
    capsys.readouterr()
    mtime = (out / "runs" / "kv" / "seed_1" / "eval" / "summary.json").stat().st_mtime
    assert main(["--config", str(abl)]) == 0
    assert capsys.readouterr().out.count("finished, skipped") == 4
    assert (out / "runs" / "kv" / "seed_1" / "eval" / "summary.json").stat().st_mtime == mtime


def test_controls_references_and_the_primary_comparison(tmp_path):
    _write_yaml(tmp_path / "train.yaml", {"student": "s", "teachers": [{"path": "t"}], "kv_weight": 0})
    abl = _write_yaml(tmp_path / "a.yaml", {
        "base_config": "train.yaml", "output_dir": str(tmp_path / "out"), "seeds": [0, 1, 2, 3, 4],
        "variants": ["baseline", "relation", "relation_untrained", "relation_shuffled", "sft_no_rationale",
                     "privileged_kv"],
        "primary": ["relation", "baseline"], "n_resamples": 2000,
    })
    cfg = load_ablation_config(abl)
    assert cfg.variant("relation").controls == ["relation_untrained", "relation_shuffled"]
    assert cfg.references(cfg.variant("privileged_kv")) == ["sft_no_rationale"]  # its controls were not run
    fake = FakeRuns({"baseline": 0.3, "relation": 0.8, "relation_untrained": 0.3, "relation_shuffled": 0.75,
                     "sft_no_rationale": 0.1, "privileged_kv": 0.1})
    report = run_ablation(cfg, train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    rel = report["variants"]["relation"]
    assert set(rel["comparisons"]) == {"baseline", "relation_untrained", "relation_shuffled"}
    assert rel["comparisons"]["relation_untrained"]["ttest"]["p_value"] < 0.05
    priv = report["variants"]["privileged_kv"]
    assert priv["reference"] == "sft_no_rationale" and priv["vs_baseline"]["delta_accuracy"] == 0.0
    assert report["primary"]["variant"] == "relation" and report["primary"]["delta_accuracy"] > 0.4
    md = (tmp_path / "out" / "ablation.md").read_text()
    assert "## Primary comparison" in md and "**significant**" in md
    # a primary whose reference wins significantly says so (it is not "not significant")
    flipped = {**report, "primary": {**report["primary"], "variant": "baseline", "reference": "relation",
                                     "delta_accuracy": -report["primary"]["delta_accuracy"]}}
    assert "**significant, in the reference's favour**" in ablate.render.render_markdown(flipped)
    assert "## Against the controls" in md and "| +Relation | +Relation, shuffled teacher |" in md
    assert re.search(r"\| Privileged KV, no rationale \| privileged_kv_untrained \|( – \|)+ not run \|", md)
    # a control not run is no verdict: never "does not beat its reference and all controls" for it
    verdict = next(line for line in md.splitlines() if line.startswith("- Privileged KV, no rationale:"))
    assert verdict.startswith("- Privileged KV, no rationale: not judged against all controls (privileged_kv_untrained, "
                              "privileged_kv_shuffled: not run in this ablation); ")
    assert verdict.endswith("does not beat every one that was run.")  # 0.1 vs SFT-no-rationale's 0.1
    # relation vs shuffled (0.8 vs 0.75 on 200 items x 5 seeds) need not be significant: the verdict follows
    verdict = next(line for line in md.splitlines() if line.startswith("- +Relation:"))
    beats_all = all(
        rel["comparisons"][r]["ttest"]["p_value"] < 0.05 and rel["comparisons"][r]["permutation_p"] < 0.05
        for r in rel["comparisons"])
    assert ("beats its reference and all controls**" in verdict) == beats_all


@pytest.mark.parametrize("permute, vocab, equal", [("names", ["a", "b"], True), ("numbers", "0..9", False)])
def test_a_control_that_keeps_the_meaning_must_equal_the_signal_not_lose_to_it(tmp_path, permute, vocab, equal):
    """Renamed variables keep a program's meaning: +KV should equal that permuted teacher (TOST), and the
    verdict counts it so; relabelled numbers destroy it: +KV must beat it, and at equal accuracy does not."""
    _write_yaml(tmp_path / "train.yaml", {"student": "s", "teachers": [{"path": "t"}], "kv_weight": 0})
    abl = _write_yaml(tmp_path / "a.yaml", {
        "base_config": "train.yaml", "output_dir": str(tmp_path / "out"), "seeds": [0, 1, 2, 3, 4], "margin": 0.05,
        "variants": ["baseline", {"name": "kv", "base": "kv", "controls": ["kv_shuffled", "kv_permuted"]},
                     "kv_shuffled", {"name": "kv_permuted", "base": "kv", "overrides": {
                         "teacher_control": "permuted", "permute": permute, "permute_vocab": vocab}}],
        "n_resamples": 500,
    })
    fake = FakeRuns({"baseline": 0.3, "kv": 0.8, "kv_shuffled": 0.3, "kv_permuted": 0.8})
    report = run_ablation(load_ablation_config(abl), train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    assert report["variants"]["kv"]["comparisons"]["kv_permuted"]["tost"]["equivalent"]
    md = (tmp_path / "out" / "ablation.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| +KV | +KV + kv_permuted [control: permuted"))
    assert row.endswith("| equal: yes |" if equal else "| beats it: no |")
    verdict = next(line for line in md.splitlines() if line.startswith("- +KV:"))
    assert ("beats its reference and all controls**" in verdict) == equal


@pytest.mark.parametrize("shuffled_acc, shuffled_nll, beaten", [(0.8, 1.0, True), (0.3, 0.5, False)])
def test_controls_are_judged_on_the_registered_metric(tmp_path, shuffled_acc, shuffled_nll, beaten):
    """A primary registered on answer NLL judges the controls on answer NLL: +KV beats a control of equal
    accuracy and higher NLL, and does not beat one it outscores on accuracy at equal NLL."""
    _write_yaml(tmp_path / "train.yaml", {"student": "s", "teachers": [{"path": "t"}], "kv_weight": 0})
    abl = _write_yaml(tmp_path / "a.yaml", {
        "base_config": "train.yaml", "output_dir": str(tmp_path / "out"), "seeds": [0, 1, 2, 3, 4],
        "variants": ["baseline", {"name": "kv", "base": "kv", "controls": ["kv_shuffled"]}, "kv_shuffled"],
        "primary": {"comparison": ["kv", "baseline"], "metric": "answer_nll", "test": "paired_t"}, "n_resamples": 500,
    })
    fake = FakeRuns({"baseline": 0.3, "kv": 0.8, "kv_shuffled": shuffled_acc},
                    nll={"baseline": 1.2, "kv": 0.5, "kv_shuffled": shuffled_nll})
    report = run_ablation(load_ablation_config(abl), train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    registered = report["variants"]["kv"]["comparisons"]["kv_shuffled"]["registered"]
    assert (registered["p_value"] < 0.05 and registered["mean_diff"] < 0) == beaten
    md = (tmp_path / "out" / "ablation.md").read_text()
    assert "on the registered answer NLL by its paired t test at alpha 0.05" in md
    row = next(line for line in md.splitlines() if line.startswith("| +KV | +KV, shuffled teacher"))
    assert "| Δ answer NLL " in row and row.endswith(f"| beats it: {'yes' if beaten else 'no'} |")
    verdict = next(line for line in md.splitlines() if line.startswith("- +KV:"))
    assert ("beats its reference and all controls**" in verdict) == beaten


@pytest.mark.parametrize("kv_nll, shuffled_nll, missed", [(0.5, 1.1, None), (1.2, 2.0, "Baseline (SFT)"),
                                                        (0.5, 0.5, "+KV, shuffled teacher")])
def test_a_primary_against_several_arms_is_met_only_if_it_beats_each(tmp_path, kv_nll, shuffled_nll, missed):
    """`comparison: [kv, [baseline, kv_shuffled]]` registers one claim, "kv beats every one": met only when
    each pair's registered test is significant kv's way (intersection-union). A control that hurts (NLL 2.0)
    does not meet it for a kv no better than SFT, since SFT is named beside it."""
    _write_yaml(tmp_path / "train.yaml", {"student": "s", "teachers": [{"path": "t"}], "kv_weight": 0})
    primary = {"comparison": ["kv", ["baseline", "kv_shuffled"]], "metric": "answer_nll", "test": "paired_t"}
    abl = _write_yaml(tmp_path / "a.yaml", {
        "base_config": "train.yaml", "output_dir": str(tmp_path / "out"), "seeds": [0, 1, 2, 3, 4],
        "variants": ["baseline", {"name": "kv", "base": "kv", "controls": ["kv_shuffled"]}, "kv_shuffled"],
        "hypothesis": "kv beats SFT and its shuffled control", "primary": primary, "n_resamples": 200,
    })
    fake = FakeRuns({"baseline": 0.3, "kv": 0.8, "kv_shuffled": 0.3},
                    nll={"baseline": 1.2, "kv": kv_nll, "kv_shuffled": shuffled_nll})
    report = run_ablation(load_ablation_config(abl), train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    prim = report["primary"]
    assert set(prim["results"]) == {"baseline", "kv_shuffled"} and prim["reference"] == "baseline"
    assert prim["spec"]["comparison"] == ["kv", ["baseline", "kv_shuffled"]]
    words = (f"not shown: +KV does not beat {missed} on" if missed else
             "+KV beats every one of Baseline (SFT); +KV, shuffled teacher on")
    assert prim["verdict"].startswith(words + " answer NLL at alpha 0.05 (paired t: Baseline (SFT) p ")
    md = (tmp_path / "out" / "ablation.md").read_text()
    assert f"+KV vs Baseline (SFT); +KV, shuffled teacher over seeds [0, 1, 2, 3, 4], the registered metric (answer NLL): " \
           f"{prim['verdict']}." in md and "The first pair on accuracy (not the registered test):" in md
    # one reference is recorded as before (earlier sweeps' records keep their hash)
    assert parse_primary({"comparison": ["kv", ["baseline"]]}, ["kv", "baseline"], None).to_dict()["comparison"] \
        == ["kv", "baseline"]


def test_reference_must_be_run(tmp_path):
    _write_yaml(tmp_path / "train.yaml", {"student": "s", "teachers": [{"path": "t"}], "kv_weight": 0})
    abl = _write_yaml(tmp_path / "a.yaml", {"base_config": "train.yaml", "variants": ["baseline", "privileged_kv"]})
    with pytest.raises(AblationError, match="sft_no_rationale"):
        load_ablation_config(abl)


_POOL_PARENT = """
import os, time
from kvdistill.commands import ablate

def nap():
    print(os.getpid(), flush=True)
    time.sleep(60)

if __name__ == "__main__":
    with ablate.run._pool(1, 1) as pool:
        pool.submit(nap)
        time.sleep(60)
"""


def _running(pid: int) -> bool:
    """`pid` exists and is not a zombie (an orphan's new parent may not reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_pool_workers_exit_when_the_ablation_is_killed(tmp_path):
    """A killed ablation's workers must not train on as orphans (writing into the run dirs a restart reuses)."""
    script = tmp_path / "parent.py"
    script.write_text(_POOL_PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    worker = None
    try:
        worker = int(parent.stdout.readline())  # the worker is in its task
        assert _running(worker)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while _running(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(worker), "the worker outlived its parent"
    finally:
        parent.kill()
        if worker is not None and _running(worker):
            os.kill(worker, signal.SIGKILL)


# ~26 s of worker start-ups; the pool itself stays in CI (test_pool_workers_exit_when_the_ablation_is_killed)
@pytest.mark.extended
def test_parallel_workers_give_the_same_numbers_as_one_process(tiny_world, tmp_path):
    """Two worker processes, one thread per run, the capture made in a worker while the baseline
    trains: each run's accuracy and losses equal the in-process run's."""
    m = tiny_world.models
    _write_yaml(tmp_path / "train.yaml", {
        "student": str(m["student"]), "teachers": [{"path": str(m["qwen2_teacher"])}], "data": str(tiny_world.data_dir),
        "max_length": 160, "max_steps": 3, "max_samples": 12, "per_device_train_batch_size": 4,  # 12: what 3 steps read
        "gradient_accumulation_steps": 1, "learning_rate": 1e-3, "kv_warmup_steps": 0, "logging_steps": 1,
        "save_strategy": "no", "use_cpu": True, "disable_tqdm": True, "report_to": "none",
    })
    results = {}
    for workers in (1, 2):
        abl = _write_yaml(tmp_path / f"a{workers}.yaml", {
            "base_config": "train.yaml", "output_dir": str(tmp_path / f"w{workers}"), "seeds": [0],
            "variants": ["baseline", "relation"], "eval": {"limit": 6, "batch_size": 6, "max_new_tokens": 8},
            "n_resamples": 200, "workers": workers, "threads": 1, "capture": True,
        })
        assert main(["--config", str(abl)]) == 0
        report = json.loads((tmp_path / f"w{workers}" / "ablation.json").read_text())
        results[workers] = {v: (r["runs"]["0"]["accuracy"], r["runs"]["0"]["ce"]) for v, r in report["variants"].items()}
        # one setup (run dates dropped), recorded with its thread count
        assert len(report["environments"]) == 1 and report["environments"][0]["torch_threads"] == 1
        if workers == 2:  # a spawned worker keeps freed memory, as every `kvdistill` process does
            assert report["environments"][0]["allocator"] == "keep_freed"
    assert results[1] == results[2]


# ~13 s (five trainings and their captures); capture = live for one run stays in CI (tests/train/test_capture.py)
@pytest.mark.extended
def test_capture_trains_every_seed_from_one_capture_per_variant(tiny_world, tmp_path, capsys):
    """`capture: true`: the teachers run once per variant (per seed for the untrained control), once in
    all for variants that read them alike (the shuffled control links to the signal's capture); the
    runs read them from the capture and give the live runs' numbers."""
    m = tiny_world.models
    _write_yaml(tmp_path / "train.yaml", {
        "student": str(m["student"]), "teachers": [{"path": str(m["qwen2_teacher"])}], "data": str(tiny_world.data_dir),
        "max_length": 160, "max_steps": 3, "max_samples": 8, "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1, "learning_rate": 1e-3, "kv_warmup_steps": 0, "logging_steps": 1,
        "save_strategy": "no", "use_cpu": True, "disable_tqdm": True, "report_to": "none",
    })
    results = {}
    for capture, seeds, variants in ((True, [0, 1], ["kv", "kv_shuffled", "kv_untrained", "baseline"]),
                                     (False, [1], ["kv"])):
        abl = _write_yaml(tmp_path / f"c{capture}.yaml", {
            "base_config": "train.yaml", "output_dir": str(tmp_path / f"c{capture}"), "seeds": seeds,
            "variants": variants, "eval": {"limit": 6, "batch_size": 6, "max_new_tokens": 8},
            "n_resamples": 200, "capture": capture,
        })
        assert main(["--config", str(abl)]) == 0
        run = json.loads((tmp_path / f"c{capture}" / "ablation.json").read_text())["variants"]["kv"]["runs"]["1"]
        results[capture] = (run["accuracy"], run["ce"], run["cos_sim"])
    out = capsys.readouterr().out
    captures = tmp_path / "cTrue" / "captures"
    assert sorted(p.name for p in captures.iterdir()) == ["kv", "kv_shuffled", "kv_untrained_seed0",
                                                          "kv_untrained_seed1"]
    assert out.count("capture: ") == 4  # once each, before the runs; none for the baseline
    assert out.count(": linked") == 1 and (captures / "kv_shuffled").is_symlink()
    assert (captures / "kv_shuffled").resolve() == (captures / "kv").resolve()
    assert not any(p.is_symlink() for p in captures.iterdir() if p.name != "kv_shuffled")  # seeds differ
    for variant in ("kv", "kv_shuffled", "kv_untrained"):
        for seed in (0, 1):
            saved = yaml.safe_load((tmp_path / "cTrue" / "runs" / variant / f"seed_{seed}" / "train_config.yaml").read_text())
            assert saved["teacher_capture"].startswith(str(captures))
    assert results[True] == pytest.approx(results[False], rel=1e-5)  # accuracy, final CE and cos-sim of a run


# ============================================================================= continuous metrics, equivalence,
# pre-registration (issue 30 items 5-6): synthetic runs only, nothing trains


class CurveRuns(FakeRuns):
    """FakeRuns whose runs also log a dev-accuracy curve (`eval_accuracy` at steps 2..10, reaching
    `acc * step / 10 + 0.01 * seed`) and whose evaluation writes an answer NLL (`2 - acc + 0.01 * seed`)."""

    def train(self, argv):
        rc = super().train(argv)
        cfg = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text())
        out, seed = Path(cfg["output_dir"]), int(cfg["seed"])
        acc = self.acc[out.parent.name]
        with (out / "metrics.jsonl").open("a") as fh:
            for step in range(2, 11, 2):
                fh.write(json.dumps({"step": step, "eval_accuracy": acc * step / 10 + 0.01 * seed}) + "\n")
        return rc

    def eval(self, model_dir, out_dir, settings):
        super().eval(model_dir, out_dir, settings)
        variant, seed = Path(model_dir).parent.name, int(Path(model_dir).name.split("_")[1])
        path = Path(out_dir) / "summary.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "answer_nll": 2 - self.acc[variant] + 0.01 * seed}))


def _curve_ablation(tmp_path, **extra):
    _write_yaml(tmp_path / "train.yaml", {"student": "s", "kv_weight": 0, "teachers": [{"path": "t"}]})  # kv reads one
    spec = {"base_config": "train.yaml", "output_dir": str(tmp_path / "out"), "seeds": [0, 1, 2, 3, 4],
            "variants": ["baseline", "kv", {"name": "same", "overrides": {"kv_weight": 0.0}}],
            "n_resamples": 500, **extra}
    return _write_yaml(tmp_path / "a.yaml", spec)


def test_register_only_fixes_the_design_and_runs_nothing_then_copied_runs_are_reused(tmp_path, capsys):
    """`--register_only` writes the record and no run; runs made elsewhere with the same settings, copied in
    afterwards, are reused under that record (not rerun), and the record keeps its date."""
    primary = {"comparison": ["kv", "baseline"], "test": "welch"}
    fake = CurveRuns({"baseline": 0.3, "kv": 0.7, "same": 0.3})
    elsewhere = load_ablation_config(_curve_ablation(tmp_path, output_dir=str(tmp_path / "elsewhere")))
    run_ablation(elsewhere, train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    abl = _curve_ablation(tmp_path, hypothesis="KV helps", primary=primary)
    out = tmp_path / "out"
    assert main(["--config", str(abl), "--register_only"]) == 0
    assert "nothing run" in capsys.readouterr().out and not (out / "runs").exists()
    first = json.loads((out / "preregistration.json").read_text())
    assert first["hypothesis"] == "KV helps" and first["primary"]["test"] == "welch"
    shutil.copytree(tmp_path / "elsewhere" / "runs", out / "runs")
    fake.trained.clear()
    report = run_ablation(load_ablation_config(abl), train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    assert fake.trained == [] and len(report["variants"]["kv"]["seeds"]) == 5
    assert json.loads((out / "preregistration.json").read_text())["registered"] == first["registered"]
    # a dir with runs but no record: registering now is refused (the runs came first)
    shutil.rmtree(tmp_path / "elsewhere" / "runs" / "kv")
    (tmp_path / "elsewhere" / "preregistration.json").unlink()
    late = _curve_ablation(tmp_path, hypothesis="KV helps", primary=primary, output_dir=str(tmp_path / "elsewhere"))
    with pytest.raises(ConfigError, match="holds runs made before any pre-registration"):
        main(["--config", str(late), "--register_only"])


def test_answer_nll_steps_to_threshold_welch_and_tost_in_the_report(tmp_path):
    abl = _curve_ablation(tmp_path, threshold=0.5, margin=0.05)
    fake = CurveRuns({"baseline": 0.3, "kv": 0.7, "same": 0.3})
    report = run_ablation(load_ablation_config(abl), train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    kv, base = report["variants"]["kv"], report["variants"]["baseline"]
    # kv: 0.7 * 8 / 10 + 0.01 s >= 0.5 first at step 8 (step 6: 0.42 + 0.01 s < 0.5); the baseline never: censored at 10
    assert kv["runs"]["3"]["steps"] == (8, True) and base["runs"]["3"]["steps"] == (10, False)
    assert kv["steps_to_threshold"] == {"n": 5, "reached": 5, "median": 8}
    assert base["steps_to_threshold"]["reached"] == 0 and base["steps_to_threshold"]["median"] == float("inf")
    assert kv["answer_nll"]["mean"] == pytest.approx(1.3 + 0.02)
    cmp_ = kv["vs_baseline"]
    assert cmp_["steps"]["logrank"]["p_value"] < 0.01 and cmp_["steps"]["logrank"]["statistic"] > 0
    assert cmp_["steps"]["mann_whitney"]["p_value"] < 0.05
    assert cmp_["answer_nll"]["mean_diff"] == pytest.approx(-0.4) and cmp_["answer_nll"]["paired_t"]["p_value"] == 0.0
    assert cmp_["welch"]["n"] == 10 and cmp_["welch"]["p_value"] < 0.05
    assert not cmp_["tost"]["equivalent"]  # 0.4 apart: not equivalent within 0.05
    same = report["variants"]["same"]["vs_baseline"]
    assert same["tost"]["equivalent"] and same["tost"]["verdict"] == "equivalent within ±0.05"
    md = (tmp_path / "out" / "ablation.md").read_text()
    assert "| Welch p (seeds) |" in md and "## Answer NLL, steps to the threshold, equivalence" in md
    assert "| +KV | 1.320 ± 0.016 | 5/5 | 8 | Baseline (SFT) | -0.400 |" in md
    assert "| Baseline (SFT) | 1.720 ± 0.016 | 0/5 | never |" in md
    assert "| Baseline (SFT) | 3 | 0.2" in md and "| 10 | > 10 |" in md  # runs table: censored at the budget
    saved = json.loads((tmp_path / "out" / "ablation.json").read_text())  # strict JSON: inf -> null
    assert saved["variants"]["baseline"]["steps_to_threshold"]["median"] is None
    # the survival curves: a plot, named in the report
    assert (tmp_path / "out" / "ablation_survival.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ablation_survival.png" in md
    # without a dev curve: no steps (and no crash)
    fake_flat = FakeRuns(fake.acc)
    report = run_ablation(load_ablation_config(abl, output_dir=str(tmp_path / "flat")), train_fn=fake_flat.train,
                          eval_fn=fake_flat.eval, log=lambda s: None)
    assert report["variants"]["kv"]["steps_to_threshold"]["n"] == 0
    assert report["variants"]["kv"]["vs_baseline"]["steps"] is None
    assert not (tmp_path / "flat" / "ablation_survival.png").exists()  # no curve, no survival plot


@pytest.mark.parametrize("primary, words", [
    ({"comparison": ["kv", "baseline"], "test": "welch"}, "+KV beats Baseline (SFT) on accuracy at alpha 0.05"),
    (["baseline", "kv"], "+KV beats Baseline (SFT) on accuracy at alpha 0.05 (paired t p"),
    ({"comparison": ["kv", "baseline"], "metric": "answer_nll", "test": "mann_whitney"},
     "+KV beats Baseline (SFT) on answer NLL at alpha 0.05"),
    ({"comparison": ["kv", "baseline"], "metric": "steps_to_threshold", "test": "logrank", "alpha": 0.01},
     "+KV beats Baseline (SFT) on steps to threshold at alpha 0.01 (logrank p"),
    ({"comparison": ["same", "baseline"], "test": "welch"}, "neither shown: same vs Baseline (SFT) on accuracy"),
    ({"comparison": ["same", "baseline"], "test": "tost", "margin": 0.05},
     "same and Baseline (SFT) are equivalent within ±0.05 on accuracy at alpha 0.05 (TOST p"),
    ({"comparison": ["kv", "baseline"], "test": "tost", "margin": 0.05, "paired": True},
     "+KV and Baseline (SFT) are not shown equivalent within ±0.05 on accuracy"),
])
def test_the_report_leads_with_the_primary_result_in_words(tmp_path, primary, words):
    abl = _curve_ablation(tmp_path, threshold=0.5, primary=primary, hypothesis="KV makes the student better")
    fake = CurveRuns({"baseline": 0.3, "kv": 0.7, "same": 0.3})
    report = run_ablation(load_ablation_config(abl), train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    assert report["primary"]["verdict"].startswith(words)
    lead = (tmp_path / "out" / "ablation.md").read_text().split("Base config")[0]  # before anything else
    assert lead.startswith("# Ablation\n\n**Hypothesis** (pre-registered 20") and "KV makes the student better" in lead
    assert f"**Primary result** ({METRIC_NAMES[report['primary']['spec']['metric']]}" in lead and words in lead
    # the primary section opens with the registered metric's result; accuracy follows, named as not the test
    section = (tmp_path / "out" / "ablation.md").read_text().split("## Primary comparison")[1].split("\n| variant")[0]
    metric = report["primary"]["spec"]["metric"]
    assert ("(not the registered test)" in section) == (metric != "accuracy")
    if metric != "accuracy":
        assert -1 < section.find(report["primary"]["verdict"]) < section.index("Δ accuracy")


def test_preregistration_is_written_before_the_first_run_and_fixed_once_runs_exist(tmp_path):
    primary = {"comparison": ["kv", "baseline"], "test": "welch"}
    abl = _curve_ablation(tmp_path, hypothesis="KV helps", primary=primary)
    record = tmp_path / "out" / "preregistration.json"
    fake = CurveRuns({"baseline": 0.3, "kv": 0.7, "same": 0.3})

    def train(argv):  # the record is on disk before anything trains
        saved = json.loads(record.read_text())
        assert saved["hypothesis"] == "KV helps" and saved["primary"]["test"] == "welch"
        return fake.train(argv)

    cfg = load_ablation_config(abl)
    run_ablation(cfg, train_fn=train, eval_fn=fake.eval, log=lambda s: None)
    first = json.loads(record.read_text())
    assert first["config_hash"] == ablate.design.preregistration(cfg)["config_hash"] and first["config"]["seeds"] == [0, 1, 2, 3, 4]
    run_ablation(load_ablation_config(abl), train_fn=train, eval_fn=fake.eval, log=lambda s: None)  # same: resumes
    assert json.loads(record.read_text())["registered"] == first["registered"]
    for change, what in (({"hypothesis": "KV hurts"}, "another hypothesis"),
                         ({"primary": {**primary, "test": "mann_whitney"}}, "another primary"),
                         ({"seeds": [0, 1, 2, 3, 4, 5]}, "another config hash"),
                         ({"overrides": {"max_steps": 20}}, "another config hash")):
        with pytest.raises(ConfigError, match=f"holds runs pre-registered under {what} .*restore the ablation YAML "
                                              "or set another output_dir"):
            run_ablation(load_ablation_config(_curve_ablation(tmp_path, **{"hypothesis": "KV helps", "primary": primary,
                                                                           **change})),
                         train_fn=train, eval_fn=fake.eval, log=lambda s: None)
    assert json.loads(record.read_text()) == first  # untouched by the refused runs
    # --report_only writes no record, and the report names the registration
    abl = _curve_ablation(tmp_path, hypothesis="KV helps", primary=primary)
    assert main(["--config", str(abl), "--report_only"]) == 0
    assert json.loads(record.read_text()) == first
    assert f"config hash `{first['config_hash']}`" in (tmp_path / "out" / "ablation.md").read_text()


def test_a_variants_subset_runs_under_the_yamls_full_preregistration(tmp_path):
    """`--variants` / `--seeds` pick runs of the YAML's design: the primary arms first, then the full list or
    another subset (a YAML variant picked by its name) run under the same pre-registration; a changed YAML is
    refused."""
    primary = {"comparison": ["kv", "baseline"], "test": "welch"}
    abl = _curve_ablation(tmp_path, hypothesis="KV helps", primary=primary)
    record = tmp_path / "out" / "preregistration.json"
    fake = CurveRuns({"baseline": 0.3, "kv": 0.7, "same": 0.3})
    run = dict(train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    report = run_ablation(load_ablation_config(abl, variants="kv,baseline", seeds="0,1"), **run)
    assert sorted({Path(r).parent.name for r in fake.trained}) == ["baseline", "kv"] and len(fake.trained) == 4
    first = json.loads(record.read_text())
    assert [v["name"] for v in first["config"]["variants"]] == ["baseline", "kv", "same"]
    assert first["config"]["seeds"] == [0, 1, 2, 3, 4] and first["config"]["baseline"] == "baseline"
    assert report["primary"]["spec"]["comparison"] == ["kv", "baseline"]
    run_ablation(load_ablation_config(abl, variants="same"), **run)  # another subset, without the primary arms
    report = run_ablation(load_ablation_config(abl), **run)  # the full list
    assert len(fake.trained) == 15 and json.loads(record.read_text()) == first
    assert report["preregistration"]["registered"] == first["registered"] and report["primary"]["verdict"]
    changed = _curve_ablation(tmp_path, hypothesis="KV helps", primary=primary, overrides={"max_steps": 20})
    with pytest.raises(ConfigError, match="holds runs pre-registered under another config hash"):
        run_ablation(load_ablation_config(changed, variants="kv,baseline"), **run)
    assert json.loads(record.read_text()) == first


def test_a_one_seed_comparison_beats_nothing():
    """One seed has no paired t p-value (None): the report says "no", it does not crash (a partial sweep)."""
    cmp_ = {"delta_accuracy": 0.08, "ttest": {"p_value": None}, "permutation_p": 0.001}
    assert not ablate.render._beats(cmp_) and not ablate.render._beats(None)
    assert ablate.render._beats({**cmp_, "ttest": {"p_value": 0.01}})


def test_a_hypothesis_named_after_the_runs_is_refused_and_none_is_never_refused(tmp_path):
    fake = CurveRuns({"baseline": 0.3, "kv": 0.7, "same": 0.3})
    run = dict(train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    run_ablation(load_ablation_config(_curve_ablation(tmp_path)), **run)  # no hypothesis: recorded, not fixed
    record = tmp_path / "out" / "preregistration.json"
    assert json.loads(record.read_text())["hypothesis"] is None
    run_ablation(load_ablation_config(_curve_ablation(tmp_path, variants=["baseline", "kv"])), **run)  # may change
    record.unlink()  # runs from before pre-registration existed
    with pytest.raises(ConfigError, match="holds runs made before any pre-registration"):
        run_ablation(load_ablation_config(_curve_ablation(tmp_path, hypothesis="KV helps")), **run)


@pytest.mark.parametrize("extra, message", [
    ({"primary": {"comparison": ["kv", "nope"]}}, "primary comparison must name two of the variants"),
    ({"primary": {"comparison": ["kv", ["baseline", "nope"]]}}, "primary comparison must name two of the variants"),
    ({"primary": {"comparison": ["kv", ["baseline", "kv"]]}}, "primary comparison must name two of the variants"),
    ({"primary": {"comparison": ["kv", []]}}, "primary comparison must name two of the variants"),
    ({"primary": {"comparison": ["kv", ["same", "baseline"]], "test": "tost", "margin": 0.05}},
     "tost names one reference"),
    ({"primary": {"comparison": ["kv", "baseline"], "metric": "bleu"}}, "primary metric 'bleu' is not one of"),
    ({"primary": {"comparison": ["kv", "baseline"], "test": "logrank"}},
     "primary test 'logrank' does not fit metric accuracy; use one of"),
    ({"primary": {"comparison": ["kv", "baseline"], "metric": "steps_to_threshold", "test": "welch"},
      "threshold": 0.5}, "does not fit metric steps_to_threshold"),
    ({"primary": {"comparison": ["kv", "baseline"], "test": "tost"}}, "tost needs margin: > 0"),
    ({"primary": {"comparison": ["kv", "baseline"], "metric": "steps_to_threshold", "test": "logrank"}},
     "steps_to_threshold needs `threshold:`"),
    ({"primary": {"comparison": ["kv", "baseline"], "alpha": 0.7}}, r"alpha must be in \(0, 0.5\)"),
    ({"primary": {"comparison": ["kv", "baseline"], "tets": "welch"}}, r"unknown keys \['tets'\]"),
    # a list of tests: each fits the metric, tost among them needs its margin and one reference
    ({"primary": {"comparison": ["kv", "baseline"], "test": ["paired_t", "logrank"]}},
     "primary test 'logrank' does not fit metric accuracy; use one of"),
    ({"primary": {"comparison": ["kv", "baseline"], "metric": "answer_nll", "test": ["paired_t", "tost"]}},
     "tost needs margin: > 0"),
    ({"primary": {"comparison": ["kv", ["same", "baseline"]], "test": ["welch", "tost"], "margin": 0.05}},
     "tost names one reference"),
    ({"primary": {"comparison": ["kv", "baseline"], "test": []}}, "one test or a list of different tests"),
    ({"primary": {"comparison": ["kv", "baseline"], "test": ["welch", "welch"]}},
     "one test or a list of different tests"),
    ({"threshold": 1.5}, r"threshold is a dev accuracy in \(0, 1\]"),
    ({"margin": -0.1}, "margin is an accuracy difference"),
])
def test_primary_and_threshold_config_errors(tmp_path, extra, message):
    with pytest.raises(AblationError, match=message):
        load_ablation_config(_curve_ablation(tmp_path, **extra))


# ----------------------------------------------------------------------------- several tests of one primary

_NLL_BASE = [1.50, 1.62, 1.41, 1.55, 1.47]  # Baseline's answer NLL per seed; +KV's is it plus a hand-made shift
_LABELS = {"kv": "+KV", "baseline": "Baseline (SFT)"}
_TWO_TESTS = {"comparison": ["kv", "baseline"], "metric": "answer_nll", "test": ["paired_t", "tost"], "margin": 0.1,
              "paired": True}


def _nll_runs(shift):
    return {"baseline": {s: {"answer_nll": v} for s, v in enumerate(_NLL_BASE)},
            "kv": {s: {"answer_nll": v + d} for s, (v, d) in enumerate(zip(_NLL_BASE, shift))}}


@pytest.mark.parametrize("shift, lines", [
    # 0.5 lower every seed: paired t rejects, and ±0.1 cannot hold it
    ([-0.50, -0.52, -0.48, -0.51, -0.49],
     ["+KV beats Baseline (SFT) on answer NLL at alpha 0.05 (paired t p 2.397e-07)",
      "+KV and Baseline (SFT) are not shown equivalent within ±0.1 on answer NLL at alpha 0.05 (TOST p 1, 90% CI "
      "of Δ [-0.5151, -0.4849])"]),
    # a shift of mean 0 and spread 0.016: no difference shown, equivalence within ±0.1 is
    ([0.01, -0.01, 0.02, -0.02, 0.0],
     ["neither shown: +KV vs Baseline (SFT) on answer NLL, paired t p 1 ≥ alpha 0.05",
      "+KV and Baseline (SFT) are equivalent within ±0.1 on answer NLL at alpha 0.05 (TOST p 7.256e-05, 90% CI "
      "of Δ [-0.01507, +0.01507])"]),
    # 0.03 lower, tightly: both hold (a real difference, smaller than what would matter)
    ([-0.03, -0.031, -0.029, -0.03, -0.03],
     ["+KV beats Baseline (SFT) on answer NLL at alpha 0.05 (paired t p 7.402e-08)",
      "+KV and Baseline (SFT) are equivalent within ±0.1 on answer NLL at alpha 0.05 (TOST p 1.249e-09, 90% CI "
      "of Δ [-0.03067, -0.02933])"]),
])
def test_a_primary_of_two_tests_states_each_verdict_and_equals_each_single_test(shift, lines):
    """`test: [paired_t, tost]` runs both on the same per-seed values and states each, one line each, in the
    words (and with the results) each test alone registers."""
    from kvdistill.commands.ablate.summary import primary_result

    runs = _nll_runs(shift)
    both = parse_primary(_TWO_TESTS, ["kv", "baseline"], None)
    got = primary_result(both, runs, _LABELS)
    assert list(got["tests"]) == ["paired_t", "tost"] and got["verdict"].split("\n") == lines
    assert [got["tests"][t]["verdict"] for t in both.tests] == lines
    for test in both.tests:  # the list form is each single form, to the byte
        alone = parse_primary({**_TWO_TESTS, "test": test}, ["kv", "baseline"], None)
        assert alone == both.single(test)
        assert json.dumps(primary_result(alone, runs, _LABELS)) == json.dumps(got["tests"][test])


def test_a_single_test_primary_keeps_its_record_and_hash():
    """A single test (and a list of one) is recorded as before: the committed records of earlier sweeps and the
    hashes the code gave them before lists existed are unchanged."""
    from kvdistill.lab.prereg import config_hash, make_record

    names = ["kv", "baseline", "kv_shuffled"]
    for spec, digest, record in [
        ({"comparison": ["kv", "baseline"], "metric": "answer_nll", "test": "paired_t"},
         "aed869d568b015f4", "44372903a493ef23"),
        ({"comparison": ["kv", "baseline"], "metric": "answer_nll", "test": ["paired_t"]},
         "aed869d568b015f4", "44372903a493ef23"),
        ({"comparison": ["kv", ["baseline", "kv_shuffled"]], "metric": "answer_nll"},
         "23f19facaa94ca4e", "aa510cc78d8ff797"),
        ({"comparison": ["kv", "baseline"], "test": "tost", "margin": 0.1, "paired": True},
         "9eb94c517ad136c8", "f72a3ac8cb8f19b4"),
    ]:
        p = parse_primary(spec, names, None)
        assert isinstance(p.test, str) and config_hash(p.to_dict()) == digest
        assert config_hash(make_record("h", p, {"seeds": [0, 1, 2]})) == record
    assert json.dumps(parse_primary(spec, names, None).to_dict()) == (
        '{"comparison": ["kv", "baseline"], "metric": "accuracy", "test": "tost", "alpha": 0.05, "margin": 0.1, '
        '"paired": true}')
    # the committed records: each evidence YAML's primary written now is the one on disk, to the byte
    root = Path(__file__).resolve().parents[2]
    checked = 0
    for path in sorted((root / "docs" / "results").glob("evidence*/preregistration.json")):
        yaml_path = root / "configs" / "demo" / f"{path.parent.name}.yaml"
        saved = json.loads(path.read_text())["primary"]
        if saved is None or not yaml_path.exists():
            continue
        assert json.dumps(load_ablation_config(yaml_path).primary.to_dict()) == json.dumps(saved), path
        checked += 1
    assert checked


def test_a_registered_sweep_of_two_tests_records_the_list_and_reports_each(tmp_path):
    """`test: [paired_t, tost]` end to end: preregistration.json records the list; ablation.json holds each
    test's results and verdict; ablation.md leads with one **Primary result** line per test."""
    primary = {"comparison": ["kv", "baseline"], "metric": "answer_nll", "test": ["paired_t", "tost"],
               "margin": 0.1, "paired": True}
    abl = _curve_ablation(tmp_path, primary=primary, hypothesis="KV lowers answer NLL, by more than 0.1")
    fake = CurveRuns({"baseline": 0.3, "kv": 0.7, "same": 0.3})
    report = run_ablation(load_ablation_config(abl), train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    saved = json.loads((tmp_path / "out" / "preregistration.json").read_text())["primary"]
    assert saved == {"comparison": ["kv", "baseline"], "metric": "answer_nll", "test": ["paired_t", "tost"],
                     "alpha": 0.05, "margin": 0.1, "paired": True}
    prim = json.loads((tmp_path / "out" / "ablation.json").read_text())["primary"]
    assert prim["verdict"] == report["primary"]["verdict"] and list(prim["tests"]) == ["paired_t", "tost"]
    beat, equal = (prim["tests"][t]["verdict"] for t in ("paired_t", "tost"))
    assert beat.startswith("+KV beats Baseline (SFT) on answer NLL at alpha 0.05 (paired t p")
    assert equal.startswith("+KV and Baseline (SFT) are not shown equivalent within ±0.1 on answer NLL")
    assert prim["verdict"] == f"{beat}\n{equal}"
    md = (tmp_path / "out" / "ablation.md").read_text()
    lead = md.split("Base config")[0]
    assert (f"**Primary result** (answer NLL, paired t, alpha 0.05): {beat}.\n\n"
            f"**Primary result** (answer NLL, tost, alpha 0.05): {equal}.\n\n") in lead
    section = md.split("## Primary comparison")[1].split("\n| variant")[0]
    assert -1 < section.index(beat) < section.index(equal) < section.index("(not the registered test)")
    # the same YAML again: the list is the record in force, nothing is refused
    run_ablation(load_ablation_config(abl), train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)


def test_evidence_configs_load_and_their_committed_reports_render():
    """Every evidence YAML loads: the older ones (no hypothesis) read `[a, b]` primaries as paired t on
    accuracy, the pre-registered ones (a hypothesis) name their primary comparison; the committed reports
    (older ablation.json without the new keys) render."""
    root = Path(__file__).resolve().parents[2]
    configs = [load_ablation_config(path) for path in sorted((root / "configs" / "demo").glob("evidence*.yaml"))]
    older = [cfg for cfg in configs if cfg.hypothesis is None]
    assert older and all(cfg.primary is None or cfg.primary.test == "paired_t" for cfg in older)
    assert all(cfg.primary is not None for cfg in configs if cfg.hypothesis is not None)
    for path in sorted((root / "docs" / "results").glob("evidence*/ablation.json")):
        report = json.loads(path.read_text())
        report.pop("environments", None)  # older reports stored them as strings
        md = ablate.render.render_markdown(report)
        assert "| variant | seeds |" in md and "## Runs" in md


# ----------------------------------------------------------------------------- attention KL and the row split
# (issue 30 item 3: the right teacher and each control compared on the rows `relation_rows` selects)


SPLIT_KL = {"right": (0.1, 0.5), "control": (0.4, 0.5)}  # variant -> (selected, other) KL to teacher t


class SplitRuns(FakeRuns):
    """Runs that log, per teacher, the attention KL and the KL on the selected vs the other rows; the
    `final` in train_summary.json is what the trainer writes (`train.curves.final_metrics` of the log)."""

    def train(self, argv):
        from kvdistill.train.curves import final_metrics

        super().train(argv)
        out = Path(self.trained[-1])
        sel, other = SPLIT_KL.get(out.parent.name, (None, None))
        seed = int(out.name.split("_")[1])
        rows = [{"step": s, "loss": 1.0, "ce": 1.0, **({} if sel is None else {
            "attention_kl/t": sel + 0.2, "attention_kl_selected/t": sel + 0.01 * seed,
            "attention_kl_other/t": other, "attention_kl_selected/u": 9.0, "attention_kl_other/u": 8.0})}
            for s in (1, 2)]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "train_summary.json").write_text(json.dumps({"final": final_metrics(out / "metrics.jsonl"),
                                                            "global_step": 2}))
        return 0


def test_final_metrics_keep_the_attention_kl_and_the_row_split_per_teacher(tmp_path):
    from kvdistill.train.curves import final_metrics

    rows = [{"step": 1, "loss": 1.0, "attention_kl/a": 9.0},
            {"step": 2, "loss": 1.0, "attention_kl/a": 0.2, "attention_kl/b": 0.4, "relation_kl_selected/a": 0.1,
             "relation_kl_other/a": 0.3, "relation_kl_selected/b": 0.5, "relation_kl_other/b": 0.7}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    final = final_metrics(tmp_path / "m.jsonl")
    assert final["attention_kl"] == pytest.approx(0.3) and final["relation_kl_selected"] == pytest.approx(0.3)
    assert final["relation_kl_other"] == pytest.approx(0.5) and final["relation_kl"] is None
    assert final["attention_kl/b"] == 0.4 and final["relation_kl_other/a"] == 0.3
    assert final["attention_kl_selected"] is None


def test_report_compares_teacher_and_control_on_the_selected_rows(tmp_path):
    _write_yaml(tmp_path / "train.yaml", {"student": "s", "teachers": [{"path": "t"}], "kv_weight": 0})
    abl = _write_yaml(tmp_path / "a.yaml", {
        "base_config": "train.yaml", "output_dir": str(tmp_path / "out"), "seeds": [0, 1],
        "variants": ["baseline", {"name": "right", "overrides": {"kv_weight": 0.1}},
                     {"name": "control", "overrides": {"kv_weight": 0.1, "teacher_control": "untrained"}}]})
    fake = SplitRuns({"baseline": 0.3, "right": 0.3, "control": 0.3})
    report = run_ablation(load_ablation_config(abl), train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    right, control = report["variants"]["right"], report["variants"]["control"]
    assert right["agreement"]["attention_kl_selected/t"]["mean"] == pytest.approx(0.105)
    assert right["agreement"]["attention_kl_other/t"] == {"mean": 0.5, "std": 0.0, "n": 2}
    assert control["agreement"]["attention_kl_selected/t"]["mean"] == pytest.approx(0.405)
    assert right["agreement"]["attention_kl"]["mean"] == pytest.approx(0.3)  # over teachers t (0.3)
    assert report["variants"]["baseline"]["agreement"] == {}
    assert right["runs"]["1"]["agreement"]["attention_kl_selected/t"] == pytest.approx(0.11)
    md = (tmp_path / "out" / "ablation.md").read_text()
    assert "## KL on the selected rows vs the other rows" in md
    split = md.split("## KL on the selected rows vs the other rows")[1]
    assert f"| {right['label']} | t | attention | 0.1050 ± 0.0071 | 0.5000 ± 0.0000 |" in split
    assert f"| {control['label']} | t | attention | 0.4050 ± 0.0071 | 0.5000 ± 0.0000 |" in split
    assert f"| {control['label']} | u | attention | 9.0000 ± 0.0000 | 8.0000 ± 0.0000 |" in split
    # the final-agreement column shows the attention KL of a run without a relation KL
    lines = md.splitlines()
    assert any(ln.startswith(f"| {right['label']} | 2 | ") and "| 0.275 ± 0.014 | 0.3000 ± 0.0000 | 3.00" in ln for ln in lines)
    assert any(ln.startswith(f"| {right['label']} | 1 | ") and "| 200 | 0.3000 | 1.000 |" in ln for ln in lines)
    assert json.loads((tmp_path / "out" / "ablation.json").read_text())["variants"]["right"]["agreement"]



def test_a_teachers_own_control_tags_its_variant(tmp_path):
    """A control arm whose control is one teacher's own (logit KD from the real teacher, relation from its permuted
    copy) is tagged as a run-wide control is; teachers with different controls are each named."""
    _write_yaml(tmp_path / "train.yaml", {"student": "s", "teachers": [{"path": "t"}], "kv_weight": 1.0})
    real = {"path": "t", "name": "real", "weight": 0}
    abl = _write_yaml(tmp_path / "a.yaml", {
        "base_config": "train.yaml", "output_dir": str(tmp_path / "out"), "seeds": [0], "variants": [
            {"name": "relation", "label": "Relation", "overrides": {}},
            {"name": "run_wide", "label": "Run-wide", "overrides": {"teacher_control": "permuted"}},
            {"name": "copy", "label": "Relation from the permuted copy", "overrides": {"teachers": [
                real, {"path": "t", "name": "copy", "control": "permuted"}]}},
            {"name": "two", "label": "Two", "overrides": {"teachers": [
                {"path": "t", "name": "a", "control": "untrained"}, {"path": "t", "name": "b", "control": "permuted"}]}},
        ]})
    cfg = load_ablation_config(abl)
    relation, run_wide, copy_, two = cfg.variants

    def label(v, per_seed):
        return ablate.summary.control_label(v.label, ablate.summary._control(cfg, v, per_seed))

    tag = "[control: permuted teacher input]"
    # before any run: as the overrides set it
    assert [label(v, {}) for v in cfg.variants] == [
        "Relation", f"Run-wide {tag}", f"Relation from the permuted copy {tag}", "Two [controls: untrained (a), permuted (b)]"]
    # as the runs recorded it (train_summary.json, read_run's keys)
    recorded = {"teacher_control": "none", "teacher_controls": {"real": "none", "copy": "permuted"}}
    assert label(copy_, {0: recorded}) == f"Relation from the permuted copy {tag}"
    assert label(relation, {0: {"teacher_control": "none", "teacher_controls": {"t": "none"}}}) == "Relation"
    assert ablate.summary._control(cfg, run_wide, {0: {"teacher_control": "permuted", "teacher_controls": {"t": "permuted"}}}) \
        == "permuted"
    # an earlier report's record (its own text, no per-teacher controls) reads back the same
    assert ablate.summary._control(cfg, two, {0: {"teacher_control": "untrained (a), permuted (b)"}}) == "untrained (a), permuted (b)"


# ============================================================================= from_report: a sweep continued on a
# fresh machine, where only the committed ablation.json of the earlier runs survives


_DESIGN = dict(seeds=[0, 1, 2], threshold=0.5, margin=0.05, hypothesis="KV helps",
               primary={"comparison": ["kv", "baseline"], "test": "welch"})


def _reported_ablation(tmp_path):
    """A finished ablation with every kind of number (answer NLL, steps to the threshold, a primary), and a
    copy of its report outside output_dir (the committed one). Returns the YAML, the runs and the copy."""
    abl = _curve_ablation(tmp_path, **_DESIGN)
    fake = CurveRuns({"baseline": 0.3, "kv": 0.7, "same": 0.3})
    run_ablation(load_ablation_config(abl), train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    committed = tmp_path / "committed.json"
    committed.write_text((tmp_path / "out" / "ablation.json").read_text())
    return abl, fake, committed


def test_from_report_gives_the_comparisons_its_runs_gave(tmp_path):
    import shutil

    abl, fake, committed = _reported_ablation(tmp_path)
    first = json.loads(committed.read_text())
    for variant, seed in (("baseline", 1), ("kv", 0), ("kv", 2), ("same", 1)):
        shutil.rmtree(tmp_path / "out" / "runs" / variant / f"seed_{seed}")
    trained, logged = len(fake.trained), []
    run_ablation(load_ablation_config(abl, from_report=str(committed)), train_fn=fake.train, eval_fn=fake.eval,
                 log=logged.append)
    assert len(fake.trained) == trained  # the recorded runs count as finished
    assert f"[2/9] kv seed 0: from report {committed}" in logged and "[1/9] baseline seed 0: finished, skipped" in logged
    again = json.loads((tmp_path / "out" / "ablation.json").read_text())
    for key in ("variants", "primary"):  # every per-variant number and comparison, to the byte
        assert json.dumps(again[key]) == json.dumps(first[key])
    assert again["from_report"] == {"path": str(committed), "runs": {"baseline": [1], "kv": [0, 2], "same": [1]},
                                    "without_items": {}}
    md = (tmp_path / "out" / "ablation.md").read_text()
    assert f"**Runs from an earlier report:** not run here but read from `{committed}`" in md
    assert "+KV seed(s) 0, 2" in md and "the training curves leave them out." in md

    # a fresh machine: every run from the report, no curve left to plot (and no crash)
    fresh = tmp_path / "fresh"
    run_ablation(load_ablation_config(abl, from_report=str(committed), output_dir=str(fresh)), train_fn=fake.train,
                 eval_fn=fake.eval, log=lambda s: None)
    again = json.loads((fresh / "ablation.json").read_text())
    assert len(fake.trained) == trained and json.dumps(again["variants"]) == json.dumps(first["variants"])
    assert not (fresh / "ablation_curves.png").exists()

    # a report written before runs recorded their items: the seed-level tests stay, the item-level ones say so
    old = json.loads(committed.read_text())
    for row in old["variants"].values():
        for r in row["runs"].values():
            del r["items"]
    committed.write_text(json.dumps(old))
    run_ablation(load_ablation_config(abl, from_report=str(committed), output_dir=str(tmp_path / "old")),
                 train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    report = json.loads((tmp_path / "old" / "ablation.json").read_text())
    cmp_, was = report["variants"]["kv"]["vs_baseline"], first["variants"]["kv"]["vs_baseline"]
    assert cmp_["ttest"] == was["ttest"] and cmp_["welch"] == was["welch"] and cmp_["steps"] == was["steps"]
    assert cmp_["items"] == 0 and cmp_["permutation_p"] is None
    assert report["from_report"]["without_items"] == {"baseline": [0, 1, 2], "kv": [0, 1, 2], "same": [0, 1, 2]}
    assert "9 of them have no per-item record" in (tmp_path / "old" / "ablation.md").read_text()


def test_from_report_of_another_design_or_no_report_is_refused_and_writes_nothing(tmp_path):
    abl, _, committed = _reported_ablation(tmp_path)
    changed = _write_yaml(tmp_path / "b.yaml", {**yaml.safe_load(abl.read_text()), "overrides": {"max_steps": 20}})
    fresh = tmp_path / "fresh"
    not_json, not_report = tmp_path / "ablation.md", tmp_path / "summary.json"
    not_json.write_text("# Ablation\n")
    not_report.write_text(json.dumps({"accuracy": 0.5}))
    for yaml_path, path, message in ((changed, committed, r"its runs were made under config hash .* \(another design\)"),
                                     (abl, tmp_path / "nope.json", "no such file"),
                                     (abl, not_json, "is not an ablation report"),
                                     (abl, not_report, "is not an ablation report")):
        with pytest.raises(AblationError, match=message) as err:
            main(["--config", str(yaml_path), "--output_dir", str(fresh), "--from_report", str(path)])
        assert "\n" not in str(err.value) and "from_report" in str(err.value)
        assert not fresh.exists()


def test_a_run_dir_wins_over_the_report_and_from_report_is_a_yaml_key(tmp_path):
    import shutil

    _, fake, committed = _reported_ablation(tmp_path)
    made = json.loads(committed.read_text())
    tampered = copy.deepcopy(made)
    tampered["variants"]["kv"]["runs"]["1"]["accuracy"] = 0.0  # not what the run dir holds
    committed.write_text(json.dumps(tampered))
    shutil.rmtree(tmp_path / "out" / "runs" / "kv" / "seed_0")
    abl = _curve_ablation(tmp_path, **_DESIGN, from_report=str(committed))  # not part of the design: same hash
    logged = []
    run_ablation(load_ablation_config(abl), train_fn=fake.train, eval_fn=fake.eval, log=logged.append)
    report = json.loads((tmp_path / "out" / "ablation.json").read_text())
    assert report["variants"]["kv"]["runs"]["1"] == made["variants"]["kv"]["runs"]["1"]
    assert report["from_report"]["runs"] == {"kv": [0]}
    assert "[5/9] kv seed 1: finished, skipped" in logged and f"[2/9] kv seed 0: from report {committed}" in logged


# ----------------------------------------------------------------------------- text data: the held-out LM loss


class TextRuns(FakeRuns):
    """Runs on text records: eval gives no accuracy and no items, only the held-out LM loss (`nll`), the
    variant's value plus seed noise of ±0.01 (what `kvdistill eval` writes for records without final answers)."""

    def eval(self, model_dir, out_dir, settings):
        self.evaluated.append(model_dir)
        variant, seed = Path(model_dir).parent.name, int(Path(model_dir).name.split("_")[1])
        nll = self.nll[variant] + 0.01 * np.random.default_rng(seed).standard_normal()
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "items.jsonl").write_text("")
        (out / "summary.json").write_text(json.dumps({"accuracy": None, "ci_low": None, "ci_high": None, "n": 150,
                                                      "answer_nll": None, "nll": nll, "perplexity": math.exp(nll)}))
        return {"nll": nll}


def test_a_text_ablation_registers_and_tests_the_held_out_lm_loss(tmp_path):
    """No accuracy anywhere: the registered primary on `nll` is tested on the runs' held-out LM loss (lower is
    better), the accuracy tests are absent, not failed, and the tables show the loss."""
    _write_yaml(tmp_path / "train.yaml", {"student": "s", "teachers": [{"path": "t"}], "kv_weight": 0})
    abl = _write_yaml(tmp_path / "a.yaml", {
        "base_config": "train.yaml", "output_dir": str(tmp_path / "out"), "seeds": [0, 1, 2, 3, 4],
        "hypothesis": "KV lowers the held-out LM loss",
        "primary": {"comparison": ["kv", "baseline"], "metric": "nll", "test": "paired_t"},
        "variants": ["baseline", {"name": "kv", "overrides": {"kv_weight": 0.1}}]})
    fake = TextRuns({}, nll={"baseline": 5.30, "kv": 5.20})
    report = run_ablation(load_ablation_config(abl), train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    kv = report["variants"]["kv"]
    assert kv["accuracy"]["n"] == 0 and kv["nll"]["mean"] == pytest.approx(5.20, abs=0.02)
    assert kv["vs_baseline"]["delta_accuracy"] is None and kv["vs_baseline"]["nll"]["welch"]["p_value"] < 0.01
    result = report["primary"]["results"]["baseline"]
    assert result["mean_diff"] == pytest.approx(-0.10, abs=0.02) and result["p_value"] < 0.01
    assert "held-out LM loss" in report["primary"]["verdict"]
    md = (tmp_path / "out" / "ablation.md").read_text()
    assert "| held-out LM loss |" in md and f"{kv['runs']['0']['nll']:.4f}" in md
    # the report speaks of what the runs have: the LM loss's paired Δ, no accuracy column, sentence or plot
    assert f"| {fmt_signed(kv['vs_baseline']['nll']['paired_t']['mean_diff'])} |" in md
    assert "accuracy" not in md.lower() and "ablation_nll.png" in md
    assert (tmp_path / "out" / "ablation_nll.png").read_bytes()[:4] == b"\x89PNG"
