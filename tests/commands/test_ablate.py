"""`kvdistill ablate`: variants, resumable runner, statistics and report (synthetic runs), and
one end-to-end ablation on the tiny fixtures with the real trainer and evaluator."""

import copy
import json
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

    def __init__(self, acc: dict[str, float], n_items: int = 200):
        self.acc, self.n_items = acc, n_items
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
                }
            )
        )


def test_runner_report_and_resume_with_synthetic_runs(tmp_path):
    base = _write_yaml(tmp_path / "train.yaml", {"student": "s", "kv_weight": 0.1, "max_steps": 99})
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


def test_failed_run_raises_or_is_reported(tmp_path):
    _write_yaml(tmp_path / "train.yaml", {"student": "s"})
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

    monkeypatch.setattr(ablate, "make_capture", fake_capture)
    fake = FakeRuns({"baseline": 0.3, "kv": 0.5, "relation": 0.5})
    with pytest.raises(FileNotFoundError):
        run_ablation(load_ablation_config(abl), train_fn=fake.train, eval_fn=fake.eval, log=lambda s: None)
    assert fake.trained == []  # captures come before any run in one process
    report = run_ablation(load_ablation_config(abl, keep_going=True), train_fn=fake.train, eval_fn=fake.eval,
                          log=lambda s: None)
    assert sorted(f.split(":")[0] for f in report["failures"]) == [
        str(tmp_path / "o" / "captures" / "kv"), "kv seed 0", "kv seed 1"]
    assert len(fake.trained) == 4 and not any("/kv/" in r for r in fake.evaluated)


def test_config_errors(tmp_path):
    _write_yaml(tmp_path / "train.yaml", {"student": "s"})
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
    _write_yaml(tmp_path / "train.yaml", {"student": "s"})
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
    assert "## Against the controls" in md and "| +Relation | +Relation, shuffled teacher |" in md
    assert "| Privileged KV, no rationale | privileged_kv_untrained | not run |" in md
    # relation vs shuffled (0.8 vs 0.75 on 200 items x 5 seeds) need not be significant: the verdict follows
    verdict = next(line for line in md.splitlines() if line.startswith("- +Relation:"))
    beats_all = all(
        rel["comparisons"][r]["ttest"]["p_value"] < 0.05 and rel["comparisons"][r]["permutation_p"] < 0.05
        for r in rel["comparisons"])
    assert ("beats its reference and all controls**" in verdict) == beats_all


def test_reference_must_be_run(tmp_path):
    _write_yaml(tmp_path / "train.yaml", {"student": "s"})
    abl = _write_yaml(tmp_path / "a.yaml", {"base_config": "train.yaml", "variants": ["baseline", "privileged_kv"]})
    with pytest.raises(AblationError, match="sft_no_rationale"):
        load_ablation_config(abl)


def test_parallel_workers_give_the_same_numbers_as_one_process(tiny_world, tmp_path):
    """Two worker processes, one thread per run, the capture made in a worker while the baseline
    trains: each run's accuracy and losses equal the in-process run's."""
    m = tiny_world.models
    _write_yaml(tmp_path / "train.yaml", {
        "student": str(m["student"]), "teachers": [{"path": str(m["qwen2_teacher"])}], "data": str(tiny_world.data_dir),
        "max_length": 160, "max_steps": 3, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
        "learning_rate": 1e-3, "kv_warmup_steps": 0, "logging_steps": 1, "save_strategy": "no", "use_cpu": True,
        "disable_tqdm": True, "report_to": "none",
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
