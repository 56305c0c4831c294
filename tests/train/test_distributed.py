"""Two CPU processes under the shipped accelerate configs (FSDP2, DeepSpeed ZeRO-2/3) against one.

Each run trains the fixtures' two-teacher setup (a Qwen2 teacher, a Llama teacher with another
tokenizer) for a few steps. The 2-process run gets per-process batches of 2, the reference one
process with batches of 4, so both see the same 4 records per optimizer step.

Tolerances (fp32): the 2-process run differs from the reference only in how sums are split (two
micro-batches padded to their own lengths, gradients reduced over 2 ranks instead of summed in one
batch), i.e. float32 sums in another order, ~1e-7 relative per step. `LOSS_RTOL` and `WEIGHT_ATOL`
leave two orders of magnitude for 4 AdamW steps. A real bug is far outside them: a rank that skips
the gradient sync or an optimizer that steps stale tensors moves weights by about the learning rate
(1e-3) per step, a loss scaled by the world size moves the loss by a factor of 2.

All three configs train, match the reference, checkpoint, resume and save a plain HF student
(the resume test is marked slow), and train from a `kvdistill capture` with no teacher weights. ZeRO-3 included: its models load already partitioned
(transformers builds them inside `deepspeed.zero.Init`), the aligner-sizing probe gathers each one
whole (`train.distributed.gathered`), and the projector's fused gather + matmul runs inside its
module's call, where ZeRO-3's hooks gather the weight for the backward too. What ZeRO-3 cannot do on
several processes (the main process generating alone: `fusion: correctness`, `accuracy_eval_steps`)
is refused before anything loads.

Teacher placement (the choice tested here, docs/training.md): under FSDP and ZeRO-2 every rank holds
a whole, frozen teacher in eval mode, outside the sharded model; under ZeRO-3 teachers are
partitioned like the student (`TeacherSet.prepare_deepspeed`).

DeepSpeed runs on CPU (its CPU accelerator falls back to gloo without oneCCL) once `pip install
deepspeed` is done; without it those cases skip.
"""

import json
import shutil
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kvdistill.align.aligner import KVAligner
from kvdistill.config import ConfigError
from kvdistill.teachers import teacher_deepspeed_config
from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config
from kvdistill.train.distributed import check_launch, enable_cpu_fsdp

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "accelerate"
WORKER = Path(__file__).resolve().with_name("dist_worker.py")
TEACHERS = ("qwen2_teacher", "llama_teacher_alt_tok")
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-5
STEPS = 4

needs_deepspeed = pytest.mark.skipif(find_spec("deepspeed") is None, reason="deepspeed is not installed")

# accelerate config -> the kind of the trained parameters it gives (all runs: --use_cpu true, base_args)
KINDS = {"fsdp": "dtensor", "deepspeed_zero2": "plain", "deepspeed_zero3": "zero3"}
MODE_PARAMS = [
    pytest.param("fsdp"),
    pytest.param("deepspeed_zero2", marks=needs_deepspeed),
    pytest.param("deepspeed_zero3", marks=needs_deepspeed),
]


@pytest.fixture(scope="module")
def run_args(module_base_args, tiny_world):
    """Args of the two-teacher run: `run_args(output_dir, per_device_batch, **overrides)`."""
    m = tiny_world.models
    teachers = f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher_alt_tok']}, weight: 0.5}}]"

    def make(out: Path, per_device: int, **overrides) -> list[str]:
        # adam_epsilon 1e-6: an element whose gradient is ~1e-8 gets a sign-like Adam step (g / (|g| + eps)),
        # so the ranks' reduction-order noise in it would show at the learning rate's scale (1.3e-5 on one
        # aligner weight in 4 steps); at 1e-6 the step stays proportional to the gradient there
        return module_base_args(output_dir=out, teachers=teachers, max_steps=STEPS, max_samples=16, kv_weight=1,
                                aligner_learning_rate=3e-3, per_device_train_batch_size=per_device, logging_steps=1,
                                adam_epsilon=1e-6, **overrides)

    return make


