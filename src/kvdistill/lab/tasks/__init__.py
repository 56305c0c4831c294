"""Task generators beside the arithmetic default (`kvdistill.synthetic`): `binding` and `modular`.

Each writes GSM8K-format records (`question`, `answer` = `#### <final>`) plus the per-token facts a
probe, an oracle control or a row mask reads, as `token_fields` (character spans of the question,
`kvdistill.fields`). Everything is deterministic in the seed; docs/tasks.md describes both tasks.
"""

from __future__ import annotations

from collections.abc import Iterable

# a piece of a question: plain text, or text with the field values its characters carry
Piece = str | tuple[str, dict[str, int]]


def spell(pieces: Iterable[Piece]) -> tuple[str, dict[str, list[list[int]]]]:
    """Join `pieces` into a question and its `token_fields` `{field: [[start, end, value], ...]}`."""
    text, fields = "", {}
    for piece in pieces:
        chars, facts = (piece, {}) if isinstance(piece, str) else piece
        for name, value in facts.items():
            fields.setdefault(name, []).append([len(text), len(text) + len(chars), value])
        text += chars
    return text, fields
