"""`kvdistill demo --task arithmetic --quick`: the whole pipeline through the public commands (CI runs this)."""

import json
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from kvdistill.commands import demo
from kvdistill.commands.demo import curve_points, plateau_step, run_parallel
from kvdistill.commands.demo import main as demo_main
from kvdistill.config import ConfigError


def test_plateau_step_is_the_first_point_near_the_best():
    points = [(100, 0.1), (200, 0.5), (300, 0.78), (400, 0.8), (500, 0.79)]
    assert plateau_step(points) == 300  # 0.78 >= 0.95 * 0.8
    assert plateau_step(points, share=1.0) == 400


def test_run_parallel_chains_a_jobs_commands_and_stops_at_a_failure(tmp_path):
    logs = tmp_path / "logs"

    def gen(name: str) -> list[str]:
        return ["gen-data", "--output_dir", str(tmp_path / name), "--n_train", "4", "--n_test", "2"]

    run_parallel({"a": [gen("a1"), ["gen-data", "--help"]], "b": [gen("b1")], "empty": []}, 2, logs)
    assert (tmp_path / "a1" / "train.jsonl").exists() and (tmp_path / "b1" / "train.jsonl").exists()
    assert "usage: kvdistill gen-data" in (logs / "a.log").read_text()  # the job's second command, same log
    assert not (logs / "empty.log").exists()
    # a failing command ends its job (the next command never runs) and the whole call, naming the job
    with pytest.raises(SystemExit, match=r"(?s)c failed \(exit 2\).*unknown option --no_such_option"):
        run_parallel({"c": [["gen-data", "--no_such_option", "1"], gen("c2")]}, 1, logs)
    assert not (tmp_path / "c2").exists()


KV_JOBS = ("capture_student_kv", "student_kv")  # the KV student's capture, then its training and test evaluation


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory, in_process):
    """One quick demo's output, shared by the tests below. Its ~16 commands run in this process (as child
    processes their ~5 s of imports each would double the run), but for the KV student's part (`KV_JOBS`):
    that runs as the demo runs it, in child processes, beside the in-process jobs of its stage (their
    imports overlap with those jobs' work); the rerun below makes it again in this process and must give
    the same bytes."""
    out = tmp_path_factory.mktemp("demo") / "demo"

    def beside(jobs: dict[str, list[list[str]]], workers: int, logs) -> None:
        children = {name: commands for name, commands in jobs.items() if name in KV_JOBS}
        with ThreadPoolExecutor(1) as pool:  # the real run_parallel only polls its children: it needs no core
            running = pool.submit(run_parallel, children, workers, logs)
            in_process({name: commands for name, commands in jobs.items() if name not in KV_JOBS}, workers, logs)
            running.result()

    with pytest.MonkeyPatch.context() as m:
        m.setattr(demo, "run_parallel", beside)
        assert demo_main(["--task", "arithmetic", "--quick", "--output_dir", str(out), "--workers", "2"]) == 0
    assert {p.stem for p in (out / "logs").glob("*.log")} == set(KV_JOBS)  # the KV student's part ran as children
    return out


def refuse_child_process(*args, **kwargs):
    raise AssertionError(f"a child process started: {args}")


