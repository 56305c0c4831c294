"""Teachers: loaded once, frozen, run under no_grad, optionally kept on CPU between forwards."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from kvdistill.cache import PAD, KeySpace, KVCache, forward_with_kv
from kvdistill.config import ConfigError
from kvdistill.losses import vocab_intersection
from kvdistill.models import config_hash, load_model, load_tokenizer, model_dir, untrained_copy

logger = logging.getLogger(__name__)


def same_tokenizer(a: Any, b: Any) -> bool:
    """True when two tokenizers split text identically (same vocab, same ids on a probe text)."""
    if a is b:
        return True
    probe = "Question: Tom has 12 apples.\nAnswer: 12 + 5 = 17.\n#### 17"
    return a.get_vocab() == b.get_vocab() and a(probe)["input_ids"] == b(probe)["input_ids"]


@dataclass
class Teacher:
    """A frozen teacher model with its tokenizer and provenance."""

    name: str
    path: str
    model: nn.Module
    tokenizer: Any
    weight: float = 1.0
    shares_student_tokens: bool = False  # same tokenizer and text as the student: reuse its input_ids
    same_text: bool = True  # reads the student's very text (no own rationale, no rewrite): positions pair by characters
    logit_kd: str = "off"  # how its logits teach the student (`resolve_logit_kd`): same_vocab | cross_vocab | off
    # the run's head losses are chunked: its logit KD reads its final hidden states through its head (never the
    # [B, T, V] logits); `head` holds that head's (weight [V, d], bias) when the model has no weights (a capture)
    head_hidden: bool = False
    head: tuple[Tensor, Tensor | None] | None = None

    @property
    def config_hash(self) -> str:
        return config_hash(self.model)

    def manifest(self) -> dict:
        return {"name": self.name, "path": self.path, "config_hash": self.config_hash, "weight": self.weight}


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode, no gradients: a teacher never enters the optimizer or the autograd graph."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_teacher(spec: Any, student_tokenizer: Any, *, untrained: bool = False, seed: int = 0,
                 weights: bool = True) -> Teacher:
    """Load a teacher from a `TeacherConfig`-like spec (path, name, dtype, quantization, tokenizer...).

    A spec that holds a loaded `model` (and tokenizer object) is taken as it is (the Python API); the rest
    follows the same way. `untrained=True` replaces the weights by a random init of the same architecture:
    the control that tells a distillation gain apart from mere regularisation. `weights=False` builds the
    architecture on the meta device (no memory): a teacher whose outputs come from a capture.
    """
    if getattr(spec, "model", None) is not None:
        model = spec.model
    elif not weights:
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

        config = AutoConfig.from_pretrained(model_dir(spec.path))
        with torch.device("meta"):
            # the class itself, not `from_config`: under ZeRO-3 that partitions (`zero.Init`) and initialises
            # the weights, which a meta model has none of
            model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
        untrained = False
    else:
        model = load_model(spec.path, dtype=spec.dtype, quantization=spec.quantization)
    if untrained:
        model = untrained_copy(model, str(spec.name), seed)
    if spec.tokenizer == "student":
        tokenizer = student_tokenizer
    elif spec.tokenizer is not None and not isinstance(spec.tokenizer, str):  # a loaded tokenizer
        tokenizer = spec.tokenizer
    else:
        tokenizer = load_tokenizer(spec.tokenizer or spec.path)
    # its own rationale or prompt: its tokens are not the student's even in the same tokenizer
    shares = spec.rationale_field is None and spec.template is None and same_tokenizer(tokenizer, student_tokenizer)
    return Teacher(spec.name, str(spec.path), freeze(model), tokenizer, spec.weight, shares)


class TeacherCache:
    """Each training record's teacher outputs, kept in CPU memory: a teacher runs once per record.

    Teachers are frozen and deterministic (eval mode), and the collator tokenizes a record the same
    way every epoch, so a record's teacher KV never changes. With many epochs over a small labelled
    set (distillation with few labels) the cache removes the teacher forward from every epoch but
    the first. Records are stored unpadded, time-major (`[T_i, L, H, D]`), and a batch is padded on
    the right to its longest record, as the collator pads it; values equal the live forward up to
    float rounding of the batch it was first computed in. Memory: records × (keys + values
    [+ hidden states, logits `[T_i, V]` or, for a chunked head, final hidden states `[T_i, d]`]) of
    one record, e.g. 500 records × 3 layers × 48 × 55 tokens × 8 bytes ≈ 32 MB for K and V in fp32.
    """

    def __init__(self):
        self._store: dict[tuple, dict[str, Tensor]] = {}  # (*key, record id) -> entry
        self._read: dict[tuple, Mapping[int, dict[str, Tensor]]] = {}  # key -> a capture's entries, read when asked

    def __len__(self) -> int:
        return len(self._store) + sum(len(r) for r in self._read.values())

    def read_from(self, key: tuple, entries: Mapping[int, dict[str, Tensor]]) -> None:
        """Serve `key`'s records from `entries` (`{record id: entry}`, a `capture.CaptureReader`): each batch
        reads its own records, and they are not kept, so a process reads only what its batches hold (under DDP,
        its share of the records) and the memory of one batch, whatever the capture's size."""
        self._read[key] = entries

    def missing(self, key: tuple, index: Tensor) -> list[int]:
        """The record ids of `index` with no entry under `key`."""
        read = self._read.get(key, {})
        return [int(i) for i in index if (*key, int(i)) not in self._store and int(i) not in read]

    def has(self, key: tuple, index: Tensor) -> bool:
        return not self.missing(key, index)

    def take(self, key: tuple, index: int) -> dict[str, Tensor]:
        """Remove and return one record's entry (a capture writes it out and keeps no copy)."""
        return self._store.pop((*key, index))

    def add(self, key: tuple, index: int, entry: dict[str, Tensor]) -> None:
        """Store one record's entry as `put` makes it (unpadded, time-major: `keys [T_i, L, H, D]`,
        `segment_ids [T_i]`, ...): a capture read back from disk fills the cache as a live teacher does."""
        self._store[(*key, index)] = entry

    def put(self, key: tuple, index: Tensor, kv: KVCache, logits: Tensor | None, field: str = "logits") -> None:
        """Store each record of a batch; `logits` `[B, T, V]`, or (`field="final_hidden"`) the final hidden
        states `[B, T, d]` a chunked head reads."""
        lengths = kv.attention_mask.sum(1).tolist()  # right padding: the first n tokens are real
        for b, (i, n) in enumerate(zip(index.tolist(), lengths)):
            n = int(n)
            entry = {
                "keys": kv.keys[:, b, :, :n].permute(2, 0, 1, 3).cpu(),  # [T_i, L, H, D]
                "values": kv.values[:, b, :, :n].permute(2, 0, 1, 3).cpu(),
                "segment_ids": kv.segment_ids[b, :n].cpu(),  # [T_i]
            }
            if kv.hidden_states is not None:
                entry["hidden_states"] = kv.hidden_states[:, b, :n].transpose(0, 1).cpu()  # [T_i, L+1, d]
            if kv.queries is not None:
                entry["queries"] = kv.queries[:, b, :, :n].permute(2, 0, 1, 3).cpu()  # [T_i, L, H_q, D]
            if logits is not None:
                entry[field] = logits[b, :n].cpu()  # [T_i, V] logits or [T_i, d] final hidden states
            self.add(key, int(i), entry)

    def get(self, key: tuple, index: Tensor, device: torch.device) -> tuple[KVCache, Tensor | None]:
        """The batch of records `index [B]`, right-padded: KV `[L, B, H, T, D]`, logits `[B, T, V]` (or the
        final hidden states `[B, T, d]` stored in their place)."""
        from torch.nn.utils.rnn import pad_sequence

        entries = [self._store.get((*key, int(i))) or self._read[key][int(i)] for i in index]

        def stack(field: str, pad: float = 0.0) -> Tensor:
            return pad_sequence([e[field] for e in entries], batch_first=True, padding_value=pad).to(device)

        keys, values = stack("keys").permute(2, 0, 3, 1, 4), stack("values").permute(2, 0, 3, 1, 4)  # [L, B, H, T, D]
        seg = stack("segment_ids", PAD)  # [B, T]
        hidden = stack("hidden_states").permute(2, 0, 1, 3) if "hidden_states" in entries[0] else None
        field = next((f for f in ("logits", "final_hidden") if f in entries[0]), None)
        logits = None if field is None else stack(field)
        queries = stack("queries").permute(2, 0, 3, 1, 4) if "queries" in entries[0] else None  # [L, B, H_q, T, D]
        kv = KVCache(keys, values, (seg != PAD).long(), seg, hidden, queries)
        return kv, logits


