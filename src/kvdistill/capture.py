"""Offline teacher-KV capture: a teacher's cache over a run's records, stored once, read by training.

Layout of a capture directory (one per run config, `teacher_capture: DIR`)::

    DIR/<teacher name>/manifest.json          settings, fingerprints, shard list, complete flag
    DIR/<teacher name>/shard-00000.safetensors

A shard holds the records of consecutive batches, time-major and unpadded, concatenated over
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
Shards are written to a temp name and renamed; the manifest is rewritten after every shard and says
`complete: true` only after the last, so a killed capture is resumed shard by shard and an
incomplete one is never used.

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

import hashlib
import json
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
from kvdistill.teachers import TeacherCache

MANIFEST = "manifest.json"
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
                layers: list[int] | None = None) -> None:
    """Write `(record id, TeacherCache entry)` pairs as one shard (temp file, then rename); with
    `layers`, keys and values keep only those teacher layers."""
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
        save_file(tensors, str(tmp))
        os.replace(tmp, path)


class CaptureWriter:
    """Shards and manifest of one teacher's capture; resumes a partial capture with equal settings."""

    def __init__(self, root: Path, settings: Mapping[str, Any]):
        self.root = root
        self.settings = dict(settings)
        root.mkdir(parents=True, exist_ok=True)
        old = read_json(root / MANIFEST, None)
        if old is not None and old["settings"] != self.settings:
            raise CaptureError(f"{root} holds a capture with other settings ({_diff(old['settings'], self.settings)} "
                               "differ); delete it or set another teacher_capture")
        self.shards: list[str] = [] if old is None else list(old["shards"])

    def done(self, k: int) -> bool:
        """Shard `k` was written by an earlier (killed) run with the same settings."""
        return k < len(self.shards) and (self.root / self.shards[k]).exists()

    def add(self, k: int, entries: list[tuple[int, dict[str, Tensor]]]) -> None:
        name = f"shard-{k:05d}.safetensors"
        layers = self.settings.get("capture_layers")
        write_shard(self.root / name, entries, CAPTURE_DTYPES[self.settings["capture_dtype"]],
                    None if layers is None else layers["kept"])
        self.shards = [*self.shards[:k], name]
        self._write_manifest(complete=False)

    def positions(self) -> int:
        """Time positions stored over all shards written so far."""
        total = 0
        for name in self.shards:
            with safe_open(str(self.root / name), framework="pt") as f:
                total += f.get_slice("segment_ids").get_shape()[0]
        return total

    def finish(self, n_records: int, teacher_dtype: str) -> None:
        """Mark the capture complete; `teacher_dtype` (fp32/bf16/fp16) is what a reader casts back to."""
        self._write_manifest(complete=True, n_records=n_records, teacher_dtype=teacher_dtype)

    def _write_manifest(self, complete: bool, **extra: Any) -> None:
        write_json_atomic(self.root / MANIFEST, {"settings": self.settings, "shards": self.shards,
                                                  "complete": complete, **extra})


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
        raise CaptureError(f"capture {root} is incomplete ({len(manifest['shards'])} shards written); rerun "
                           "`kvdistill capture` with the same config to finish it")
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


def load_capture(root: Path, settings: Mapping[str, Any], cache: TeacherCache, key: tuple) -> int:
    """Fill `cache` under `key` with every record of the capture at `root`; returns the record count.

    Tensors are read through safetensors' memory map and cast back to the teacher's own dtype,
    so the training code sees what a live teacher would have given (rounded to the stored dtype).
    A `capture_layers: mapped` capture's kept layers go back to their indices (`unmap_layers`).
    """
    manifest = read_manifest(root, settings)
    live = CAPTURE_DTYPES[manifest["teacher_dtype"]]
    layers = manifest["settings"].get("capture_layers")
    n = 0
    for name in manifest["shards"]:
        try:
            with safe_open(str(root / name), framework="pt") as f:
                t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        except (SafetensorError, OSError) as err:  # truncated or missing shard
            raise CaptureError(f"capture shard {root / name} cannot be read ({type(err).__name__}: {err}); capture "
                               "again into an empty teacher_capture directory") from None
        for f in _KV_FIELDS if layers is not None else ():
            if f in t:  # queries only in a kv_loss attention capture
                t[f] = unmap_layers(t[f], layers)  # [sum T, L, H, D]
        starts = t["offsets"].tolist()
        for j, i in enumerate(t["index"].tolist()):
            a, b = starts[j], starts[j + 1]
            entry = {"segment_ids": t["segment_ids"][a:b].long()}
            entry.update({f: t[f][a:b].to(live) for f in _FLOAT_FIELDS if f in t})
            cache.add(key, i, entry)
            n += 1
    if n != manifest["n_records"]:
        raise CaptureError(f"capture {root} holds {n} records, its manifest says {manifest['n_records']}; "
                           "capture again")
    return n


def unmap_layers(x: Tensor, layers: Mapping[str, Any]) -> Tensor:
    """Keys or values of the kept layers `[T, L_kept, H, D]` at their indices of `[T, L, H, D]`, zeros
    at the other layers: the layer map's weight there is 0, so the aligner never reads them."""
    full = x.new_zeros(x.shape[0], layers["teacher_layers"], *x.shape[2:])  # [T, L, H, D]
    full[:, layers["kept"]] = x
    return full


def _diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    return ", ".join(sorted(k for k in {*a, *b} if a.get(k) != b.get(k)))