@pytest.mark.slow
def test_demo_quick_end_to_end(demo_out, monkeypatch):
    out = demo_out
    report = (out / "report.md").read_text()
    for png in ("accuracy.png", "sft_curve.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    # the splits are disjoint and the student's labelled set is a subset of the teachers' pool
    q = {s: {json.loads(x)["question"] for x in (out / "data" / f"{s}.jsonl").read_text().splitlines()}
         for s in ("teacher_pool", "train", "transfer_questions", "dev", "test")}
    assert q["train"] < q["teacher_pool"] and not (q["teacher_pool"] & (q["dev"] | q["test"]))
    # the transfer set: pool questions the student has no labels for, answered by a teacher, read
    # by the distilling students only
    assert q["transfer_questions"] < q["teacher_pool"] and not (q["transfer_questions"] & q["train"])
    items = [json.loads(x) for x in (out / "transfer" / "teacher_qwen2" / "items.jsonl").read_text().splitlines()]
    assert {it["question"] for it in items} == q["transfer_questions"]
    for name, used in (("student_sft", 0), ("student_logit_kd", 32), ("student_kv", 32)):  # SFT: no teacher signal
        assert json.loads((out / "runs" / name / "train_summary.json").read_text())["transfer_records"] == used
    # the distilling students read their teachers from a capture made once (logit KD: with logits)
    for name in ("student_logit_kd", "student_kv"):
        config = yaml.safe_load((out / "runs" / name / "kvdistill_config.yaml").read_text())
        assert config["teacher_capture"] == str(out / "captures" / name)
        manifests = [json.loads((out / "captures" / name / t / "manifest.json").read_text())
                     for t in ("teacher_qwen2", "teacher_llama")]
        assert all(m["complete"] for m in manifests) and manifests[0]["n_records"] == manifests[1]["n_records"] > 32
        assert manifests[0]["settings"]["logits"] == (name == "student_logit_kd")  # logit KD: the same-vocab teacher
    # teacher_llama reads another tokenizer: time alignment is not the identity
    vocab = {n: json.loads((out / "init" / n / "config.json").read_text())["vocab_size"]
             for n in ("student", "teacher_llama")}
    assert vocab["student"] != vocab["teacher_llama"]
    # the curve was measured on dev and the budget is a point of it
    curve = json.loads((out / "sft_curve.json").read_text())
    assert curve["budget"] in [s for s, _ in curve_points(out / "runs" / "sft_curve" / "metrics.jsonl")]
    # every accuracy in the report is the one in its eval summary
    for name in ("teacher_qwen2", "teacher_llama", "student_sft", "student_logit_kd", "student_kv"):
        s = json.loads((out / "eval" / name / "summary.json").read_text())
        row = next(line for line in report.splitlines() if line.startswith(f"| {name} |"))
        assert re.search(rf"\| {s['accuracy']:.3f} \|", row), (row, s["accuracy"])
        assert s["n"] == 60
    # a second run reuses everything (teachers cached): no child process
    mtime = (out / "teachers" / "teacher_qwen2" / "model.safetensors").stat().st_mtime
    with monkeypatch.context() as m:
        m.setattr(subprocess, "Popen", refuse_child_process)
        assert demo_main(["--task", "arithmetic", "--quick", "--output_dir", str(out)]) == 0
    assert (out / "teachers" / "teacher_qwen2" / "model.safetensors").stat().st_mtime == mtime
    # ... but not a student trained with other settings than the demo's (a config changed since)
    saved = out / "runs" / "student_kv" / "kvdistill_config.yaml"
    text = saved.read_text()
    saved.write_text(yaml.safe_dump({**yaml.safe_load(text), "kv_weight": 0.5}))
    try:
        with pytest.raises(ConfigError, match=r"student_kv was trained with other settings \(kv_weight differ\) than this demo asks; delete"):
            demo_main(["--task", "arithmetic", "--quick", "--output_dir", str(out)])
    finally:
        saved.write_text(text)  # the other tests read this output


@pytest.mark.slow
def test_quality_gate_names_the_teacher(demo_out, monkeypatch):
    # the gate reads the teachers' dev evaluations the demo made: no child process
    monkeypatch.setattr(subprocess, "Popen", refuse_child_process)
    with pytest.raises(SystemExit, match=r"^quality gate: teacher teacher_qwen2 reached [0-9.]+ on dev, [0-9.]+ below "
                                         r"the 0.99 gate; train it longer \(delete .* lower --gate$"):
        demo_main(["--task", "arithmetic", "--quick", "--output_dir", str(demo_out), "--gate", "0.99"])


STUDENT_KV = ("report.md", "runs/student_kv/model.safetensors", "eval/student_kv/items.jsonl")


@pytest.mark.slow
def test_a_rerun_of_the_kv_student_gives_the_same_bytes(demo_out, in_process, monkeypatch):
    """The same command and seed on this machine give the same bytes: the KV student (its capture,
    training and test evaluation) made again in the same output dir, in this process this time (the
    fixture ran them in fresh interpreters, the demo's child processes): this interpreter, after the
    session's other runs, gives the bytes a fresh one gave."""
    before = {rel: (demo_out / rel).read_bytes() for rel in STUDENT_KV}
    for rel in ("runs/student_kv", "captures/student_kv", "eval/student_kv"):
        shutil.rmtree(demo_out / rel)
    (demo_out / "report.md").unlink()
    monkeypatch.setattr(demo, "run_parallel", in_process)
    assert demo_main(["--task", "arithmetic", "--quick", "--output_dir", str(demo_out), "--workers", "2"]) == 0
    for rel in STUDENT_KV:
        assert (demo_out / rel).read_bytes() == before[rel], rel


@pytest.mark.slow
@pytest.mark.extended
def test_a_fresh_rerun_gives_the_same_bytes(demo_out, tmp_path):
    """Every model and evaluation of the demo made again from scratch elsewhere (~16 child processes)."""
    again = tmp_path / "demo_again"
    assert demo_main(["--task", "arithmetic", "--quick", "--output_dir", str(again), "--workers", "2"]) == 0
    def numbers(report: Path) -> str:  # the environment line names the allocator, which differs between the
        # fixture's in-process runs and these child processes: what is compared is every number of the report
        return "\n".join(x for x in report.read_text().splitlines() if not x.startswith("Environment of the student"))

    assert numbers(again / "report.md") == numbers(demo_out / "report.md").replace(str(demo_out), str(again))
    models = sorted(p.relative_to(demo_out) for p in demo_out.glob("*/*/model.safetensors"))
    assert len(models) == 9  # random inits (3), trained teachers (2), SFT curve, 3 students
    for rel in models + sorted(p.relative_to(demo_out) for p in demo_out.glob("eval/*/items.jsonl")):
        assert (demo_out / rel).read_bytes() == (again / rel).read_bytes(), rel


def test_progress_line_reads_a_trainings_steps_and_extrapolates_its_eta(tmp_path):
    from kvdistill.commands.demo import progress_line

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 10, "loss": 1.0}\n{"step": 20, "loss": 0.9}\n')
    (tmp_path / "c.yaml").write_text("max_steps: 100\n")
    argv = ["train", "--config", str(tmp_path / "c.yaml"), "--output_dir", str(run)]
    assert progress_line("sft", argv, 40.0) == "    sft: kvdistill train, step 20/100, 40 s, ETA 160 s"
    assert progress_line("sft", [*argv, "--max_steps", "40"], 40.0).endswith("step 20/40, 40 s, ETA 40 s")
    assert progress_line("ev", ["eval", "--model", "m"], 7.2) == "    ev: kvdistill eval, 7 s"
    # an ablation (the binding demo's students): its finished runs, read from its log
    log = tmp_path / "students.log"
    argv = ["ablate", "--config", "s.yaml"]
    assert progress_line("students", argv, 5.0, log) == "    students: kvdistill ablate, 5 s"  # no log yet
    log.write_text("[1/4] baseline seed 11: finished, skipped\nstep 3/10 | loss 1.0\n[3/4] kv seed 11: "
                   "training + evaluating -> r\n[2/4] logit_kd seed 11: done\n")
    assert progress_line("students", argv, 60.0, log) == "    students: kvdistill ablate, 2/4 runs done, 60 s, ETA 60 s"


def test_run_parallel_prints_progress_while_jobs_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(demo, "PROGRESS_S", 0)  # every poll: the job below runs for seconds (imports)
    run_parallel({"slow": [["gen-data", "--help"]]}, 1, tmp_path / "logs")
    assert "    slow: kvdistill gen-data, " in capsys.readouterr().out