def teacher_deepspeed_config(ds_config: dict) -> dict:
    """The DeepSpeed config of a frozen teacher's inference engine, from the run's (student's) config.

    ZeRO-3 keeps the run's partitioning: a teacher's weights are sharded too and gathered layer by
    layer in its forward. ZeRO-1/2 shard only optimizer state and gradients, which a teacher has
    none of, so it gets stage 0: a plain copy per rank. The batch sizes are nominal (an inference
    engine never steps) and `train_batch_size` is left out: DeepSpeed derives it as micro-batch x
    accumulation x world size, where a fixed 1 fails its batch check on 2+ processes. "auto" values
    are dropped: the Trainer fills them in the student's config only.
    """
    zero = {k: v for k, v in ds_config.get("zero_optimization", {}).items() if v != "auto"}
    if zero.get("stage") != 3:
        zero["stage"] = 0
    config = {"zero_optimization": zero, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    config.update({k: ds_config[k] for k in ("bf16", "fp16") if k in ds_config})
    return config


class TeacherSet:
    """The teachers of a run, placed on the device (or offloaded to CPU between forwards).

    Under DDP and FSDP the teachers are *not* wrapped: they are not submodules of the model the
    Trainer shards, so each rank holds a full frozen copy (eval mode, no gradients) on its device
    (a teacher left on CPU under FSDP is a known TRL bug). Replicated, not sharded: a teacher has no
    gradients or optimizer state to shard, only weights, and sharding them would cost an all-gather
    per teacher forward. Under DeepSpeed the Trainer calls `prepare_deepspeed` (ZeRO-3 partitions
    the teachers like the student).
    """

    def __init__(self, teachers: list[Teacher], device: torch.device | str, offload: bool = False,
                 cache: bool = False):
        self.teachers = {t.name: t for t in teachers}
        self.device = torch.device(device)
        self.offload = offload
        self.cache = TeacherCache() if cache else None
        for t in teachers:
            if not _is_quantized(t.model) and not is_captured(t):
                t.model.to("cpu" if offload else self.device)

    def __iter__(self):
        return iter(self.teachers.values())

    def __len__(self) -> int:
        return len(self.teachers)

    @property
    def names(self) -> list[str]:
        return list(self.teachers)

    def prepare_deepspeed(self, accelerator: Any) -> None:
        """Wrap each teacher in a DeepSpeed inference engine with the run's ZeRO config; a captured
        teacher (no weights, never run) stays as it is."""
        import deepspeed  # only reached under DeepSpeed

        config = teacher_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config)
        for t in self:
            if is_captured(t):
                continue
            engine, *_ = deepspeed.initialize(model=t.model, config=config)
            t.model = engine.module
            t.model.eval()

    @torch.no_grad()
    def forward(
        self,
        name: str,
        input_ids: Tensor,
        attention_mask: Tensor,
        segment_ids: Tensor | None,
        *,
        key_space: KeySpace = "post_rope",
        output_hidden_states: bool = False,
        return_logits: bool = False,
        queries: bool = False,
        index: Tensor | None = None,
    ) -> tuple[KVCache, Any]:
        """One teacher's detached KV (and logits when asked) on a batch.

        A teacher with `head_hidden` (the run's head losses are chunked) gives, for its logits, its final
        hidden states and head: `(hidden [B, T, d], weight [V, d], bias)`, a `losses.chunked.TeacherHead`;
        its forward makes no `[B, T, V]` logits, and the cache keeps `[T_i, d]` per record instead of `[T_i, V]`.
        With the cache on and the records' ids `index [B]` given, records seen before are read from
        memory; a batch with any new record runs the teacher and stores every record of it.
        """
        head = return_logits and self.teachers[name].head_hidden
        key = self.cache_key(name, key_space, output_hidden_states, return_logits, queries)
        if self.cache is not None and index is not None and self.cache.has(key, index):
            kv, logits = self.cache.get(key, index, input_ids.device)
        elif self.cache is not None and index is not None:
            if is_captured(self.teachers[name]):
                missing = self.cache.missing(key, index)
                raise ConfigError(f"teacher {name} is read from a capture that lacks records {missing[:5]} (or was "
                                  "made without hidden states / logits / queries this run needs); capture again with this "
                                  "run's config")
            kv, logits = self._forward(name, input_ids, attention_mask, segment_ids, key_space,
                                       output_hidden_states, return_logits, queries)
            self.cache.put(key, index, kv, logits, "final_hidden" if head else "logits")
        else:
            kv, logits = self._forward(name, input_ids, attention_mask, segment_ids, key_space, output_hidden_states,
                                       return_logits, queries)
        return kv, (self._with_head(name, logits) if head else logits)

    def _with_head(self, name: str, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """`(hidden [B, T, d], weight [V, d], bias [V] | None)`: the head of the live model, or a captured one's."""
        t = self.teachers[name]
        lm = t.model.get_output_embeddings() if t.head is None else None
        weight, bias = t.head or (lm.weight, lm.bias)
        # an offloaded teacher's head is on the CPU between forwards (a copy per step); the loss reads it here
        return hidden, weight.to(hidden.device), None if bias is None else bias.to(hidden.device)

    @staticmethod
    def cache_key(name: str, key_space: KeySpace, output_hidden_states: bool, return_logits: bool,
                  queries: bool = False) -> tuple:
        """The `TeacherCache` key of one teacher's outputs of one kind (a capture fills the same key)."""
        return (name, key_space, output_hidden_states, return_logits, queries)

    def _forward(self, name, input_ids, attention_mask, segment_ids, key_space, output_hidden_states,
                 return_logits, queries=False) -> tuple[KVCache, Tensor | None]:
        t = self.teachers[name]
        if self.offload and not _is_quantized(t.model):
            t.model.to(self.device)
        head = return_logits and t.head_hidden  # the final hidden states, not the logits
        try:
            out, kv = forward_with_kv(
                t.model, input_ids, attention_mask, segment_ids, key_space=key_space,
                output_hidden_states=output_hidden_states or head, queries=queries,
                logits=return_logits and not head,  # not read: none, or the hidden states the head reads
            )
        finally:
            if self.offload and not _is_quantized(t.model):
                t.model.to("cpu")
        if head:  # [B, T, d] after the final norm: what the head reads
            final = out.hidden_states[-1].detach()
            return (kv if output_hidden_states else replace(kv, hidden_states=None)).detach(), final
        return kv.detach(), (out.logits.detach() if return_logits else None)

    def manifest(self) -> list[dict]:
        return [t.manifest() for t in self]


def derangement(n: int, generator: torch.Generator | None = None) -> Tensor:
    """A random permutation `[n]` with no fixed point (the shuffled-teacher control): `p[i] != i`.

    A random relabelling of a rotation by k in [1, n-1]: `sigma(p[j]) = p[(j + k) % n]`, which moves
    every element. Needs n >= 2.
    """
    if n < 2:
        raise ValueError(f"a derangement needs at least 2 elements, got {n}")
    p = torch.randperm(n, generator=generator)
    k = int(torch.randint(1, n, (1,), generator=generator))
    sigma = torch.empty_like(p)
    sigma[p] = p.roll(-k)  # [n]
    return sigma


def is_captured(teacher: Teacher) -> bool:
    """A teacher without weights (meta device): its outputs come from a capture."""
    return next(teacher.model.parameters()).is_meta


def _is_quantized(model: nn.Module) -> bool:
    return bool(getattr(model, "is_quantized", False) or getattr(model, "is_loaded_in_4bit", False))


LOGIT_KD_MODES = ("auto", "same_vocab", "cross_vocab", "off")


def resolve_logit_kd(mode: str, name: str, same_tokens: bool, same_text: bool) -> tuple[str, str]:
    """A teacher's logit-KD mode and why: `auto` is same_vocab when it reads the student's very tokens,
    cross_vocab when it reads the same text in other tokens, off when it reads another text (its own
    rationale, a permuted or shortened one): no position of it predicts what the student's does."""
    if mode == "off":
        return "off", "logit_kd: off"
    if not same_text:
        if mode != "auto":
            raise ConfigError(f"teacher {name}: logit_kd {mode} compares next-token distributions on the same text, "
                              "but this teacher reads another (its rationale_field, a permuted or shortened text); "
                              "set its logit_kd: off")
        return "off", "it reads another text than the student"
    if mode == "same_vocab" and not same_tokens:
        raise ConfigError(f"teacher {name}: logit_kd same_vocab needs the student's tokenizer, and this teacher's "
                          "differs; set its logit_kd: cross_vocab (or auto)")
    if mode == "auto":
        mode = "same_vocab" if same_tokens else "cross_vocab"
        return mode, "auto: " + ("the student's tokenizer" if same_tokens else "another tokenizer")
    return mode, f"logit_kd: {mode}"


_VOCAB_MAPS: dict[tuple[str, str], tuple[Tensor, Tensor]] = {}


def vocab_map(student_tokenizer: Any, teacher_tokenizer: Any) -> tuple[Tensor, Tensor]:
    """`(student_ids [K], teacher_ids [K])`: the tokens whose decoded strings are equal
    (`losses.vocab_intersection`), among ids below each tokenizer's real size (`len(tokenizer)`: embedding
    rows past it are padding). Decoding a 150k vocabulary takes seconds, so each pair of vocabularies is
    mapped once per process, keyed by both vocabularies' hashes."""
    key = (_vocab_hash(student_tokenizer), _vocab_hash(teacher_tokenizer))
    if key not in _VOCAB_MAPS:
        _VOCAB_MAPS[key] = vocab_intersection(_decoded(student_tokenizer), _decoded(teacher_tokenizer))
    return _VOCAB_MAPS[key]


def _vocab_hash(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(f"{type(tokenizer).__name__}:{vocab}".encode()).hexdigest()[:16]


def _decoded(tokenizer: Any) -> list[str]:
    """Every id's text as the tokenizer decodes it alone (`[len(tokenizer)]`)."""
    return tokenizer.batch_decode([[i] for i in range(len(tokenizer))], clean_up_tokenization_spaces=False)
