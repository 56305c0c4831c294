"""Teacher controls that keep the target's statistics and remove (or fix) its meaning.

A gain from teacher KV counts as knowledge transfer only if it beats targets that share everything
with the real one except the knowledge. Beside the `untrained` and `shuffled` teachers (trainer),
this module builds two more from plain tensors and strings:

- the **oracle** target (`oracle_cache`): the relation target the problem's known structure
  implies. A task writes a per-token class field (`fields.py`, e.g. the chain id of every variable
  name); tokens of one class relate, others do not. The oracle is a synthetic cache whose keys
  and values are scaled one-hot class codes, so its self-relations `softmax(X Xᵀ / sqrt(d) / τ)`
  are a block matrix: each row uniform over the valid tokens of its class (off-class weight
  exp(-margin) ≈ 1e-13). With `code="fourier"` the field holds numbers `0..p-1` instead and the code
  puts each on the unit circle (`cos, sin` of `2πv/p`): the Gram is `cos(2π(a-b)/p)`, a function of
  `(a - b) mod p` only, the number layout a grokked modular-addition network learns (Nanda et al.
  2023), so a row weighs equal numbers most, then their neighbours mod p. It enters the run as a
  teacher cache, so it goes through the same time alignment, layer map and relation loss as a real
  teacher: the positive control of that channel.
- the **permuted** input (`TextPermutation`): the teacher reads each record with its numbers or
  names mapped through one seeded bijection, at the text level before it tokenizes (token and
  value statistics kept, the problem's meaning destroyed: `3 + 4 = 7` may read `5 + 0 = 2`). The
  student reads the original text. Spans of per-token fields move with the rewritten text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvdistill import fields as token_fields
from kvdistill.cache import KVCache
from kvdistill.data import DataError

PERMUTE_KINDS = ("numbers", "names")
# renaming variables keeps a program's meaning, so that permuted teacher should *equal* the right one (an
# invariance check); relabelling numbers destroys it (a control a signal must beat)
MEANING_KEPT = ("names",)
ORACLE_CODES = ("onehot", "fourier")  # same class relates | numbers 0..p-1 on a circle (p = the code width)
ORACLE_MARGIN = 30.0  # logit gap between same-class and other keys: off-class weight <= T * e^-30


# ----------------------------------------------------------------------------- oracle


def oracle_width(records: Iterable[Mapping[str, Any]], field: str) -> int:
    """Width of the oracle's class code: 1 + the largest class in `field` over `records`.

    Raises `DataError` (one line) when a record lacks the field or holds a negative class: its
    tokens would silently get no structure.
    """
    largest, n = -1, 0
    for i, r in enumerate(records):
        have = dict(token_fields.freeze(r.get(token_fields.FIELD_KEY) or {}))
        if field not in have:
            raise DataError(f"teacher_control: oracle reads the per-token field {field!r}, which record {i} lacks "
                            f"(it has {sorted(have)}); generate data with that field or set oracle_field")
        spans = have[field]
        values = [v for _, _, v in spans]
        if values and min(values) < 0:
            raise DataError(f"record {i}: oracle field {field!r} holds class {min(values)}; classes must be >= 0")
        largest, n = max([largest, *values]), n + 1
    if n == 0 or largest < 0:
        raise DataError(f"teacher_control: oracle found no class in field {field!r} of the data; nothing to build")
    return largest + 1


def oracle_code(classes: Tensor, width: int, code: str = "onehot") -> Tensor:
    """Unit codes `[B, T, C]` of `[B, T]` classes (`IGNORE` rows are zero): `onehot`, Gram 1 within a class
    and 0 across; `fourier`, class `v` of `C = p` at angle `2πv/p` in the first two dims, Gram `cos(2π(a-b)/p)`."""
    if code not in ORACLE_CODES:
        raise ValueError(f"oracle code must be one of {ORACLE_CODES}, got {code!r}")
    v = classes.clamp(min=0)
    if code == "onehot":
        unit = torch.nn.functional.one_hot(v, width).float()  # [B, T, C]
    else:  # zero-padded to the width, so both codes give the aligner the same dims
        angle = 2 * math.pi * v.float() / width  # [B, T]
        unit = torch.nn.functional.pad(torch.stack([angle.cos(), angle.sin()], -1), (0, width - 2))  # [B, T, C]
    return unit * (classes >= 0).unsqueeze(-1)


def oracle_cache(classes: Tensor, attention_mask: Tensor, segment_ids: Tensor | None, *, layers: int, heads: int,
                 width: int, temperature: float = 1.0, margin: float = ORACLE_MARGIN, code: str = "onehot") -> KVCache:
    """The oracle "teacher": a cache whose keys and values are scaled class codes (`oracle_code`).

    Every one of the `heads` heads holds the whole code, so each of `relation_heads = heads` relation
    chunks (`RelationKVLoss.split_heads`: `H*D` cut into R pieces of `D = width`) sees it. With code
    scale `s = sqrt(margin * sqrt(width) * temperature)` the relation logit `x_i·x_j / sqrt(d) / τ` is
    `margin` for two tokens of one class and 0 otherwise, so a row is uniform over its class's valid
    tokens. Tokens without a class (`IGNORE`) get the zero code: as keys they get weight ~e^-margin in
    every class row; their own rows are uniform over all valid tokens (no structure to learn there;
    row selection can leave them out). With `code="fourier"` the logit is `margin * cos(2π(a-b)/p)`.

    Args:
        classes: `[B, T]` long class per token (`IGNORE` = none), in the student's tokenization.
        attention_mask, segment_ids: `[B, T]` the student's, so time alignment maps the oracle 1:1.
        layers: teacher layers `L` (the layer map decides which student layers read them).
        heads: `R`, the run's relation_heads.
        width: code width `C` (`oracle_width`), fixed for a run (the aligner checks the dims); `p` for fourier.
        code: `onehot` or `fourier` (`ORACLE_CODES`).

    Returns:
        `KVCache` with keys = values `[L, B, R, T, C]` fp32.
    """
    if classes.numel() and int(classes.max()) >= width:
        raise DataError(f"oracle class {int(classes.max())} >= code width {width}: the data changed after the "
                        "width was computed")
    scale = math.sqrt(margin * math.sqrt(width) * temperature)
    x = oracle_code(classes, width, code) * scale  # [B, T, C]
    x = x[None, :, None].expand(layers, -1, heads, -1, -1).contiguous()  # [L, B, R, T, C]
    return KVCache(x, x, attention_mask, segment_ids)


# ----------------------------------------------------------------------------- permuted input


def parse_vocab(kind: str, vocab: Any) -> tuple[str, ...]:
    """The strings a permutation maps, from `permute_vocab`: for numbers a range `"lo..hi"` (inclusive)
    or a list of integers; for names a list of words. Raises `ValueError` naming the fix."""
    if kind not in PERMUTE_KINDS:
        raise ValueError(f"permute must be one of {PERMUTE_KINDS}, got {kind!r}")
    if kind == "numbers" and isinstance(vocab, str) and re.fullmatch(r"\s*\d+\s*\.\.\s*\d+\s*", vocab):
        lo, hi = (int(x) for x in vocab.split(".."))
        vocab = list(range(lo, hi + 1))
    if isinstance(vocab, str) or not isinstance(vocab, Sequence):
        example = "0..58" if kind == "numbers" else "[a, b, c, d]"
        raise ValueError(f"permute_vocab must list the {kind} to permute (e.g. {example}), got {vocab!r}")
    if kind == "numbers":
        if not all(re.fullmatch(r"\d+", str(v)) for v in vocab):
            raise ValueError(f"permute: numbers maps non-negative integers; permute_vocab holds {list(vocab)}")
        out = tuple(dict.fromkeys(str(int(v)) for v in vocab))
    else:
        if not all(isinstance(v, str) and re.fullmatch(r"\w+", v) for v in vocab):
            raise ValueError(f"permute: names maps whole words (letters, digits, _); permute_vocab holds {list(vocab)}")
        out = tuple(dict.fromkeys(vocab))
    if len(out) < 2:
        raise ValueError(f"permute_vocab needs at least 2 distinct {kind} to permute, got {list(vocab)}")
    return out


@dataclass(frozen=True)
class TextPermutation:
    """One fixed bijection of `vocab` onto itself, applied to whole numbers or whole words of a text.

    `numbers`: every maximal digit run whose integer value is in the vocab (`007` reads as 7) is
    replaced; numbers outside it are kept (the modulus `59` of `a + b mod 59` with vocab `0..58`), as
    are signs and decimal points (`-3.5` maps its 3 and its 5). `names`: every whole-word match of a
    vocab entry (also in ordinary prose: pick names that are not words of the template).
    """

    kind: str
    mapping: tuple[tuple[str, str], ...]  # (source, target), a bijection of the vocab

    @classmethod
    def seeded(cls, kind: str, vocab: Any, seed: int) -> TextPermutation:
        """The run's map: a seeded random cycle through the vocab (no string maps to itself)."""
        words = parse_vocab(kind, vocab)
        order = torch.randperm(len(words), generator=torch.Generator().manual_seed(seed)).tolist()
        return cls(kind, tuple((words[a], words[b]) for a, b in zip(order, order[1:] + order[:1])))

    @property
    def table(self) -> dict[str, str]:
        return dict(self.mapping)

    def _pattern(self) -> re.Pattern:
        if self.kind == "numbers":
            return re.compile(r"\d+")
        words = sorted((s for s, _ in self.mapping), key=len, reverse=True)  # longest first: `ab` before `a`
        return re.compile(r"\b(?:" + "|".join(map(re.escape, words)) + r")\b")

    def apply(self, text: str) -> tuple[str, list[tuple[int, int, int, int]]]:
        """`text` rewritten, and its edits `(old_start, old_end, new_start, new_end)` in order."""
        table, out, edits, pos, shift = self.table, [], [], 0, 0
        for m in self._pattern().finditer(text):
            key = str(int(m.group())) if self.kind == "numbers" else m.group()
            if key not in table:
                continue
            new = table[key]
            out.append(text[pos:m.start()] + new)
            edits.append((m.start(), m.end(), m.start() + shift, m.start() + shift + len(new)))
            shift += len(new) - (m.end() - m.start())
            pos = m.end()
        return "".join(out) + text[pos:], edits

    def __call__(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """A record as the permuted teacher reads it: every text column rewritten (question, answer,
        rationales) and the question's field spans moved onto the rewritten text."""
        out = {k: self._rewrite(v) for k, v in record.items()}
        if record.get(token_fields.FIELD_KEY):
            _, edits = self.apply(record["question"])
            out[token_fields.FIELD_KEY] = tuple(
                (name, tuple((_move(s, edits, False), _move(e, edits, True), v) for s, e, v in spans))
                for name, spans in token_fields.freeze(record[token_fields.FIELD_KEY]))
        return out

    def _rewrite(self, value: Any) -> Any:
        """A text column rewritten; a conversation (`data`'s `((role, content), ...)`) gets its contents
        rewritten, its roles kept; anything else (token_fields, numbers) as it is."""
        if isinstance(value, str):
            return self.apply(value)[0]
        if isinstance(value, tuple) and value and all(
                isinstance(m, tuple) and len(m) == 2 and all(isinstance(x, str) for x in m) for m in value):
            return tuple((role, self.apply(content)[0]) for role, content in value)
        return value

    def describe(self) -> dict[str, Any]:
        """What a capture made under this permutation records (its map, in full)."""
        return {"kind": self.kind, "map": dict(self.mapping)}


def _move(x: int, edits: list[tuple[int, int, int, int]], is_end: bool) -> int:
    """Character offset `x` of the old text in the new one; inside a replaced piece it snaps outward
    (a span's start to the piece's start, its end to the piece's end), so a span keeps covering it."""
    new = x
    for a, b, na, nb in edits:
        if x >= b:
            new = x + nb - b  # nb - b: the shift accumulated up to the end of this edit
        elif x > a:
            return nb if is_end else na
        else:
            break
    return new
