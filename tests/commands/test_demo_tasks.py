"""`kvdistill demo --task binding|modular`: a regime's assets from one command (issue 31)."""

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from kvdistill.commands import demo
from kvdistill.commands.demo import DemoConfig
from kvdistill.commands.demo import main as demo_main
from kvdistill.config import ConfigError, parse_config
from kvdistill.models import load_tokenizer

SPLITS = ("teacher_pool", "train", "dev", "teacher_dev", "test", "other_task", "other_task_dev")
STEPS = {"teacher_qwen2": 4, "teacher_other": 3}  # quick: teacher_steps, teacher_other's teacher_overrides
TRAINED = (("teacher_qwen2", "teacher_dev"), ("teacher_other", "other_task_dev"))  # modular demo.yaml `teachers:`


@pytest.mark.parametrize("runner", [
    "in_process",  # CI: the same stages and command lines, ~10 commands in process
    pytest.param("subprocess", marks=[pytest.mark.slow, pytest.mark.extended]),  # as a user runs it (~60 s)
])
def test_demo_modular_quick_end_to_end(tmp_path, monkeypatch, capsys, runner, in_process):
    calls: list[list[str]] = []
    run = {"in_process": in_process, "subprocess": demo.run_parallel}[runner]

    def record(jobs, workers, logs):
        calls.extend(argv for commands in jobs.values() for argv in commands)
        run(jobs, workers, logs)

    monkeypatch.setattr(demo, "run_parallel", record)
    out = tmp_path / "demo"
    assert demo_main(["--task", "modular", "--quick", "--output_dir", str(out)]) == 0
    assert "teachers (teacher_qwen2 4 steps, teacher_other 3 steps)" in capsys.readouterr().out  # each its own
    assert all((out / "data" / f"{s}.jsonl").read_text() for s in SPLITS)
    models = json.loads((demo.CONFIG_DIR / "modular" / "models.json").read_text())["models"]
    for name, m in models.items():  # the inits as models.json says
        cfg = json.loads((out / "init" / name / "config.json").read_text())
        assert cfg["tie_word_embeddings"] is False and cfg["num_hidden_layers"] == m["sizes"]["num_hidden_layers"]
    report = (out / "report.md").read_text()
    # demo.yaml's `teachers:` picks who is trained and gated; every model of models.json is still built
    assert not (out / "teachers" / "teacher_llama").exists()
    for name, gate_split in TRAINED:
        config = yaml.safe_load((out / "teachers" / name / "kvdistill_config.yaml").read_text())
        assert config["data_split"] == models[name]["data"] and config["max_steps"] == STEPS[name]
        summary = json.loads((out / f"eval_{gate_split}" / name / "summary.json").read_text())
        assert summary["n"] == 12  # the whole gate split (quick n_teacher_dev)
        assert re.search(rf"\| {name} \| {gate_split} \| {summary['accuracy']:.3f} \|", report)
        probe = json.loads((out / "probe" / name / "probe.json").read_text())
        assert (probe["target"], probe["rows"]) == ("field:number", "field:numeral")
        assert [m["untrained"] for m in probe["models"]] == [False, True]
        assert (out / "probe" / name / "probe.png").read_bytes()[:4] == b"\x89PNG"
        assert f"| {name} | " in report.split("**Probe audit**")[1]
    # the student's curve on dev from its labelled split; the budget is a point of it
    config = yaml.safe_load((out / "runs" / "sft_curve" / "kvdistill_config.yaml").read_text())
    assert config["data_split"] == "train" and config["accuracy_eval_split"] == "dev"
    curve = json.loads((out / "sft_curve.json").read_text())
    repeats = demo.Regime.load("modular", quick=True).settings.data.get("repeats", 1)
    assert curve["budget"] in [s for s, _ in curve["points"]]
    assert curve["labelled"] == 42 * repeats  # 0.35 of 11 x 11 pairs, each asked `repeats` times
    assert f"max_steps: {curve['budget']}" in report and f"student: {out / 'init' / 'student'}" in report
    # the command lines: each teacher on its split, gated on its held-out one, probed on dev; the curve's settings
    argvs = {(argv[0], argv[argv.index("--output_dir") + 1]): argv for argv in calls}
    assert len(calls) == len(argvs) == 9  # each teacher, its gate eval, probe and layout; the SFT curve

    def values(command: str, output_dir, *flags: str) -> tuple[str, ...]:
        argv = argvs[command, str(output_dir)]
        return tuple(argv[argv.index(flag) + 1] for flag in flags)

    for name, gate_split in TRAINED:
        assert values("train", out / "teachers" / name, "--data_split", "--max_steps", "--student") == (
            models[name]["data"], "4", str(out / "init" / name))
        assert values("eval", out / f"eval_{gate_split}" / name, "--split", "--limit") == (gate_split, "12")
        assert values("probe", out / "probe" / name, "--model", "--split", "--target", "--rows", "--samples") == (
            str(out / "teachers" / name), "dev", "field:number", "field:numeral", "12")
        assert "--untrained" in argvs["probe", str(out / "probe" / name)]
    # demo.yaml's layout: each teacher on its operation's cycle (teacher_other: multiplication's, generator 2 mod 11)
    for name, generator in (("teacher_qwen2", None), ("teacher_other", 2)):
        layout = json.loads((out / "layout" / name / "layout.json").read_text())
        assert (layout["numbers"], layout["generator"]) == (11, generator)
        assert [r["untrained"] for r in layout["rows"]] == [False] * 3 + [True] * 3
        assert re.search(rf"\| {name} \| {re.escape(layout['cycle'])} \| v \| {layout['rows'][2]['share']:.3f} ",
                         report.split("**Layout audit**")[1])
    # teacher_overrides: teacher_other's own options after teacher.yaml's and teacher_steps (quick's max_steps)
    other = argvs["train", str(out / "teachers" / "teacher_other")]
    assert other[other.index("--learning_rate") + 1] == "0.001" and "--learning_rate" not in argvs[
        "train", str(out / "teachers" / "teacher_qwen2")]
    config = yaml.safe_load((out / "teachers" / "teacher_other" / "kvdistill_config.yaml").read_text())
    assert (config["learning_rate"], config["lr_scheduler_type"]) == (1e-3, "cosine")
    assert values("train", out / "runs" / "sft_curve", "--data_split", "--max_steps", "--accuracy_eval_steps",
                  "--accuracy_eval_limit") == ("train", "4", "2", "8")
    # a second run reuses everything (no command runs); a gate the teachers miss stops it naming the teacher
    # and its split
    calls.clear()
    mtime = (out / "teachers" / "teacher_qwen2" / "model.safetensors").stat().st_mtime_ns
    probed = (out / "probe" / "teacher_qwen2" / "probe.json").stat().st_mtime_ns
    assert demo_main(["--task", "modular", "--quick", "--output_dir", str(out)]) == 0
    assert (out / "teachers" / "teacher_qwen2" / "model.safetensors").stat().st_mtime_ns == mtime
    assert (out / "probe" / "teacher_qwen2" / "probe.json").stat().st_mtime_ns == probed and calls == []
    with pytest.raises(SystemExit, match=r"quality gate: teacher teacher_qwen2 reached .* on teacher_dev, .* below "
                                         r"the 0.99 gate"):
        demo_main(["--task", "modular", "--quick", "--output_dir", str(out), "--gate", "0.99"])


