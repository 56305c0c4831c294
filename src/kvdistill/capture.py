"""Offline teacher-KV capture: a teacher's cache over a run's records, stored once, read by training.

Layout of a capture directory (one per run config, `teacher_capture: DIR`)::

    DIR/<teacher name>/manifest.json                 settings, the shards' record ranges, complete flag
    DIR/<teacher name>/shard-<first record>.safetensors

A shard holds the records `[start, stop)` of consecutive batches, time-major and unpadded, concatenated over
records: `keys`, `values` `[sum T_i, L, H, D]`, `segment_ids` `[sum T_i]`, optional `hidden_states`
`[sum T_i, L+1, d]`, `logits` `[sum T_i, V]` or, for a run whose head losses are chunked, the final
hidden states `final_hidden` `[sum T_i, d]` in their place (the settings say `logits: final_hidden`;
training puts them through the teacher's head a chunk at a time), and post-RoPE `queries` `[sum T_i, L, H_q, D]` (stored
when the run's kv_loss is attention; the settings then say `queries: true`), with `index` `[n]` (record ids) and `offsets`
`[n + 1]` (where each record starts). These are exactly the `TeacherCache` entries of a live run,
so a run that reads a capture sees the same tensors as one that ran the teacher (in the stored
dtype). With `capture_layers: mapped` keys and values hold only the `L_kept` teacher layers the
run's layer map reads (`[sum T_i, L_kept, H, D]`; the settings list them, so a run with another
map refuses the capture); reading puts them back at their indices of `[T_i, L, H, D]` with zeros at
the other layers, where every layer-map weight is 0 (the map is fixed, never learned), so the
aligner reads what a full capture gives. With `capture_keep < 1` a record holds only the kept
positions of its rationale (`compress_rationale`), so `T_i` is shorter than the teacher's input.

Manifest format 2 (`FORMAT`): `{format, settings, n_records, teacher_dtype, complete, shards: [{name, start,
stop, tokens, positions}], tokens, positions}`. The main process writes it twice: first as the plan
(`complete: false`; `plan_shards` cuts the records into shards, and a shard already on disk keeps its place),
then, when every process has written its shards, complete. Each shard's safetensors header carries its
`start`, `stop`, `tokens` (teacher input tokens), `positions` (stored) and a hash of the settings, so the
shard itself is the progress record: it is written to a temp name and renamed, and one whose header does not
read back, or names other settings, is captured again. A killed capture therefore resumes from the shards
present, on any number of processes. Format 1 (a list of shard names, one process) is still read.

Bytes per token per teacher: 2 (K and V) × L × H_kv × D × bytes per value, e.g. Qwen2-7B
(L 28, H_kv 4, D 128) in bf16: 2 × 28 × 4 × 128 × 2 = 57,344 B = 56 KiB per token, 28 MiB per
512-token sample (+ 2 × d × (L+1) per token for hidden states, V × bytes for logits or d × bytes for
final hidden states: 151,936 vs 896 for Qwen2.5-0.5B, 170× smaller). With
`capture_layers: mapped` L becomes the number of teacher layers the layer map reads: a CKA top-2
map of a 24-layer student (Qwen2.5-0.5B) that reads 12 of the 28 layers stores 2 × 12 × 4 × 128 × 2
= 24,576 B = 24 KiB per token, 12 MiB per 512-token sample (proportional 24 -> 28 reads 24 layers,
48 KiB; last_k 8 reads 8, 16 KiB).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from kvdistill.align.compress import Compression, compress_cache
from kvdistill.cache import REASONING, KVCache
from kvdistill.config import ConfigError
from kvdistill.io import nbytes, read_json, write_json_atomic, writing

MANIFEST = "manifest.json"
FORMAT = 2  # manifest and shard-header format; 1: one process, a list of shard names
CAPTURE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_FLOAT_FIELDS = ("keys", "values", "hidden_states", "logits", "final_hidden", "queries")
_KV_FIELDS = ("keys", "values", "queries")  # `[T, L, H, D]`: `capture_layers: mapped` keeps some of their layers
_FINGERPRINT_BYTES = 16 << 20  # head and tail of each weight file


class CaptureError(ConfigError):
    """A capture that does not match the run, or is incomplete; the message names the fix."""


def weights_fingerprint(path: str | os.PathLike) -> str:
    """A hash of a model's weight files: names, sizes, and their first and last 16 MiB.

    Reads at most 32 MiB per file, so a 7B teacher is fingerprinted in a second; two trainings
    of one architecture differ in every byte, so they never share a fingerprint.
    """
    files = _weight_files(path)
    if not files:
        raise CaptureError(f"no weight files (*.safetensors / *.bin) found for teacher {path}")
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(_FINGERPRINT_BYTES))
            if size > 2 * _FINGERPRINT_BYTES:
                fh.seek(-_FINGERPRINT_BYTES, os.SEEK_END)
                h.update(fh.read())
    return h.hexdigest()[:16]


def _weight_files(path: str | os.PathLike) -> list[Path]:
    p = Path(path)
    if not p.is_dir():  # a Hub id: its snapshot in the local cache
        from huggingface_hub import snapshot_download

        try:
            p = Path(snapshot_download(str(path), local_files_only=True))
        except Exception:  # not cached: nothing to fingerprint
            return []
    return sorted([*p.glob("*.safetensors"), *p.glob("*.bin")])


def tokenizer_hash(tokenizer: Any) -> str:
    """A hash of a tokenizer's vocabulary and class."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), separators=(",", ":"))
    return hashlib.sha256(f"{type(tokenizer).__name__}:{vocab}".encode()).hexdigest()[:16]


