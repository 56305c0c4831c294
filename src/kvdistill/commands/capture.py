"""`kvdistill capture`: run every teacher once over a run's records and store its KV cache.

    kvdistill capture --config train.yaml --teacher_capture captures/run1 [--capture_dtype bf16]
        [--capture_layers mapped] [--capture_keep 0.5 --capture_compression uniform]
    accelerate launch --num_processes N -m kvdistill.cli capture --config train.yaml --teacher_capture ...

It reads the training config itself (the file `kvdistill train` reads), so the capture holds
exactly the teacher outputs that run needs: its labelled records and transfer set, each
teacher's tokenisation, key space, hidden states (CODI) and logits (logit KD). Training with the
same config and `teacher_capture: DIR` then loads no teacher weights, and its losses equal the
live-teacher run's up to float rounding in an fp32 capture (tested to 1e-5). A capture whose data, tokenizer, max_length, teacher
weights or settings differ from the run is refused with the differing fields named. Under N processes
each captures its own contiguous share of the records into its own shards, which equal a one-process
capture's tensor for tensor (the batches are the same); a killed capture, rerun on any number of
processes, captures only the shards missing. `capture_layers: mapped` stores only the teacher
layers the run's layer map reads (a run with another layer map refuses it); `capture_keep < 1` only a
share of each rationale's positions (`capture.compress_rationale`). Format and bytes per token:
`kvdistill/capture.py`.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path

import torch
from accelerate import PartialState
from tqdm.auto import tqdm

from kvdistill.capture import CaptureWriter, compress_rationale, rank_shards
from kvdistill.config import ConfigError, check_output_dir
from kvdistill.data import teacher_view
from kvdistill.models import DTYPES
from kvdistill.teachers import TeacherSet
from kvdistill.train.build import cache_key, capture_settings, load_run, teacher_batches
from kvdistill.train.config import KVDistillConfig, parse_config
from kvdistill.train.distributed import check_launch

logger = logging.getLogger(__name__)
SHARD_RECORDS = 1024  # records per shard at most: a killed process loses at most this many


def run_capture(cfg: KVDistillConfig, log=print, made: dict[str, dict] | None = None) -> Path:
    """Capture every teacher of `cfg` into `cfg.teacher_capture`; returns that directory.

    The main process plans each teacher's shards (`CaptureWriter.plan`: those on disk kept, the rest cut
    into shards of whole batches); every process then writes its contiguous share of the shards not yet
    done (`rank_shards`), collating each batch once for every teacher that needs it; after a barrier the
    main process checks every shard and writes the complete manifest. `log` prints on the main process only.

    `made` (`{capture dir: its settings}`, filled in here) lets a one-process caller making several
    captures share them: a new capture whose settings equal an earlier one's becomes a link to it, so
    variants that read the same teachers the same way (a signal and its shuffled control) store
    and compute them once.
    """
    if not cfg.teacher_capture:
        raise ConfigError("set --teacher_capture DIR: where the capture is written")
    check_output_dir(cfg.teacher_capture, "teacher_capture")
    rank, processes = cfg.process_index, cfg.world_size
    state = PartialState()  # the launch's process group, set up by the config (TrainingArguments)
    check_launch(state)
    log = log if rank == 0 else lambda _: None
    run = load_run(cfg, log=log)  # a run dir as student or teacher: its final model, else newest complete checkpoint
    if not run.teachers:
        raise ConfigError("nothing to capture: the config has no teachers, or no teacher signal "
                          "(kv_weight, logit_kd_weight, codi_weight all 0)")
    root = Path(cfg.teacher_capture)
    settings = capture_settings(cfg, run)
    same = next((d for d, st in (made or {}).items() if st == settings and Path(d) != root), None)
    if made is not None:
        made[str(root)] = settings
    if same is not None and processes == 1 and not root.is_symlink() and not any(root.iterdir()):  # nothing here yet
        root.rmdir()  # made by check_output_dir
        root.symlink_to(os.path.relpath(same, root.parent), target_is_directory=True)
        log(f"same teachers, records and settings as {same}: linked")
        return root
    teachers = TeacherSet(run.teachers, cfg.device, offload=cfg.teacher_offload, cache=True)
    writers = {t.name: CaptureWriter(root / t.name, settings[t.name]) for t in run.teachers}
    keys = {t.name: cache_key(cfg, t) for t in run.teachers}
    n, batch_size = len(run.records) + len(run.transfer), cfg.per_device_train_batch_size
    if state.is_main_process:
        for t in run.teachers:
            writers[t.name].plan(n, batch_size, processes, SHARD_RECORDS, _dtype_name(t.model.dtype))
    state.wait_for_everyone()
    mine = {name: rank_shards(w.shards(), rank, processes) for name, w in writers.items()}
    # pieces between every shard boundary, each with the shard it lies in per teacher (None: not this process's);
    # batches start at each piece, so with one plan for all teachers a shard's batches are a one-process capture's
    cuts = sorted({x for shards in mine.values() for s in shards for x in (s["start"], s["stop"])})
    pieces = [(a, b, {name: next((s for s in mine[name] if s["start"] <= a < s["stop"]), None) for name in writers})
              for a, b in itertools.pairwise(cuts)]
    pieces = [p for p in pieces if any(p[2].values())]
    t0 = time.time()
    entries: dict[str, list] = {name: [] for name in writers}
    tokens = dict.fromkeys(writers, 0)
    bar = tqdm(total=sum(b - a for a, b, _ in pieces), desc=f"capture (process {rank})" if processes > 1 else "capture",
               unit="record", disable=None)
    for a, b, shard in pieces:
        for lo, batch in zip(range(a, b, batch_size), teacher_batches(run, batch_size, a, b)):
            hi = min(lo + batch_size, b)  # the batch holds records [lo, hi)
            for t in run.teachers:
                s = shard[t.name]
                if s is None:
                    continue
                src = teacher_view(batch, t.name)
                tokens[t.name] += int(src["attention_mask"].sum())
                _, key_space, hidden, logits, queries = keys[t.name]
                kv, _ = teachers.forward(t.name, *(src[k].to(cfg.device) for k in ("input_ids", "attention_mask",
                                                                                    "segment_ids")),
                                         key_space=key_space, output_hidden_states=hidden, return_logits=logits,
                                         queries=queries, index=batch["index"])
                if cfg.capture_keep < 1:  # store the kept positions in place of the full records (no logits here)
                    generator = torch.Generator(device=kv.keys.device).manual_seed(cfg.seed * 1_000_003 + lo // batch_size)
                    kv = compress_rationale(kv, cfg.capture_keep, cfg.capture_compression, cfg.compression_lambda,
                                            generator)
                    teachers.cache.put(keys[t.name], batch["index"], kv, None)
                entries[t.name] += [(int(i), teachers.cache.take(keys[t.name], int(i))) for i in batch["index"]]
                if hi == s["stop"]:
                    writers[t.name].add(s, entries[t.name], tokens[t.name])
                    entries[t.name], tokens[t.name] = [], 0
            bar.update(hi - lo)
    bar.close()
    state.wait_for_everyone()  # every process's shards are on disk
    if state.is_main_process:
        for t in run.teachers:
            _report(writers[t.name].finish(), root / t.name, cfg, log)
    state.wait_for_everyone()  # the capture is complete when any process returns
    log(f"captured {len(run.teachers)} teacher(s) in {time.time() - t0:.1f} s on {processes} process(es)")
    return root


def _report(manifest: dict, where: Path, cfg: KVDistillConfig, log) -> None:
    """One line per teacher: records, tokens, size and bytes per token, what was kept."""
    size = sum((where / s["name"]).stat().st_size for s in manifest["shards"])
    layers = manifest["settings"].get("capture_layers")
    kept = "all layers" if layers is None else f"layers {layers['kept']} of {layers['teacher_layers']}"
    if cfg.capture_keep < 1:
        kept += f", {manifest['positions']} positions stored ({cfg.capture_compression}, capture_keep {cfg.capture_keep})"
    log(f"{where.name}: {manifest['n_records']} records, {manifest['tokens']} tokens, {size / 2**20:.1f} MiB "
        f"({size / max(manifest['tokens'], 1):,.0f} bytes per token, {cfg.capture_dtype}, {kept}), "
        f"{len(manifest['shards'])} shard(s) -> {where}")


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype and name in ("fp32", "bf16", "fp16"))


def main(argv: list[str]) -> int:
    cfg = parse_config(argv, prog="kvdistill capture", description=__doc__)
    run_capture(cfg)
    return 0