def test_demo_binding_quick_end_to_end(tmp_path, monkeypatch, in_process):
    """The binding regime's assets: one-hop programs with recall beside them in the teachers' pool, whole-line
    tokens, untied compositional inits, the three teachers gated and probed on their line and query tokens."""
    monkeypatch.setattr(demo, "run_parallel", in_process)
    out = tmp_path / "demo"
    assert demo_main(["--task", "binding", "--quick", "--output_dir", str(out)]) == 0
    pool = [json.loads(x) for x in (out / "data" / "teacher_pool.jsonl").read_text().splitlines()]
    recall = [r for r in pool if f"{r['question'][-2]}={r['answer'][-1]}." in r["question"].split()]
    assert len(pool) == 300 and pool[200:] == recall[-100:]  # quick: 200 one-hop programs, then 100 recall ones
    tok = load_tokenizer(out / "init" / "student")
    assert tok.tokenize("b=7. m=b. What is m?") == ["b=7.", "m=b.", "What", "is", "m?"]
    for name in ("teacher_qwen2", "teacher_llama", "teacher_other", "student"):
        assert json.loads((out / "init" / name / "config.json").read_text())["tie_word_embeddings"] is False
    report = (out / "report.md").read_text()
    for name in ("teacher_qwen2", "teacher_other", "teacher_llama"):
        probe = json.loads((out / "probe" / name / "probe.json").read_text())
        assert (probe["target"], probe["rows"]) == ("field:value", "field:name")
        assert f"| {name} | " in report.split("**Probe audit**")[1]
    llama = yaml.safe_load((out / "teachers" / "teacher_llama" / "kvdistill_config.yaml").read_text())
    assert llama["data_split"] == "teacher_pool" and llama["accuracy_stop"] == 0.0  # quick's overrides over demo.yaml's
    assert json.loads((out / "sft_curve.json").read_text())["budget"] in (2, 4)
    # the students stage: students.yaml with `{out}` filled in and quick's keys over it, run by kvdistill ablate
    spec = yaml.safe_load((out / "students.yaml").read_text())
    assert spec["output_dir"] == str(out / "students") and spec["seeds"] == [0] and spec["eval"]["limit"] == 12
    assert (spec["overrides"]["student"], spec["overrides"]["teachers"]) == (
        str(out / "init" / "student"), [{"path": str(out / "teachers" / "teacher_qwen2")}])
    assert (spec["overrides"]["max_steps"], spec["overrides"]["max_samples"]) == (4, 10000)  # quick's, then the file's
    assert "{out}" not in (out / "students.yaml").read_text()
    ablation = json.loads((out / "students" / "ablation.json").read_text())
    arms = ["baseline", "logit_kd", "logit_kd_rows", "kv", "kv_shuffled"]
    assert list(ablation["variants"]) == arms
    for name in arms:  # each arm trained as named, read from its run dir
        config = yaml.safe_load((out / "students" / "runs" / name / "seed_0" / "kvdistill_config.yaml").read_text())
        assert config["max_steps"] == 4 and config["data_split"] == "teacher_pool"
        assert (config["logit_kd_weight"] > 0) == name.startswith("logit_kd")
        assert (config["kv_weight"] > 0) == name.startswith("kv")
    rows = yaml.safe_load((out / "students" / "runs" / "logit_kd_rows" / "seed_0" / "kvdistill_config.yaml").read_text())
    assert rows["logit_kd_rows"] == "field:name"
    shuffled = yaml.safe_load((out / "students" / "runs" / "kv_shuffled" / "seed_0" / "kvdistill_config.yaml").read_text())
    assert shuffled["teacher_control"] == "shuffled"
    # the report opens with the students' table: every arm, KV beside SFT and beside its shuffled control
    section = report.split("**What transfers**")[1].split("**Teachers' quality gate**")[0]
    kv = ablation["variants"]["kv"]
    assert re.search(re.escape(f"| KV, line/query rows | {kv['accuracy']['mean']:.3f} (") + r".*"
                     + re.escape(f"| Baseline (SFT) | {kv['comparisons']['baseline']['bootstrap']['mean_diff']:+.3f} ["),
                     section)
    assert "| | | | KV, shuffled teacher (control) |" in section
    assert report.index("**What transfers**") < report.index("**Teachers' quality gate**")