def update_token_hash(h: Any, ids: Tensor) -> None:
    """Add a batch of teacher input ids to the running hash `h` (hashlib): `[B, T]` right-padded,
    padding set to -1 by the caller; batches are fed in record order, 256 records each."""
    h.update(ids.to(torch.int64).numpy().tobytes())


# ----------------------------------------------------------------------------- writing


def mapped_layers(M: Tensor) -> dict[str, Any]:
    """The `capture_layers` setting of `capture_layers: mapped`: the teacher layers (columns) that
    the layer map `M [L_s, L_t]` reads, as `kept`, and the teacher's layer count L_t."""
    return {"kept": (M != 0).any(0).nonzero().flatten().tolist(), "teacher_layers": M.shape[1]}


def compress_rationale(kv: KVCache, keep: float, method: Compression = "uniform", lam: float = 0.1,
                       generator: torch.Generator | None = None) -> KVCache:
    """`capture_keep`: keep `ceil(keep * n)` of each sample's `n` rationale (REASONING) positions.

    The prompt and answer stay whole; the kept positions are chosen by `align.compress.compress_cache`
    (`uniform`: evenly spaced; `rkv`: attention importance minus redundancy, the answer keys as
    queries; `random`) and packed left in time order, right-padded, as the cache stores records.
    Segment time alignment then maps the student's rationale onto the kept positions.
    """
    n = (kv.attention_mask.bool() & (kv.segment_ids == REASONING)).sum(1)  # [B]
    slots = torch.ceil(n * keep).long()  # [B]; >= 1 wherever the sample has a rationale
    return compress_cache(kv, slots, method=method, lam=lam, generator=generator)[0]


def write_shard(path: Path, entries: list[tuple[int, dict[str, Tensor]]], dtype: torch.dtype,
                layers: list[int] | None = None, header: Mapping[str, Any] | None = None) -> None:
    """Write `(record id, TeacherCache entry)` pairs as one shard (temp file, then rename); with
    `layers`, keys and values keep only those teacher layers; `header` goes into its metadata (as strings)."""
    lengths = [e["segment_ids"].shape[0] for _, e in entries]
    tensors = {
        "index": torch.tensor([i for i, _ in entries], dtype=torch.int64),  # [n]
        "offsets": torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0),  # [n + 1]
        "segment_ids": torch.cat([e["segment_ids"] for _, e in entries]).to(torch.int8),  # [sum T]
    }
    for field in _FLOAT_FIELDS:
        if field in entries[0][1]:
            x = torch.cat([e[field] for _, e in entries])  # [sum T, ...]
            if layers is not None and field in _KV_FIELDS:
                x = x[:, layers]  # [sum T, L_kept, H, D]
            tensors[field] = x.to(dtype).contiguous()
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, nbytes(tensors), scratch=tmp):  # a full disk: no temp left, one error naming the shard
        save_file(tensors, str(tmp), metadata={k: str(v) for k, v in (header or {}).items()})
        os.replace(tmp, path)


