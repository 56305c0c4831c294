"""`kvdistill train`: the training recipe, config -> models, data, aligners -> `KVDistillTrainer` -> outputs.

    kvdistill train --config x.yaml [--key value ...]

The wiring (config -> trainer) is `kvdistill.train.build`.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

from kvdistill.config import UserError, check_output_dir
from kvdistill.io import read_json, write_json_atomic
from kvdistill.report import environment
from kvdistill.runs import METRICS, TRAIN_CONFIG, TRAIN_SUMMARY, check_reuse, checkpoints
from kvdistill.train.build import build_trainer
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


def main(argv: list[str]) -> int:
    cfg = parse_config(argv)  # a bad config fails here, before any model loads
    check_earlier_run(cfg)
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