def test_each_task_has_its_own_default_output_dir():
    assert parse_config(DemoConfig, [], "demo").task == "binding"  # the embedded default (issue 51)
    assert parse_config(DemoConfig, [], "demo").output_dir == "outputs/demo_binding"
    assert parse_config(DemoConfig, ["--task", "arithmetic"], "demo").output_dir == "outputs/demo"
    for task in ("binding", "modular"):
        assert parse_config(DemoConfig, ["--task", task], "demo").output_dir == f"outputs/demo_{task}"
    assert parse_config(DemoConfig, ["--task", "binding", "--out", "x"], "demo").output_dir == "x"


def test_an_unknown_task_is_refused():
    with pytest.raises(ConfigError, match=r"task 'sorting' is not one of \('arithmetic', 'binding', 'modular'\)"):
        parse_config(DemoConfig, ["--task", "sorting"], "demo")


@pytest.mark.parametrize("missing, message", [
    ("models.json", "models.json is missing: a regime needs its models.json"),
    ("demo.yaml", "demo config .*demo.yaml is missing"),
    ("teacher.yaml", "demo config .*teacher.yaml is missing"),
])
def test_a_missing_regime_config_is_refused_before_anything_is_written(tmp_path, monkeypatch, missing, message):
    configs = tmp_path / "configs"
    shutil.copytree(demo.CONFIG_DIR / "binding", configs / "binding")
    (configs / "binding" / missing).unlink()
    monkeypatch.setattr(demo, "CONFIG_DIR", configs)
    with pytest.raises(ConfigError, match=message):
        demo_main(["--task", "binding", "--quick", "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda d: {**d, "modulus": 7}, r"binding data knobs: missing \[\], unknown \['modulus'\]"),
    (lambda d: {k: v for k, v in d.items() if k != "n_dev"}, r"binding data knobs: missing \['n_dev'\], unknown \[\]"),
])
def test_data_knobs_the_generator_does_not_take_are_refused_before_anything_is_written(tmp_path, monkeypatch, edit,
                                                                                      message):
    configs = tmp_path / "configs"
    shutil.copytree(demo.CONFIG_DIR / "binding", configs / "binding")
    settings = yaml.safe_load((configs / "binding" / "demo.yaml").read_text())
    (configs / "binding" / "demo.yaml").write_text(yaml.safe_dump({**settings, "data": edit(settings["data"])}))
    monkeypatch.setattr(demo, "CONFIG_DIR", configs)
    with pytest.raises(ConfigError, match=message):
        demo_main(["--task", "binding", "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_binding_regime_configs_are_complete():
    """What `--task binding` reads, read as it does: the teachers, their gate splits and the probe target."""
    regime = demo.Regime.load("binding", quick=True)
    assert regime.teachers == {"teacher_qwen2": ("teacher_pool", "teacher_dev"),
                               "teacher_other": ("other_task", "other_task_dev"),
                               "teacher_llama": ("teacher_pool", "teacher_dev")}
    assert (regime.settings.probe["target"], regime.settings.probe["rows"]) == ("field:value", "field:name")
    assert regime.models.models["student"].sizes["num_hidden_layers"] >= 3


@pytest.mark.parametrize("key", ["teacher_overrides", "layout"])
def test_per_teacher_settings_of_a_teacher_the_demo_does_not_train_are_refused_before_anything_is_written(
        tmp_path, monkeypatch, key):
    configs = tmp_path / "configs"
    shutil.copytree(demo.CONFIG_DIR / "modular", configs / "modular")
    settings = yaml.safe_load((configs / "modular" / "demo.yaml").read_text())
    settings[key] = {"teacher_llama": {"learning_rate": 1e-3}}  # built, not in teachers:
    (configs / "modular" / "demo.yaml").write_text(yaml.safe_dump(settings))
    monkeypatch.setattr(demo, "CONFIG_DIR", configs)
    with pytest.raises(ConfigError, match=rf"{key}: \['teacher_llama'\] are not teachers this demo trains"):
        demo_main(["--task", "modular", "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_shipped_teachers_are_copied_checked_and_never_trained(tmp_path, monkeypatch, capsys, in_process):
    """assets/<task>/ as `--ship_teachers` writes it: a later demo copies each teacher after checking its hashes and
    the inits it was trained from, trains none, and refuses (one line, naming the file or the seed) a changed file,
    other inits or an output dir holding another teacher."""
    from kvdistill.lab import regimes

    calls: list[list[str]] = []

    def record(jobs, workers, logs):
        calls.extend(argv for commands in jobs.values() for argv in commands)
        in_process(jobs, workers, logs)

    monkeypatch.setattr(demo, "run_parallel", record)
    monkeypatch.setattr(regimes, "ASSETS", tmp_path / "assets")
    regime = demo.Regime.load("binding", quick=True)
    first = tmp_path / "first"
    demo.run_regime(first, regime, ship=True)  # what --ship_teachers does (its tiny teachers, for speed)
    manifest = json.loads((tmp_path / "assets" / "binding" / "manifest.json").read_text())
    assert set(manifest["teachers"]) == {"teacher_qwen2", "teacher_other", "teacher_llama"}
    assert manifest["teachers"]["teacher_qwen2"]["command"].startswith("kvdistill train --config ")
    calls.clear()
    capsys.readouterr()
    demo.run_regime(first, regime, ship=True)  # shipped again: the teachers it trained are reused, and it says so
    stage = next(line for line in capsys.readouterr().out.splitlines() if "] teachers (" in line)
    assert f"(teacher_llama, teacher_other, teacher_qwen2 already trained in {first / 'teachers'})" in stage, stage
    assert not [argv for argv in calls if argv[0] == "train"]
    calls.clear()
    capsys.readouterr()
    second = tmp_path / "second"
    demo.run_regime(second, regime)  # quick's settings, shipped teachers
    assert f"teachers (teacher_llama, teacher_other, teacher_qwen2 copied from {tmp_path / 'assets' / 'binding'}" in capsys.readouterr().out
    trained = [Path(argv[argv.index("--output_dir") + 1]) for argv in calls if argv[0] == "train"]
    assert [p.name for p in trained] == ["sft_curve"]  # the student's curve only
    for name in ("teacher_qwen2", "teacher_other", "teacher_llama"):
        assert ((second / "teachers" / name / "model.safetensors").read_bytes()
                == (first / "teachers" / name / "model.safetensors").read_bytes())
    asset = tmp_path / "assets" / "binding" / "teacher_qwen2" / "model.safetensors"
    third = tmp_path / "third"
    with pytest.raises(ConfigError, match="seed 0 and the data knobs"):
        demo.run_regime(third, regime, seed=1)
    asset.write_bytes(asset.read_bytes()[:-1] + b"\0")
    with pytest.raises(ConfigError, match=r"teacher_qwen2/model.safetensors is missing or does not match its SHA-256"):
        demo.run_regime(tmp_path / "fourth", regime)
    shutil.copyfile(first / "teachers" / "teacher_other" / "model.safetensors", asset)  # another teacher's weights
    manifest["teachers"]["teacher_qwen2"]["files"]["model.safetensors"] = regimes.sha256_file(asset)
    (tmp_path / "assets" / "binding" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"holds another teacher_qwen2 than the one shipped"):
        demo.run_regime(second, regime)
