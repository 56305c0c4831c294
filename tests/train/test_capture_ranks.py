"""`kvdistill capture` on several processes (`accelerate launch --num_processes 2`), resumed, and read lazily.

The run: two teachers (Qwen2, and Llama with another tokenizer), KV and logit KD, 24 records in batches
of 4. One process cuts them into one shard per teacher, two processes into two (records 0-11 and 12-23,
one each). Each process batches its records as the one process does, so the stored tensors are equal
bit for bit (the launched processes and this one both run one intra-op thread). A 2-rank DDP run
(batches of 2 per rank) trained from the 2-process capture equals the 1-process run (batches of 4)
trained from the 1-process capture up to float32 sums in another order: `LOSS_RTOL` and `WEIGHT_ATOL` as
in test_distributed.py; the measured loss gap was 7.0e-8 relative (one float32 step at 6.8). That run
takes ~30 s (a launch and a reference training), so it is `extended`; the rest ~27 s, most of it the launch.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvdistill.capture import MANIFEST, CaptureError, CaptureReader, CaptureWriter, plan_shards
from kvdistill.commands.capture import run_capture
from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config

TEACHERS = ("qwen2_teacher", "llama_teacher_alt_tok")
WORKER = Path(__file__).resolve().with_name("dist_worker.py")
DDP = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def run_args(module_base_args, tiny_world):
    """`run_args(output_dir, teacher_capture, per_device_batch=4)`: the run's CLI args."""
    m = tiny_world.models
    teachers = f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher_alt_tok']}, weight: 0.5}}]"

    def make(out: Path, capture: Path, per_device: int = 4) -> list[str]:
        # adam_epsilon 1e-6: keeps the ranks' reduction-order noise proportional (test_distributed.py says why)
        return module_base_args(output_dir=out, teachers=teachers, teacher_capture=capture, max_samples=24,
                                kv_weight=1, logit_kd_weight=1.0, max_steps=3, logging_steps=1, adam_epsilon=1e-6,
                                per_device_train_batch_size=per_device, save_strategy="no")

    return make


@pytest.fixture(scope="module")
def captures(run_args, launch, tmp_path_factory) -> tuple[Path, Path]:
    """The run captured by one process (in this one) and by two (`accelerate launch`)."""
    d = tmp_path_factory.mktemp("captures")
    one = run_capture(parse_config(run_args(d / "run", d / "one")), log=lambda _: None)
    r = launch(DDP, ["-m", "kvdistill.cli", "capture", *run_args(d / "run", d / "two")])
    assert r.returncode == 0, r.stderr[-4000:]
    return one, d / "two"


def _manifest(root: Path) -> dict:
    return json.loads((root / MANIFEST).read_text())


def _assert_same_records(a: CaptureReader, b: CaptureReader) -> None:
    assert len(a) == len(b) == 24
    for i in a:
        x, y = a[i], b[i]
        assert x.keys() == y.keys()
        for field in x:
            assert torch.equal(x[field], y[field]), (i, field)


def test_two_processes_capture_what_one_does_bit_for_bit(captures):
    one, two = captures
    for name in TEACHERS:
        m1, m2 = _manifest(one / name), _manifest(two / name)
        assert m1["complete"] and m2["complete"] and m1["format"] == m2["format"] == 2
        assert [(s["start"], s["stop"]) for s in m1["shards"]] == [(0, 24)]
        assert [(s["start"], s["stop"]) for s in m2["shards"]] == [(0, 12), (12, 24)]  # one per process
        for key in ("settings", "n_records", "teacher_dtype", "tokens", "positions"):
            assert m1[key] == m2[key], key
        settings = m1["settings"]
        _assert_same_records(CaptureReader(one / name, settings), CaptureReader(two / name, settings))


