"""Final-answer extraction for GSM8K-style outputs.

A completion's answer is, in order of preference: the first number after `####` (the
GSM8K convention the students are trained on), the content of a LaTeX `\\boxed{...}`, or
else the last number in the text. Numbers are compared after normalisation, so
`$1,234.00`, `1234` and `+1234.` are the same answer and `-5`, `−5` (Unicode minus) and
`-$5` are the same negative one.
"""

from __future__ import annotations

import re
from decimal import Context, Decimal, InvalidOperation

# A number: optional sign (only when it is not a binary minus, i.e. not right after a digit,
# letter or closing bracket), optional `$`, then digits with proper thousands separators,
# plain digits, or a bare decimal like `.5`. A trailing sentence period is not a decimal
# point because the fraction part needs at least one digit.
_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])(?P<sign>[-+\u2212]))?"
    r"(?:\$\s?)?"
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
    r"(?![\d])"
)
_HASHES = "####"
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")


def normalize_number(text: str | None) -> str | None:
    """Canonical string for a number: no `$`/commas/`+`, no trailing zeros, `-0` -> `0`.

    Returns `None` when `text` holds no number. Only the first number in `text` is used.

    Example:
        >>> normalize_number("$1,234.50")
        '1234.5'
    """
    if text is None:
        return None
    match = _NUMBER.search(text)
    if match is None:
        return None
    return _canonical(match)


def _canonical(match: re.Match[str]) -> str | None:
    digits = match.group("num").replace(",", "")
    sign = "-" if match.group("sign") in ("-", "\u2212") else ""
    try:
        value = Decimal(sign + digits)
    except InvalidOperation:  # pragma: no cover - the regex only lets valid numbers through
        return None
    if value == 0:
        return "0"
    # normalize() strips trailing zeros but may switch to exponent form (1E+3): 'f' undoes it; it also
    # rounds to the context's precision (28 digits by default), so give it one as long as the number
    return format(value.normalize(Context(prec=len(digits))), "f")


def find_numbers(text: str) -> list[str]:
    """Every number in `text`, normalised, in order of appearance."""
    return [n for n in (_canonical(m) for m in _NUMBER.finditer(text)) if n is not None]


def extract_answer(text: str | None) -> str | None:
    """The final answer of a completion as a normalised number string, or `None`.

    Order: first number on the line after the first `####` that has one; the last
    `\\boxed{...}` holding a number; the last number anywhere.

    Example:
        >>> extract_answer("3 + 4 = 7 apples.\\n#### 7")
        '7'
        >>> extract_answer("So she pays $1,250.00 in total.")
        '1250'
    """
    if not text:
        return None
    # `####` marks the answer; a completion can repeat it (a new question run-on), so take
    # the first marker whose line holds a number.
    start = 0
    while (pos := text.find(_HASHES, start)) != -1:
        line = text[pos + len(_HASHES) :].split("\n", 1)[0]
        value = normalize_number(line)
        if value is not None:
            return value
        start = pos + len(_HASHES)
    boxed = [normalize_number(b) for b in _BOXED.findall(text)]
    boxed = [b for b in boxed if b is not None]
    if boxed:
        return boxed[-1]
    numbers = find_numbers(text)
    return numbers[-1] if numbers else None


def gold_answer(answer: str) -> str | None:
    """Normalised gold number of a GSM8K `answer` field (`rationale ... #### n`)."""
    return extract_answer(answer)


def is_correct(predicted: str | None, gold: str | None) -> bool:
    """Exact match of two normalised answers; a missing prediction is never correct."""
    if predicted is None or gold is None:
        return False
    try:
        return Decimal(predicted) == Decimal(gold)
    except InvalidOperation:
        return predicted.strip() == gold.strip()