@pytest.fixture(scope="module")
def reference(run_args, tmp_path_factory):
    """One process, batches of 4: the logged losses and the trained state (student + aligners)."""
    trainer = build_trainer(parse_config(run_args(tmp_path_factory.mktemp("ref") / "run", 4, save_strategy="no")))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {k: v.detach().clone() for k, v in trainer.distill_model.state_dict().items()}


def _launch_2(launch, config: str, argv: list[str], target: list[str]) -> None:
    r = launch(["--config_file", str(CONFIGS / f"{config}.yaml"), "--num_processes", "2"], [*target, *argv])
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.fixture(scope="module")
def two_process_run(launch, run_args, tmp_path_factory):
    """`two_process_run(config)`: the output dir of the 2-process worker run under `config` (batches of 2),
    launched once per module: its placement and gathered state, and its `checkpoint-2`, from which the
    resume test starts (a checkpoint changes nothing the worker records)."""
    done: dict[str, Path] = {}

    def get(config: str) -> Path:
        if config not in done:
            out = tmp_path_factory.mktemp(config) / "run"
            _launch_2(launch, config, run_args(out, 2, save_steps=2), [str(WORKER)])
            done[config] = out
        return done[config]

    return get


def _checksum(path: Path) -> float:
    return sum(float(v.double().sum()) for v in load_file(path / "model.safetensors").values())