@pytest.mark.slow
@pytest.mark.extended
def test_ddp_training_from_the_two_process_capture_equals_one_process(captures, run_args, launch, tmp_path):
    one, two = captures
    ref = build_trainer(parse_config(run_args(tmp_path / "ref", one)))
    ref.train()
    ref_losses = [h["loss"] for h in ref.state.log_history if "loss" in h]
    out = tmp_path / "ddp"
    r = launch(DDP, [str(WORKER), *run_args(out, two, per_device=2)])
    assert r.returncode == 0, r.stderr[-4000:]
    for i in range(2):
        rank = json.loads((out / f"placement_rank{i}.json").read_text())
        assert all(t["meta"] for t in rank["teachers"].values())  # no teacher weights on any rank
        assert len(rank["losses"]) == 3 and rank["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL)
    gathered = load_file(out / "gathered.safetensors")
    for k, v in ref.distill_model.state_dict().items():
        torch.testing.assert_close(gathered[k], v, atol=WEIGHT_ATOL, rtol=0, msg=k)


def test_a_killed_capture_resumes_on_another_number_of_processes(captures, run_args, tmp_path):
    """As if process 1 was killed while writing Llama's second shard: the manifest is the plan (not complete),
    that shard is cut short at its name and its temp file is left. One process finishes it: only that shard is
    captured again, and the capture equals the uninterrupted one."""
    _, two = captures
    root = tmp_path / "two"
    shutil.copytree(two, root)
    argv = run_args(tmp_path / "run", root)
    killed = root / "llama_teacher_alt_tok"
    plan = _manifest(killed)
    (killed / MANIFEST).write_text(json.dumps({**plan, "complete": False}))
    cut = killed / "shard-00012.safetensors"
    cut.write_bytes(cut.read_bytes()[:1000])
    (killed / "shard-00012.safetensors.tmp").write_bytes(b"\0" * 100)
    kept = {p: p.stat().st_mtime_ns for p in root.glob("*/shard-*.safetensors") if p != cut}
    run_capture(parse_config(argv), log=lambda _: None)
    assert {p: p.stat().st_mtime_ns for p in kept} == kept  # finished shards are not recomputed
    assert not (killed / "shard-00012.safetensors.tmp").exists()  # the rewrite went through it
    for name in TEACHERS:
        resumed, whole = _manifest(root / name), _manifest(two / name)
        assert resumed == whole
        _assert_same_records(CaptureReader(two / name, whole["settings"]), CaptureReader(root / name, whole["settings"]))


def test_a_reader_opens_only_the_shards_of_the_records_it_reads(captures, tmp_path):
    _, two = captures
    root = tmp_path / "two"
    shutil.copytree(two, root)
    settings = _manifest(root / "qwen2_teacher")["settings"]
    (root / "qwen2_teacher" / "shard-00012.safetensors").unlink()
    reader = CaptureReader(root / "qwen2_teacher", settings)  # the manifest alone
    assert torch.equal(reader[11]["keys"], CaptureReader(two / "qwen2_teacher", settings)[11]["keys"])
    with pytest.raises(CaptureError, match=r"shard-00012.safetensors cannot be read"):
        reader[12]


def test_a_format_1_capture_is_read_and_not_written_into(captures, run_args, tmp_path):
    """A one-process capture of an older kvdistill: a list of shard names, no record ranges, no shard headers."""
    one, _ = captures
    root = tmp_path / "old"
    for name in TEACHERS:
        m = _manifest(one / name)
        (root / name).mkdir(parents=True)
        save_file(load_file(one / name / "shard-00000.safetensors"), str(root / name / "shard-00000.safetensors"))
        (root / name / MANIFEST).write_text(json.dumps({"settings": m["settings"], "shards": ["shard-00000.safetensors"],
                                                        "complete": True, "n_records": 24,
                                                        "teacher_dtype": m["teacher_dtype"]}))
        _assert_same_records(CaptureReader(one / name, m["settings"]), CaptureReader(root / name, m["settings"]))
    trainer = build_trainer(parse_config(run_args(tmp_path / "run", root)))  # the run's settings check passes
    assert len(trainer.teachers.cache) == 2 * 24
    with pytest.raises(CaptureError, match="format-1 capture"):  # capturing into it would mix the formats
        CaptureWriter(root / name, m["settings"]).plan(24, 4, 1, 1024, "fp32")


@pytest.mark.parametrize("done, processes, expected", [
    ([], 1, [(0, 24)]),
    ([], 2, [(0, 12), (12, 24)]),
    ([], 4, [(0, 8), (8, 16), (16, 24)]),  # 6 batches: 2 each, never a part of a batch
    ([(0, 12)], 2, [(0, 12), (12, 20), (20, 24)]),  # the gap's 3 batches over 2 processes
    ([(4, 12), (8, 16)], 1, [(0, 4), (4, 12), (12, 24)]),  # an overlapping shard is not kept
    ([(0, 30)], 1, [(0, 24)]),  # nor one past the records
])
def test_plan_shards_keeps_the_shards_on_disk_and_cuts_the_gaps_into_whole_batches(done, processes, expected):
    spans = [{"name": f"s{a}", "start": a, "stop": b, "tokens": 1, "positions": 1} for a, b in done]
    plan = plan_shards(spans, 24, 4, processes, max_records=1024)
    assert [(s["start"], s["stop"]) for s in plan] == expected
    assert all(s["name"] == f"shard-{s['start']:05d}.safetensors" for s in plan if "tokens" not in s)
    assert plan_shards([], 24, 4, 1, max_records=8)[1] == {"name": "shard-00008.safetensors", "start": 8, "stop": 16}
