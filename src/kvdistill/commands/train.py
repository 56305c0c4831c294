"""`kvdistill train`: the training recipe, config -> models, data, aligners -> `KVDistillTrainer` -> outputs.

    kvdistill train --config x.yaml [--key value ...]

The wiring (config -> trainer) is `kvdistill.train.build`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

import torch

from kvdistill.config import ConfigError, UserError, check_output_dir
from kvdistill.io import read_json, write_json_atomic
from kvdistill.memory import (
    GIB,
    WARN_FRACTION,
    available_bytes,
    build_components,
    check_host_memory,
    total_gib,
)
from kvdistill.report import environment
from kvdistill.runs import METRICS, TRAIN_CONFIG, TRAIN_SUMMARY, check_reuse, checkpoints
from kvdistill.train.build import build_trainer, meta_aligners, planned_memory
from kvdistill.train.config import BOOKKEEPING, KVDistillConfig, parse_config

logger = logging.getLogger(__name__)


def run_training(cfg: KVDistillConfig) -> Path:
    """Train, save the final student + aligners, write `train_summary.json` and curve PNGs."""
    if cfg.ce_weight == 0:
        logger.warning("ce_weight=0: KV-only training can collapse to a trivially high cos-sim")
    trainer = build_trainer(cfg)
    result = trainer.train(resume_from_checkpoint=cfg.resume_from_checkpoint)
    out = Path(cfg.output_dir)
    trainer.save_model(str(out))
    if cfg.world_size > 1:  # each rank leaves a fingerprint: DDP must keep them identical
        # logged losses are gathered over ranks; `result.training_loss` is this rank's own average
        last_logged_loss = [h["loss"] for h in trainer.state.log_history if "loss" in h][-1]
        checksum = sum(float(p.double().sum()) for p in trainer.distill_model.parameters())
        # FSDP and DeepSpeed leave each rank a shard (or an empty ZeRO-3 partition): its sum is no fingerprint
        sharded = trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled
        write_json_atomic(out / "ranks" / f"rank{cfg.process_index}.json",
                          {"logged_loss": last_logged_loss, "local_shard_checksum" if sharded else "param_checksum": checksum},
                          indent=None)
    if trainer.is_world_process_zero():
        from kvdistill.train.curves import final_metrics, plot_training_curves

        summary = {
            "global_step": trainer.state.global_step,
            "train_loss": result.training_loss,
            "final": final_metrics(out / METRICS),
            "teachers": trainer.teachers.manifest(),
            "teacher_control": cfg.teacher_control,  # a control run is labelled as one (ablate's report)
            "teacher_controls": cfg.teacher_controls,  # each teacher's: its own `control`, else teacher_control
            "transfer_records": len(trainer.data_collator.transfer),
            "student": cfg.student,
            "environment": environment(),
        }
        write_json_atomic(out / TRAIN_SUMMARY, summary)
        plot_training_curves(out / METRICS, out)
    return out


def check_earlier_run(cfg: KVDistillConfig) -> None:
    """Refuse an output_dir that holds a finished or partial run made with other settings (bookkeeping
    aside): its files and checkpoints would mix with this run's, and `--resume_from_checkpoint last`
    would pick up the wrong run. `--overwrite_output_dir` trains over it anyway; a resumption (asked
    for by `--resume_from_checkpoint`) has the checkpoint's own checks (same teachers, complete)."""
    if cfg.overwrite_output_dir or cfg.resume_from_checkpoint:
        return
    out = Path(cfg.output_dir)
    fix = ("pass --overwrite_output_dir to train over it, a new --output_dir, or --resume_from_checkpoint last "
           "with the settings it was made with")
    for rdir in (out, *reversed(checkpoints(out))):  # the finished run, else its newest checkpoint with a config
        if (rdir / TRAIN_CONFIG).exists():
            check_reuse(rdir, TRAIN_CONFIG, cfg.to_yaml_dict(), BOOKKEEPING, common_only=True,
                        asker="this training", fix=fix)
            return


def host_estimate_gib(cfg: KVDistillConfig) -> float:
    """`kvdistill dry-run`'s total for this config as it runs on CPU (`train.build.planned_memory`): a 16-bit
    student counts in fp32 (`cpu_student_dtype` upcasts it) and every teacher counts (offloading moves nothing)."""
    specs = cfg.active_teachers
    comps = build_components(cfg.student, cfg.student_dtype, [(s.name, s.path, s.dtype, s.quantization) for s in specs])
    if comps[0].dtype in (torch.float16, torch.bfloat16):
        comps[0].dtype = torch.float32
    items = planned_memory(cfg, comps, meta_aligners(cfg, specs, comps), mixed="bf16" if cfg.bf16 else None,
                           offload=False)
    return total_gib(items)


def check_memory(cfg: KVDistillConfig, device: torch.device) -> None:
    """On CPU, refuse a run whose estimated peak memory exceeds what the machine has available, before any
    weight loads (the kernel would kill it without a message); warn when it leaves under 15 % headroom.
    Processes of one machine (`LOCAL_WORLD_SIZE`) each hold a copy. `allow_low_memory` trains anyway."""
    if device.type != "cpu":
        return
    available = available_bytes()
    if available is None:
        logger.info("memory check skipped: no MemAvailable in /proc/meminfo on this system")
        return
    try:
        need = host_estimate_gib(cfg) * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except Exception as err:  # advisory: a model it cannot size (a Hub id without a local config.json, an
        # unreadable config, an architecture of other names) is loaded, and refused if need be, as before
        logger.info("memory check skipped: %s", str(err).splitlines()[0] if str(err) else type(err).__name__)
        return
    verdict = check_host_memory(need, available)
    if verdict is None:
        return
    said = (f"training on CPU needs an estimated {need:.1f} GiB of memory at its peak (kvdistill dry-run's items) "
            f"and this machine has {available / GIB:.1f} GiB available")
    fixes = ("lower --per_device_train_batch_size or --max_length, train from a capture (--teacher_capture DIR, "
             "no teacher weights), add --bf16")
    if verdict == "refuse" and not cfg.allow_low_memory:
        raise ConfigError(f"{said}: it would be killed without a message; {fixes}, or pass --allow_low_memory "
                          "true to train anyway")
    if verdict == "refuse":
        logger.warning("%s: training anyway (allow_low_memory); it may be killed without a message", said)
    else:
        logger.warning("%s: less than %.0f%% headroom for a rough estimate; if it is killed: %s", said,
                       100 * (1 - WARN_FRACTION), fixes)


def main(argv: list[str]) -> int:
    cfg = parse_config(argv)  # a bad config fails here, before any model loads
    check_earlier_run(cfg)
    check_memory(cfg, cfg.device)  # before the output_dir is made: a refused run leaves nothing behind
    made = not Path(cfg.output_dir).exists()
    check_output_dir(cfg.output_dir)  # and an output_dir it could not write to, before any training
    try:
        out = run_training(cfg)
    except UserError:  # refused as the models load: no empty output_dir is left behind
        with contextlib.suppress(OSError):  # another rank may have removed it
            if made and not any(Path(cfg.output_dir).iterdir()):
                Path(cfg.output_dir).rmdir()
        raise
    summary = read_json(out / TRAIN_SUMMARY)
    if summary is not None:
        print(json.dumps(summary["final"], indent=1))
    print(f"student and aligners saved to {out}")
    return 0