@pytest.mark.parametrize("config", MODE_PARAMS)
def test_two_processes_match_one_and_shard_as_configured(config, two_process_run, reference, tiny_world):
    ref_losses, ref_state = reference
    kind = KINDS[config]
    out = two_process_run(config)
    ranks = [json.loads((out / f"placement_rank{i}.json").read_text()) for i in range(2)]

    for rank in ranks:
        assert rank["mode"] == str(DistributedType.FSDP if config == "fsdp" else DistributedType.DEEPSPEED)
        # the student and the aligners are in the distributed model, as the config says
        assert {p["kind"] for p in rank["params"].values()} == {kind}
        assert {n.split(".")[0] for n in rank["params"]} >= {"student", "aligners"}
        assert {g["name"]: g["lr"] for g in rank["optimizer_groups"]} == {"student": 1e-3, "aligner": 3e-3}
        # teachers: outside the wrapped model, frozen, in eval mode; whole copies except under ZeRO-3
        for name in TEACHERS:
            t = rank["teachers"][name]
            assert t["kinds"] == (["zero3"] if config == "deepspeed_zero3" else ["plain"])
            assert not t["fsdp_wrapped"] and not t["training"] and not t["requires_grad"]
            # identical on both ranks and unchanged by training
            assert t["checksum"] == pytest.approx(_checksum(tiny_world.models[name]), rel=1e-12)
        assert rank["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL)
        # per-part gradient norms where the gradients are readable (FSDP); DeepSpeed keeps them in its own
        # buffers and steps inside backward: only its global norm is logged, never a per-part 0
        for logged in rank["grad_norms"]:
            assert logged["grad_norm"] > 0
            parts = {k: v for k, v in logged.items() if k != "grad_norm"}
            if kind == "dtensor":
                assert parts["grad_norm/student"] > 0 and parts["grad_norm/aligner"] > 0
            else:
                assert parts == {}
    assert len(ref_losses) == STEPS

    if kind == "dtensor":  # each rank stores its shard only: together they are the whole model
        for name, p in ranks[0]["params"].items():
            assert ranks[0]["params"][name]["local"] + ranks[1]["params"][name]["local"] == p["full"], name
        for g in ranks[0]["optimizer_groups"]:  # the groups hold the sharded parameters, split by module
            assert g["params"] and all(n.startswith("student.") == (g["name"] == "student") for n in g["params"])

    state = load_file(out / "gathered.safetensors")
    assert state.keys() == ref_state.keys()
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, atol=WEIGHT_ATOL, rtol=0, msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("config", MODE_PARAMS)
def test_kvdistill_train_checkpoints_resumes_and_saves_a_plain_student(config, launch, run_args, two_process_run,
                                                                       reference, tmp_path):
    """`kvdistill train` under the config, resumed from the uninterrupted 2-process run's checkpoint: the
    same weights as that run, and a full student at the end."""
    _, ref_state = reference
    full, resumed = two_process_run(config), tmp_path / "resumed"
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    _launch_2(launch, config, run_args(resumed, 2, save_steps=2, resume_from_checkpoint=resumed / "checkpoint-2"),
              ["-m", "kvdistill.cli", "train"])
    for i in range(2):  # a rank holds a shard: its sum is labelled as such, not as the model's fingerprint
        assert set(json.loads((resumed / "ranks" / f"rank{i}.json").read_text())) == {"logged_loss",
                                                                                         "local_shard_checksum"}
    # the saved student is the whole trained student (gathered), loadable by any HF tool: the uninterrupted
    # run's to float rounding, and the one-process reference's within its tolerance
    uninterrupted = load_file(full / "gathered.safetensors")
    student = AutoModelForCausalLM.from_pretrained(resumed).state_dict()
    for k, v in student.items():
        torch.testing.assert_close(v, uninterrupted[f"student.{k}"], atol=1e-6, rtol=0, msg=k)
        torch.testing.assert_close(v, ref_state[f"student.{k}"], atol=WEIGHT_ATOL, rtol=0, msg=k)
    modules = load_file(resumed / "kvdistill_modules.safetensors")
    assert modules and all(k.startswith("aligners.") for k in modules)
    for k, v in modules.items():
        torch.testing.assert_close(v, uninterrupted[k], atol=1e-6, rtol=0, msg=k)
    for name in TEACHERS:  # each aligner's own copy is the gathered one too
        aligner = KVAligner.load(resumed / "aligners" / name)
        for k, v in aligner.state_dict().items():
            torch.testing.assert_close(v, modules[f"aligners.{name}.{k}"], atol=0, rtol=0, msg=k)


@pytest.mark.parametrize("config", MODE_PARAMS)
def test_captured_teachers_train_as_the_live_ones(config, launch, run_args, reference, tmp_path):
    """Teachers read from a `kvdistill capture` (meta-device models, no weights) under each config:
    the same losses as the live one-process reference."""
    from kvdistill.commands.capture import run_capture

    ref_losses, _ = reference
    out, capture = tmp_path / "run", tmp_path / "capture"
    run_capture(parse_config(run_args(tmp_path / "cap", 4, teacher_capture=capture)), log=lambda _: None)
    _launch_2(launch, config, run_args(out, 2, save_strategy="no", teacher_capture=capture), [str(WORKER)])
    for i in range(2):
        rank = json.loads((out / f"placement_rank{i}.json").read_text())
        assert rank["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL)
        assert all(t["meta"] for t in rank["teachers"].values())  # no teacher weights on any rank


@needs_deepspeed
@pytest.mark.parametrize(("option", "value", "error"), [
    ("fusion", "correctness", "fusion: correctness has the main process answer"),
    ("accuracy_eval_steps", 2, "accuracy_eval_steps has the main process decode"),
])
def test_zero3_refuses_main_process_generation_before_loading(option, value, error, launch, run_args, tmp_path):
    # the main process generating alone would hang: under ZeRO-3 `generate` syncs every step over the ranks
    cli = ["-m", "kvdistill.cli", "train", *run_args(tmp_path / "run", 2, **{option: value})]
    r = launch(["--config_file", str(CONFIGS / "deepspeed_zero3.yaml"), "--num_processes", "2"], cli)
    assert r.returncode != 0 and "exitcode  : 2" in r.stderr  # the CLI's one-line error, on each rank
    assert f"kvdistill train: error: {error}" in r.stderr
    assert "Loading weights" not in r.stderr  # refused before any model loads


# ---------------------------------------------------------------- configs and launch checks, no launch
def _launch_env(config: str) -> dict[str, str]:
    """The environment `accelerate launch --config_file <config> --num_processes 2` gives its workers
    (accelerate's own code path, without starting them)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / f"{config}.yaml"),
                                               "--num_processes", "2", "x.py"])
    args, defaults, _ = _validate_launch_command(args)
    if not args.use_deepspeed:
        return prepare_multi_gpu_env(args)
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)  # as launch_command does
    return prepare_deepspeed_cmd_env(args)[1]


def test_shipped_fsdp_config_builds_an_fsdp2_plugin_on_cpu(monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin

    for k, v in _launch_env("fsdp").items():
        monkeypatch.setenv(k, v)
    plugin = FullyShardedDataParallelPlugin()  # raises on CPU with fsdp_sync_module_states
    assert plugin.fsdp_version == 2
    assert "FULL_STATE_DICT" in str(plugin.state_dict_type)
    assert plugin.transformer_cls_names_to_wrap == ["Qwen2DecoderLayer"]
    assert not plugin.cpu_ram_efficient_loading and not plugin.activation_checkpointing


@pytest.mark.parametrize("stage", [2, 3])
def test_shipped_deepspeed_configs_build_a_plugin(stage, monkeypatch):
    # the plugin, not TrainingArguments: those need deepspeed installed (the runs above build them)
    from accelerate.utils import DeepSpeedPlugin

    for k, v in _launch_env(f"deepspeed_zero{stage}").items():
        monkeypatch.setenv(k, v)
    plugin = DeepSpeedPlugin()
    ds = plugin.deepspeed_config
    assert ds["zero_optimization"]["stage"] == stage
    # left to the Trainer, which fills them from the training config
    assert ds["gradient_accumulation_steps"] == ds["gradient_clipping"] == ds["train_batch_size"] == "auto"
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] == (stage == 3)
    assert not plugin.zero3_init_flag
    teacher = teacher_deepspeed_config(ds)
    assert teacher["zero_optimization"]["stage"] == (3 if stage == 3 else 0)
    # DeepSpeed derives the teacher's train_batch_size per world size: a fixed one fails on 2 ranks
    assert "train_batch_size" not in teacher and teacher["train_micro_batch_size_per_gpu"] == 1


def _accelerator(kind: DistributedType, processes: int = 2) -> SimpleNamespace:
    return SimpleNamespace(distributed_type=kind, num_processes=processes,
                           state=SimpleNamespace(distributed_type=kind, mixed_precision="no"))


@pytest.mark.parametrize("accelerator", [
    _accelerator(DistributedType.NO, 1),  # no process group: each worker is "rank 0 of 1"
    _accelerator(DistributedType.NO, 2),  # `--ddp_backend gloo` without --use_cpu: a group, but no DDP/FSDP
])
def test_workers_that_would_train_alone_are_refused(accelerator, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"each would train alone; .* pass `--use_cpu true`"):
        check_launch(accelerator)


@pytest.mark.parametrize("kind", [DistributedType.MULTI_CPU, DistributedType.FSDP, DistributedType.DEEPSPEED])
def test_a_data_parallel_launch_passes(kind, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_launch(_accelerator(kind))
    monkeypatch.delenv("WORLD_SIZE")
    check_launch(_accelerator(DistributedType.NO, 1))  # plain `kvdistill train`


def test_fsdp1_on_cpu_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    assert not enable_cpu_fsdp(_accelerator(DistributedType.MULTI_GPU))  # GPUs: accelerate's own FSDP
    with pytest.raises(ConfigError, match="fsdp_version: 2"):
        enable_cpu_fsdp(_accelerator(DistributedType.MULTI_CPU))
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    assert not enable_cpu_fsdp(_accelerator(DistributedType.MULTI_CPU))  # DDP on CPU stays DDP
