"""`report_to`: the KV metrics reach TensorBoard (and wandb, offline) with the values of `metrics.jsonl`."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from kvdistill.commands.train import main as train_main

TEACHERS = ("qwen2_teacher", "llama_teacher_alt_tok")
KV_METRICS = ("kv_loss", *(f"{kind}/{t}" for kind in ("cos_sim", "fusion_w") for t in TEACHERS))
INTEGRATIONS = [m for m in ("tensorboard", "wandb") if importlib.util.find_spec(m)]


@pytest.fixture(scope="module")
def logged_run(tiny_world, tmp_path_factory):
    """4 steps with two teachers (weights 1 and 0.5), logged every 2 steps to every installed integration.

    `report_to` is a list, given in YAML as a user would (`report_to: [tensorboard, wandb]`).
    """
    if not INTEGRATIONS:
        pytest.skip("neither tensorboard nor wandb is installed: pip install -e '.[tensorboard,wandb]'")
    root = tmp_path_factory.mktemp("logging")
    (root / "run.yaml").write_text(f"report_to: {json.dumps(INTEGRATIONS)}\n")
    m = tiny_world.models
    argv = [
        "--config", str(root / "run.yaml"), "--student", str(m["student"]), "--data", str(tiny_world.data_dir),
        "--output_dir", str(root / "run"),
        "--teachers", f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher_alt_tok']}, weight: 0.5}}]",
        "--max_length", "160", "--max_steps", "4", "--per_device_train_batch_size", "4",
        "--gradient_accumulation_steps", "1", "--kv_weight", "1", "--kv_warmup_steps", "0", "--logging_steps", "2",
        "--save_steps", "1000", "--use_cpu", "true", "--disable_tqdm", "true",
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")  # no account, no network: the run is written to WANDB_DIR
        mp.setenv("WANDB_DIR", str(root))
        mp.setenv("WANDB_SILENT", "true")
        assert train_main(argv) == 0
        if "wandb" in INTEGRATIONS:
            import wandb

            wandb.finish()  # flush the run and leave no active run to later tests
    rows = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    return root, rows


def test_tensorboard_event_files_hold_the_kv_metrics(logged_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, rows = logged_run
    (logdir,) = (root / "run" / "runs").iterdir()  # transformers' default: output_dir/runs/<date>_<host>
    events = EventAccumulator(str(logdir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for name in KV_METRICS:
        assert f"train/{name}" in tags, f"{name} not in TensorBoard tags {sorted(tags)}"
        scalars = events.Scalars(f"train/{name}")
        assert [s.step for s in scalars] == [r["step"] for r in rows] == [2, 4]
        assert all(math.isfinite(s.value) for s in scalars)
        assert [s.value for s in scalars] == pytest.approx([r[name] for r in rows], rel=1e-6)
    # fusion weights are the normalised teacher weights 1 : 0.5
    assert events.Scalars("train/fusion_w/qwen2_teacher")[-1].value == pytest.approx(2 / 3, rel=1e-6)
    assert events.Scalars("train/fusion_w/llama_teacher_alt_tok")[-1].value == pytest.approx(1 / 3, rel=1e-6)


def test_wandb_offline_run_records_the_kv_metrics(logged_run):
    pytest.importorskip("wandb")
    root, _ = logged_run
    (log,) = Path(root / "wandb").glob("offline-run-*/run-*.wandb")
    # the run log is binary protobuf records (wandb has no public offline reader); history keys are
    # stored as plain strings in it, so each logged metric's name must appear
    data = log.read_bytes()
    for name in KV_METRICS:
        assert f"train/{name}".encode() in data, name