def shard_name(start: int) -> str:
    """A shard is named by its first record: shards never overlap, so names never clash."""
    return f"shard-{start:05d}.safetensors"


def plan_shards(done: list[dict], n_records: int, batch_size: int, processes: int, max_records: int) -> list[dict]:
    """The shards `[{name, start, stop}]` that cover records `[0, n_records)`, in order.

    The shards of `done` (headers read back from disk) keep their place where they do not overlap one
    kept before; the gaps between them are cut into shards of whole batches counted from the gap's start
    (so a batch holds the records a one-process capture batches together), at most `max_records` each,
    and at least `processes` of them where the gaps hold that many batches, so every process has work.
    """
    kept, end = [], 0
    for s in sorted(done, key=lambda s: s["start"]):
        if s["start"] >= end and s["stop"] <= n_records:
            kept.append(s)
            end = s["stop"]
    gaps, at = [], 0
    for s in [*kept, {"start": n_records, "stop": n_records}]:
        if s["start"] > at:
            gaps.append((at, s["start"]))
        at = s["stop"]
    batches = sum(math.ceil((b - a) / batch_size) for a, b in gaps)
    per = batch_size * max(1, min(max_records // batch_size, math.ceil(batches / processes)))  # records per shard
    new = [{"name": shard_name(a), "start": a, "stop": min(a + per, b)} for lo, b in gaps for a in range(lo, b, per)]
    return sorted([*kept, *new], key=lambda s: s["start"])


def rank_shards(plan: list[dict], rank: int, processes: int) -> list[dict]:
    """The shards of `plan` that process `rank` writes: a contiguous run of the ones not yet done."""
    todo = [s for s in plan if "tokens" not in s]  # done shards carry their header's counts
    return todo[rank * len(todo) // processes : (rank + 1) * len(todo) // processes]


class CaptureWriter:
    """One teacher's capture directory: its plan, the shards of this process, the final manifest.

    Under several processes the main one calls `plan` and `finish`, each process `rank_shards` of the
    plan and `add` for each of them; the caller puts a barrier between the three steps.
    """

    def __init__(self, root: Path, settings: Mapping[str, Any]):
        self.root = root
        self.settings = dict(settings)
        self.fingerprint = hashlib.sha256(json.dumps(self.settings, sort_keys=True).encode()).hexdigest()[:16]
        root.mkdir(parents=True, exist_ok=True)

    def plan(self, n_records: int, batch_size: int, processes: int, max_records: int, teacher_dtype: str) -> None:
        """(Main process) check the directory, plan the shards around those present, and write the plan as the
        manifest (`complete: false`); `teacher_dtype` (fp32/bf16/fp16) is what a reader casts back to."""
        old = read_json(self.root / MANIFEST, None)
        if old is not None and old["settings"] != self.settings:
            raise CaptureError(f"{self.root} holds a capture with other settings ({_diff(old['settings'], self.settings)} "
                               "differ); delete it or set another teacher_capture")
        if old is not None and old.get("format") != FORMAT:
            raise CaptureError(f"{self.root} holds a format-1 capture (one process, made by an older kvdistill); "
                               "training reads it as it is; delete it to capture again")
        done = [h for p in sorted(self.root.glob("shard-*.safetensors")) if (h := self.header(p)) is not None]
        shards = plan_shards(done, n_records, batch_size, processes, max_records)
        self._write({"format": FORMAT, "settings": self.settings, "n_records": n_records,
                     "teacher_dtype": teacher_dtype, "complete": False, "shards": shards})

    def shards(self) -> list[dict]:
        """The plan's shards (`plan` wrote them): each `{name, start, stop}`, with `tokens`, `positions` once done."""
        return read_json(self.root / MANIFEST)["shards"]

    def add(self, shard: Mapping[str, Any], entries: list[tuple[int, dict[str, Tensor]]], tokens: int) -> None:
        """Write one planned shard: the entries of its records in order, `tokens` teacher input tokens."""
        layers = self.settings.get("capture_layers")
        header = {"format": FORMAT, "settings": self.fingerprint, "start": shard["start"], "stop": shard["stop"],
                  "tokens": tokens, "positions": sum(e["segment_ids"].shape[0] for _, e in entries)}
        write_shard(self.root / shard["name"], entries, CAPTURE_DTYPES[self.settings["capture_dtype"]],
                    None if layers is None else layers["kept"], header)

    def header(self, path: Path) -> dict | None:
        """`{name, start, stop, tokens, positions}` of a shard of this capture on disk; None when it is absent,
        does not read back (cut short: never trusted), or was written with other settings."""
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
        except (SafetensorError, OSError):
            return None
        if meta.get("settings") != self.fingerprint:
            return None
        return {"name": path.name, **{k: int(meta[k]) for k in ("start", "stop", "tokens", "positions")}}

    def finish(self) -> dict:
        """(Main process, after every process's `add`) check that every planned shard is on disk and mark the
        capture complete; returns the manifest."""
        plan = read_json(self.root / MANIFEST)
        shards = []
        for s in plan["shards"]:
            h = self.header(self.root / s["name"])
            if h is None or (h["start"], h["stop"]) != (s["start"], s["stop"]):
                raise CaptureError(f"capture shard {self.root / s['name']} (records {s['start']}-{s['stop']}) is "
                                   "missing after every process finished; rerun the same `kvdistill capture`")
            shards.append(h)
        manifest = {**plan, "complete": True, "shards": shards, "tokens": sum(s["tokens"] for s in shards),
                    "positions": sum(s["positions"] for s in shards)}
        self._write(manifest)
        return manifest

    def _write(self, manifest: dict) -> None:
        write_json_atomic(self.root / MANIFEST, manifest)


# ----------------------------------------------------------------------------- reading


def read_manifest(root: Path, settings: Mapping[str, Any]) -> dict:
    """The manifest of a complete capture made with `settings`, else a `CaptureError` naming why."""
    try:
        manifest = read_json(root / MANIFEST, None)
    except (ValueError, OSError) as err:  # cut short by a full disk or a bad copy
        raise CaptureError(f"{root / MANIFEST} cannot be read ({type(err).__name__}: {err}); capture again into an "
                           "empty teacher_capture directory") from None
    if manifest is None:
        raise CaptureError(f"no capture at {root} ({MANIFEST} missing); run `kvdistill capture` with this "
                           "run's config first")
    if not manifest.get("complete"):
        raise CaptureError(f"capture {root} is incomplete; rerun `kvdistill capture` with the same config (on any "
                           "number of processes) to finish it")
    if settings.get("queries") and not manifest["settings"].get("queries"):
        raise CaptureError(f"capture {root} holds no queries (made for another kv_loss), and kv_loss attention "
                           "reads them; capture again with this run's config")
    held, read = manifest["settings"].get("logits"), settings.get("logits")
    if held != read and "final_hidden" in (held, read):
        forms = {"final_hidden": "final hidden states [T, d] (a chunked head)", True: "logits [T, V]", False: "no logits"}
        raise CaptureError(f"capture {root} holds {forms[held]} and this run reads {forms[read]} (logit_chunk_tokens "
                           "decides); capture again with this run's config")
    if manifest["settings"] != dict(settings):
        raise CaptureError(f"capture {root} does not match this run: {_diff(manifest['settings'], settings)} "
                           "differ; capture again for this run (or fix the run's config)")
    return manifest


class CaptureReader(Mapping[int, dict[str, Tensor]]):
    """A complete capture made with `settings`, as `{record id: TeacherCache entry}`, read when asked.

    Opening it reads the manifest only (format 2: the shards' record ranges; format 1: each shard's `index`).
    An entry is read from its shard through safetensors' memory map, only its record's rows of each tensor,
    and cast back to the teacher's own dtype, so training sees what a live teacher would have given (rounded
    to the stored dtype); a `capture_layers: mapped` capture's kept layers go back to their indices
    (`unmap_layers`). Nothing is kept but each opened shard's offsets: a process reads the shards of the
    records it is given and no other, and holds one batch of entries at a time (`TeacherCache.read_from`).
    """

    def __init__(self, root: Path, settings: Mapping[str, Any]):
        self.root = Path(root)
        manifest = read_manifest(self.root, settings)
        self._live = CAPTURE_DTYPES[manifest["teacher_dtype"]]
        self._layers = manifest["settings"].get("capture_layers")
        shards = manifest["shards"] if manifest.get("format") == FORMAT else [self._span(n) for n in manifest["shards"]]
        self._names = [s["name"] for s in shards]
        self._starts = [s["start"] for s in shards]  # record ids of a shard: [start, stop), in order
        self._offsets: dict[int, list[int]] = {}  # shard -> where each of its records starts, read on first use
        self._n = manifest["n_records"]
        if [0, *(s["stop"] for s in shards)] != [*self._starts, self._n]:  # each shard starts where one stops
            raise CaptureError(f"capture {self.root}: its shards do not hold records 0-{self._n} once each, as its "
                               "manifest says; capture again")

    def __len__(self) -> int:
        return self._n

    def __iter__(self):
        return iter(range(self._n))

    def __contains__(self, i: object) -> bool:  # without reading the entry (Mapping's default would)
        return isinstance(i, int) and 0 <= i < self._n

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        if i not in self:
            raise KeyError(i)
        k = bisect.bisect_right(self._starts, i) - 1
        path = self.root / self._names[k]
        try:
            with safe_open(str(path), framework="pt") as f:
                if k not in self._offsets:
                    self._offsets[k] = self._check(path, f, k)
                a, b = self._offsets[k][i - self._starts[k]], self._offsets[k][i - self._starts[k] + 1]
                entry = {"segment_ids": f.get_slice("segment_ids")[a:b].long()}  # [T_i]
                for field in (x for x in _FLOAT_FIELDS if x in f.keys()):  # noqa: SIM118 (safe_open is not iterable)
                    x = f.get_slice(field)[a:b]  # [T_i, ...]
                    if self._layers is not None and field in _KV_FIELDS:
                        x = unmap_layers(x, self._layers)  # [T_i, L, H, D]
                    entry[field] = x.to(self._live)
        except (SafetensorError, OSError) as err:  # truncated or missing shard
            raise CaptureError(f"capture shard {path} cannot be read ({type(err).__name__}: {err}); capture "
                               "again into an empty teacher_capture directory") from None
        return entry

    def _check(self, path: Path, f: Any, k: int) -> list[int]:
        """Shard `k`'s record offsets `[n + 1]`, after checking it holds the records the manifest says."""
        index = f.get_tensor("index")  # [n]
        stop = self._starts[k + 1] if k + 1 < len(self._starts) else self._n
        if not torch.equal(index, torch.arange(self._starts[k], stop)):
            raise CaptureError(f"capture shard {path} does not hold records {self._starts[k]}-{stop}, as the manifest "
                               "says; capture again")
        return f.get_tensor("offsets").tolist()

    def _span(self, name: str) -> dict:
        """A format-1 shard's record range, from its `index`."""
        try:
            with safe_open(str(self.root / name), framework="pt") as f:
                index = f.get_tensor("index")  # [n]
        except (SafetensorError, OSError) as err:
            raise CaptureError(f"capture shard {self.root / name} cannot be read ({type(err).__name__}: {err}); "
                               "capture again into an empty teacher_capture directory") from None
        return {"name": name, "start": int(index[0]), "stop": int(index[-1]) + 1}


def unmap_layers(x: Tensor, layers: Mapping[str, Any]) -> Tensor:
    """Keys or values of the kept layers `[T, L_kept, H, D]` at their indices of `[T, L, H, D]`, zeros
    at the other layers: the layer map's weight there is 0, so the aligner never reads them."""
    full = x.new_zeros(x.shape[0], layers["teacher_layers"], *x.shape[2:])  # [T, L, H, D]
    full[:, layers["kept"]] = x
    return full


def _diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    return ", ".join(sorted(k for k in {*a, *b} if a.get(k) != b.get(k)))
