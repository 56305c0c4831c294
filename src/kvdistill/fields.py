"""Per-token fields: facts a task knows about its own text, mapped onto any tokenizer.

A task generator knows things about each problem that no tokenizer does: the resolved value of every
variable name, which chain a name belongs to, which tokens are names or numbers. It writes them as
character spans of the record's `question` (start, end exclusive, an integer value):

    {"question": "b=7. k=b. What is k?", "answer": "#### 7",
     "token_fields": {"value": [[0, 1, 7], [5, 6, 7], [7, 8, 7]], "chain": [[0, 1, 0], [5, 6, 0], [7, 8, 0]]}}

`token_values` maps them onto a tokenization (a token takes the value of the last of its characters that
a span covers), so the probe, the oracle control and `relation_rows: field:<name>` read the same
facts through the student's and every teacher's tokenizer. Tokens outside every span get `IGNORE`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

FIELD_KEY = "token_fields"  # the record key a task writes its fields under
IGNORE = -100  # a token that no span of a field covers (as -100 labels: no target there)

Spans = tuple[tuple[int, int, int], ...]


def freeze(fields: Any, where: str = "record") -> tuple[tuple[str, Spans], ...]:
    """Check a record's `token_fields` and make it hashable: `((name, ((start, end, value), ...)), ...)`.

    Hashable because the collator caches tokenizations keyed by the record's content. Raises
    `ValueError` naming the field and span that is not `[start, end, value]` with 0 <= start < end.
    """
    if isinstance(fields, tuple):  # already frozen
        return fields
    if not isinstance(fields, Mapping):
        raise ValueError(f"{where}: {FIELD_KEY} must be a mapping {{name: [[start, end, value], ...]}}, "
                         f"got {type(fields).__name__}")
    out = []
    for name, spans in sorted(fields.items()):
        checked = []
        for span in spans:
            ok = isinstance(span, Sequence) and len(span) == 3 and all(isinstance(x, int) for x in span)
            if not ok or not 0 <= span[0] < span[1]:
                raise ValueError(f"{where}: {FIELD_KEY}[{name!r}] span {span!r} is not [start, end, value] "
                                 "with integer 0 <= start < end (character offsets into the question)")
            checked.append(tuple(span))
        out.append((str(name), tuple(checked)))
    return tuple(out)


def char_values(n_chars: int, spans: Spans, offset: int = 0) -> Tensor:
    """Value of every character of a text of `n_chars` whose question starts at `offset`: `[C]`."""
    vals = torch.full((n_chars,), IGNORE, dtype=torch.long)
    for start, end, value in spans:  # a handful of spans per record, not a hot path
        if offset + end > n_chars:
            raise ValueError(f"span [{start}, {end}) runs past the question (text of {n_chars} characters, "
                             f"question at {offset})")
        vals[offset + start: offset + end] = value
    return vals


def token_values(chars: Tensor, token_ends: Tensor) -> Tensor:
    """Each token's value: that of the last of its characters a span covers; `IGNORE` for tokens without one.

    A token holds the characters after the previous token's last one up to its own last, so a name
    keeps its value in a token that spells more around it (a line token `m=k.` takes `k`'s, a BPE
    token ` e` takes `e`'s); whitespace between tokens is covered by no span.

    Args:
        chars: `[C]` per-character values (`char_values`).
        token_ends: `[T]` index of each token's last character, -1 for special tokens.

    Returns:
        `[T]` long.
    """
    at = torch.arange(len(chars))
    last_covered = torch.cummax(torch.where(chars != IGNORE, at, -1), dim=0).values  # [C] last covered index <= c
    before = torch.cummax(torch.cat([token_ends.new_full((1,), -1), token_ends[:-1]]), dim=0).values  # [T]
    last = last_covered[token_ends.clamp(min=0)]  # [T]
    inside = (token_ends >= 0) & (last > before)
    return torch.where(inside, chars[last.clamp(min=0)], torch.tensor(IGNORE))


def tokens_of(fields: tuple[tuple[str, Spans], ...], text: str, question: str, token_ends: Tensor,
              prompt_end: int | None = None) -> dict[str, Tensor]:
    """Every field of a record on one tokenization of its formatted `text`: `{name: [T]}`.

    The question is found in `text[:prompt_end]` as its last occurrence: the prompt template wraps it once,
    after any few-shot prefix a reader has (which may hold the same question).
    """
    offset = text.rfind(question, 0, len(text) if prompt_end is None else prompt_end)
    if offset < 0:
        raise ValueError("the question is not in the formatted prompt (a chat template changed it?), so its "
                         f"{FIELD_KEY} cannot be placed; use the plain prompt template")
    return {name: token_values(char_values(len(text), spans, offset), token_ends) for name, spans in fields}
