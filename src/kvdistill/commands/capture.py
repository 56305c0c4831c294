"""`kvdistill capture`: run every teacher once over a run's records and store its KV cache.

    kvdistill capture --config train.yaml --teacher_capture captures/run1 [--capture_dtype bf16]
        [--capture_layers mapped] [--capture_keep 0.5 --capture_compression uniform]

It reads the training config itself (the file `kvdistill train` reads), so the capture holds
exactly the teacher outputs that run needs: its labelled records and transfer set, each
teacher's tokenisation, key space, hidden states (CODI) and logits (logit KD). Training with the
same config and `teacher_capture: DIR` then loads no teacher weights, and its losses equal the
live-teacher run's up to float rounding in an fp32 capture (tested to 1e-5). A capture whose data, tokenizer, max_length, teacher
weights or settings differ from the run is refused with the differing fields named; a killed
capture resumes at its first missing shard. `capture_layers: mapped` stores only the teacher
layers the run's layer map reads (a run with another layer map refuses it); `capture_keep < 1` only a
share of each rationale's positions (`capture.compress_rationale`). Format and bytes per token:
`kvdistill/capture.py`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kvdistill.capture import CaptureWriter, compress_rationale
from kvdistill.config import ConfigError, check_output_dir
from kvdistill.data import teacher_view
from kvdistill.models import DTYPES
from kvdistill.teachers import TeacherSet
from kvdistill.train.build import cache_key, capture_settings, load_run, teacher_batches
from kvdistill.train.config import KVDistillConfig, parse_config

logger = logging.getLogger(__name__)
SHARD_RECORDS = 1024  # records per shard: a killed capture loses at most this many


def run_capture(cfg: KVDistillConfig, log=print, made: dict[str, dict] | None = None) -> Path:
    """Capture every teacher of `cfg` into `cfg.teacher_capture`; returns that directory.

    One pass over the records: each batch is collated once and every teacher runs on it; every
    `SHARD_RECORDS` records each teacher's entries go to its next shard.

    `made` (`{capture dir: its settings}`, filled in here) lets a caller making several captures
    share them: a new capture whose settings equal an earlier one's becomes a link to it, so
    variants that read the same teachers the same way (a signal and its shuffled control) store
    and compute them once.
    """
    if not cfg.teacher_capture:
        raise ConfigError("set --teacher_capture DIR: where the capture is written")
    check_output_dir(cfg.teacher_capture, "teacher_capture")
    run = load_run(cfg, log=log)  # a run dir as student or teacher: its final model, else newest complete checkpoint
    if not run.teachers:
        raise ConfigError("nothing to capture: the config has no teachers, or no teacher signal "
                          "(kv_weight, logit_kd_weight, codi_weight all 0)")
    root = Path(cfg.teacher_capture)
    settings = capture_settings(cfg, run)
    same = next((d for d, st in (made or {}).items() if st == settings and Path(d) != root), None)
    if made is not None:
        made[str(root)] = settings
    if same is not None and not root.is_symlink() and not any(root.iterdir()):  # nothing captured here yet
        root.rmdir()  # made by check_output_dir
        root.symlink_to(os.path.relpath(same, root.parent), target_is_directory=True)
        log(f"same teachers, records and settings as {same}: linked")
        return root
    teachers = TeacherSet(run.teachers, cfg.device, offload=cfg.teacher_offload, cache=True)
    writers = {t.name: CaptureWriter(root / t.name, settings[t.name]) for t in run.teachers}
    keys = {t.name: cache_key(cfg, t) for t in run.teachers}
    n = len(run.records) + len(run.transfer)
    batch_size = cfg.per_device_train_batch_size
    per_shard = max(SHARD_RECORDS // batch_size, 1)  # batches per shard
    n_batches = math.ceil(n / batch_size)
    t0, shard = time.time(), 0
    entries: dict[str, list] = {name: [] for name in writers}
    tokens = dict.fromkeys(writers, 0)
    for j, batch in enumerate(tqdm(teacher_batches(run, batch_size), total=n_batches, desc="capture",
                                   unit="batch", disable=None)):
        for t in run.teachers:
            src = teacher_view(batch, t.name)
            tokens[t.name] += int(src["attention_mask"].sum())
            if writers[t.name].done(shard):
                continue
            _, key_space, hidden, logits, queries = keys[t.name]
            kv, _ = teachers.forward(t.name, *(src[k].to(cfg.device) for k in ("input_ids", "attention_mask",
                                                                                "segment_ids")),
                                     key_space=key_space, output_hidden_states=hidden, return_logits=logits,
                                     queries=queries, index=batch["index"])
            if cfg.capture_keep < 1:  # store the kept positions in place of the full records (no logits here)
                generator = torch.Generator(device=kv.keys.device).manual_seed(cfg.seed * 1_000_003 + j)
                kv = compress_rationale(kv, cfg.capture_keep, cfg.capture_compression, cfg.compression_lambda,
                                        generator)
                teachers.cache.put(keys[t.name], batch["index"], kv, None)
            entries[t.name] += [(int(i), teachers.cache.take(keys[t.name], int(i))) for i in batch["index"]]
        if (j + 1) % per_shard == 0 or j + 1 == n_batches:
            for name, writer in writers.items():
                if entries[name]:
                    writer.add(shard, entries[name])
            shard, entries = shard + 1, {name: [] for name in writers}
    for t in run.teachers:
        writers[t.name].finish(n, _dtype_name(t.model.dtype))
        size = sum(f.stat().st_size for f in (root / t.name).glob("*.safetensors"))
        layers = settings[t.name].get("capture_layers")
        kept = "all layers" if layers is None else f"layers {layers['kept']} of {layers['teacher_layers']}"
        if cfg.capture_keep < 1:
            kept += (f", {writers[t.name].positions()} positions stored ({cfg.capture_compression}, capture_keep "
                     f"{cfg.capture_keep})")
        log(f"{t.name}: {n} records, {tokens[t.name]} tokens, {size / 2**20:.1f} MiB ({size / max(tokens[t.name], 1):,.0f} "
            f"bytes per token, {cfg.capture_dtype}, {kept}) -> {root / t.name}")
    log(f"captured {len(run.teachers)} teacher(s) in {time.time() - t0:.1f} s")
    return root


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype and name in ("fp32", "bf16", "fp16"))


def main(argv: list[str]) -> int:
    cfg = parse_config(argv, prog="kvdistill capture", description=__doc__)
    run_capture(cfg)
    return 0
