"""Data: loading, prompt formatting, tokenisation with segments, batching.

A record is in one of four formats (`kvdistill.formats`, docs/data.md): question/answer (GSM8K,
`{"question": str, "answer": str}` with `answer = rationale + "#### <number>"`), messages,
prompt/completion or text. Segments (prompt / reasoning / answer) are found from *character* offsets
of the formatted text, so the same text gets consistent segments under any tokenizer: this is what
lets the time alignment match a teacher and a student that tokenize differently.
"""

from __future__ import annotations

import itertools
import json
import os
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kvdistill import fields as token_fields
from kvdistill import formats
from kvdistill.cache import ANSWER, PAD, PROMPT, REASONING
from kvdistill.formats import DataError, describe_format, record_format  # noqa: F401 (data's public names)

DEFAULT_TEMPLATE = "Question: {question}\nAnswer:"
ANSWER_MARKER = "####"
LATENT_TOKEN = "<|latent|>"  # one latent (pause) slot of `student_input: latent:N`
# `char_ends` of a token without a character of the plain text: a special token (BOS, EOS, padding), or
# one of a chat template's own characters, which a reader of the plain prompt never sees
NO_CHAR, UNSHARED = -1, -2
# field maps that make other datasets look like GSM8K: {our name: their column}
FIELD_MAPS: dict[str, dict[str, str]] = {
    "gsm8k": {"question": "question", "answer": "answer"},
    "svamp": {"question": "question_concat", "answer": "Answer"},
    "math": {"question": "problem", "answer": "solution"},
    "strategyqa": {"question": "question", "answer": "answer"},
}
_LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


# ----------------------------------------------------------------------------- loading


def load_records(
    source: str | os.PathLike | Any,
    split: str = "train",
    field_map: Mapping[str, str] | str | None = None,
    limit: int | None = None,
    extra_fields: Sequence[str] = (),
    require_final: bool = False,
    dataset_format: str = "auto",
) -> list[dict]:
    """Load records from a Hub id, a local file, a directory or a `datasets.Dataset`.

    The format is detected from the columns (`formats.detect_format`: question/answer first, then
    messages, prompt/completion, text), or named by `dataset_format` or by a `field_map`'s keys.
    Every record is checked where it is read: a line that is not UTF-8 or not a JSON object, a
    record without a value in one of its format's columns, an empty question (completion, text,
    assistant turn), or (with `require_final`) an answer that does not say which part is its final
    answer, is a `DataError` naming the file and line.

    Args:
        source: "openai/gsm8k" (Hub, config "main"), a local .jsonl/.json/.parquet file, a
            directory holding `<split>.jsonl` (or .json/.parquet), "synthetic" (generated), or a
            `datasets.Dataset` / `IterableDataset` / `DatasetDict` or a list of dicts (`records_from_dataset`).
        split: which split to load.
        field_map: `{our column: their column}`: `{"question": col, "answer": col}` or a name from
            `FIELD_MAPS` for question/answer data; e.g. `{"messages": "conversations"}` for another format.
        limit: keep the first `limit` records.
        extra_fields: further columns to keep (e.g. per-teacher rationales).
        require_final: labelled training records: every answer must end in `#### <final answer>`
            or be a one-line final answer (else its rationale would be learned as the answer).
            Question/answer records only: the other formats have no final answer (`has_finals`).
        dataset_format: "auto" or one of `formats.FORMATS`.

    Returns:
        list of dicts: `{"question", "answer"}`, `{"messages"}`, `{"prompt", "completion"}` or `{"text"}`
        (message lists as tuples of `(role, content)`), each with its `extra_fields`.
    """
    import datasets

    if isinstance(source, (datasets.Dataset, datasets.IterableDataset, datasets.DatasetDict, list, tuple)):
        return records_from_dataset(source, split, field_map, limit, extra_fields, require_final, dataset_format)
    if str(source) == "synthetic":
        from kvdistill.synthetic import make_splits

        if dataset_format not in ("auto", formats.QUESTION_ANSWER):
            raise DataError(f"synthetic data is question_answer records, not dataset_format {dataset_format!r}")
        train, test = make_splits(2000, 500, seed=0)
        records = train if split == "train" else test
        return records[:limit] if limit else records
    path = Path(source)
    if path.is_dir():
        files = [path / f"{split}{ext}" for ext in _LOCAL_FORMATS]
        files = [f for f in files if f.exists()]
        if not files:
            raise DataError(f"no {split}.jsonl/.json/.parquet in {path}; write one or pass a file path")
        path = files[0]
    if path.suffix == ".jsonl" and path.is_file():
        rows = read_jsonl_records(path)[:limit]
        columns = sorted({key for _, row in rows for key in row})
    elif path.suffix in _LOCAL_FORMATS and path.is_file():
        try:
            ds = datasets.load_dataset(_LOCAL_FORMATS[path.suffix], data_files={split: str(path)}, split=split)
        except Exception as err:  # datasets wraps a parse error of the file in its own types
            raise DataError(f"{path} could not be read as {path.suffix} data ({type(err).__name__}: "
                            f"{_first_line(err)}); check the file, or convert it to one JSON object per line "
                            "(.jsonl)") from err
        rows, columns = _dataset_rows(ds, str(path), limit), ds.column_names
    elif path.suffix in _LOCAL_FORMATS or str(source).startswith((".", "/")):
        raise DataError(f"data file not found: {source}; check the path")
    else:
        config = "main" if str(source).endswith("gsm8k") else None
        try:
            ds = datasets.load_dataset(str(source), config, split=split)
        except Exception as err:  # datasets raises many types for "not reachable"
            raise DataError(
                f"could not load dataset {source!r} (split {split!r}): {type(err).__name__}: {_first_line(err)}; "
                "without network, pass a local jsonl/parquet file or directory, or 'synthetic'"
            ) from err
        rows, columns = _dataset_rows(ds, str(source), limit), ds.column_names
    return _records(str(source), split, rows, columns, field_map, limit, extra_fields, require_final, dataset_format)


def records_from_dataset(
    ds: Any,
    split: str = "train",
    field_map: Mapping[str, str] | str | None = None,
    limit: int | None = None,
    extra_fields: Sequence[str] = (),
    require_final: bool = False,
    dataset_format: str = "auto",
    source: str = "dataset",
) -> list[dict]:
    """Records of an in-memory `datasets.Dataset` (or `IterableDataset`, or a list of dicts; a `DatasetDict`
    gives its `split`), checked and converted as `load_records` does a file's; `source` names it in errors."""
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{source} has no split {split!r} (has {sorted(ds)}); pass split=<one of them>")
        ds = ds[split]
    if isinstance(ds, datasets.Dataset):
        rows, columns = _dataset_rows(ds, source, limit), ds.column_names
    else:  # streamed, or plain Python rows: read up to `limit` of them (all without one)
        taken = ds if limit is None else itertools.islice(ds, max(limit, 0))
        rows = [(f"{source} record {i}", row) for i, row in enumerate(taken)]
        for where, row in rows:
            if not isinstance(row, Mapping):
                raise DataError(f"{where} is a {type(row).__name__}, not a mapping of column names to values")
        columns = getattr(ds, "column_names", None) or sorted({key for _, row in rows for key in row})
    return _records(source, split, rows, columns, field_map, limit, extra_fields, require_final, dataset_format)


def _records(source: str, split: str, rows: Sequence[tuple[str, Mapping]], columns: Sequence[str],
             field_map: Mapping[str, str] | str | None, limit: int | None, extra_fields: Sequence[str],
             require_final: bool, dataset_format: str) -> list[dict]:
    """The checked records of `rows` (`(where, row)`), in the format their columns say."""
    if isinstance(field_map, str):
        if field_map not in FIELD_MAPS:
            raise DataError(f"field_map {field_map!r} is not a known name {sorted(FIELD_MAPS)}; give a mapping "
                            "{question: <column>, answer: <column>}")
        field_map = FIELD_MAPS[field_map]
    if not rows:
        raise DataError(f"{source} holds no {split} records" + (f" (limit {limit})" if limit is not None else "")
                        + "; give a file with at least one {\"question\", \"answer\"} record (or another format's: "
                        f"{formats.accepted()})")
    fmt, fmap = formats.detect_format(columns, source, dataset_format, field_map)
    missing = [c for c in [*fmap.values(), *extra_fields] if c not in columns]
    if missing:
        example = ("{" + ", ".join(f'"{c}": "<col>"' for c in formats.COLUMNS[fmt]) + "}")
        raise DataError(f"{source}: columns {missing} not found (has {sorted(columns)}); set a field_map such as "
                        f"{example}")
    if fmt == formats.QUESTION_ANSWER:
        return [_record(where, row, fmap, extra_fields, require_final) for where, row in rows]
    records = []
    for where, row in rows:
        rec = {**formats.to_record(where, row, fmt, fmap), **{f: row[f] for f in extra_fields}}
        if record_format(rec) != fmt:  # an extra field named like another format's column
            raise DataError(f"{source}: extra_fields {list(extra_fields)} make its {fmt} records read as "
                            f"{record_format(rec)}; rename those columns")
        records.append(rec)
    return records


def read_jsonl_records(path: Path) -> list[tuple[str, dict]]:
    """`(where, record)` for every non-blank line of a JSON-lines data file; a line that is not
    UTF-8 or not a JSON object is a `DataError` naming the file and the line."""
    rows = []
    with path.open("rb") as fh:
        for n, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path} line {n} is not UTF-8 (byte {err.start} of the line: {err.reason}); "
                                "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path} line {n} is not valid JSON ({err.msg}, column {err.colno}); fix or "
                                "remove that line") from None
            if not isinstance(row, dict):
                raise DataError(f"{path} line {n} holds a JSON {type(row).__name__}, not an object; write one "
                                '{"question": ..., "answer": ...} object per line')
            rows.append((f"{path} line {n}", row))
    return rows


def _dataset_rows(ds: Any, source: str, limit: int | None) -> list[tuple[str, Mapping]]:
    if limit is not None:
        ds = ds.select(range(min(max(limit, 0), len(ds))))
    return [(f"{source} record {i}", row) for i, row in enumerate(ds)]


def _record(where: str, row: Mapping[str, Any], fmap: Mapping[str, str], extra_fields: Sequence[str],
            require_final: bool) -> dict:
    """One checked record `{"question", "answer", *extra_fields}` from a data row."""
    for col in [*fmap.values(), *extra_fields]:
        if row.get(col) is None:
            raise DataError(f"{where} has no {col!r} value; give every record one (or remove that record)")
    rec = {ours: str(row[theirs]) for ours, theirs in fmap.items()}
    rec.update({f: row[f] for f in extra_fields})
    rec.update(formats.row_fields(where, row))  # a task's per-token facts (fields.py) travel with it
    if not rec["question"].strip():
        raise DataError(f"{where} has an empty {fmap['question']!r}; give every record a question (or remove "
                        "that record)")
    if require_final:
        final = split_answer(rec["answer"])[1]
        if not final:
            raise DataError(f"{where} has no final answer (its {fmap['answer']!r} is empty or ends in "
                            f"{ANSWER_MARKER!r}); write it as '<rationale> {ANSWER_MARKER} 42'")
        if ANSWER_MARKER not in rec["answer"] and "\n" in final:
            raise DataError(f"{where}: its answer has {len(final.splitlines())} lines and no {ANSWER_MARKER!r} "
                            "marker, so all of them would be learned as the final answer; end every answer with "
                            f"'{ANSWER_MARKER} <final answer>' (GSM8K format), or map `answer` to a column holding "
                            "only the final answer")
    return rec


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else ""


def has_finals(records: Sequence[Mapping[str, Any]]) -> bool:
    """Whether `records` have final answers to score (accuracy, `fusion: correctness`, on-policy prompts):
    only question/answer records do (`#### <final>`); for messages, prompt/completion and text records
    evaluation by final answer does not apply, and a caller refuses it with `require_finals`."""
    return bool(records) and all(record_format(r) == formats.QUESTION_ANSWER for r in records)


def require_finals(records: Sequence[Mapping[str, Any]], purpose: str) -> None:
    """A one-line `DataError` when `records` have no final answers for `purpose` (e.g. "accuracy_eval_steps")."""
    if records and not has_finals(records):
        raise DataError(f"{purpose} scores final answers ('#### <final>' of question_answer records); these are "
                        f"{record_format(records[0])} records, which have none: turn {purpose} off")


# ----------------------------------------------------------------------------- formatting


def split_answer(answer: str) -> tuple[str, str]:
    """`"rationale\\n#### 42"` -> `("rationale", "42")`; an answer without `####` is all final."""
    if ANSWER_MARKER in answer:
        rationale, final = answer.rsplit(ANSWER_MARKER, 1)
        return rationale.strip(), final.strip()
    return "", answer.strip()


def parse_student_input(student_input: str) -> tuple[str, int]:
    """`student_input` as (kind, count): ("full", 0), ("no_rationale", 0), ("short_rationale", K), ("latent", N)."""
    if student_input in ("full", "no_rationale"):
        return student_input, 0
    kind, _, k = student_input.partition(":")
    if kind in ("short_rationale", "latent") and k.isdigit() and int(k) >= 1:
        return kind, int(k)
    raise ValueError(f"student_input {student_input!r} is not one of full, no_rationale, short_rationale:K, "
                     "latent:N (K, N >= 1)")


def shorten_rationale(record: Mapping[str, Any], student_input: str) -> dict[str, Any]:
    """The record as a privileged-teacher student reads it: its rationale cut to `student_input`.

    `"no_rationale"` leaves `#### <final>` only; `"short_rationale:K"` keeps the first K lines;
    `"latent:N"` puts N `LATENT_TOKEN` slots where the rationale was (pause tokens the student
    learns to emit and the teachers' compressed rationale is matched on).
    """
    kind, k = parse_student_input(student_input)
    if kind == "full":
        return dict(record)
    if record_format(record) != formats.QUESTION_ANSWER:
        raise DataError(f"student_input {student_input} shortens a question_answer record's rationale; a "
                        f"{record_format(record)} record has none: use student_input full")
    rationale, final = split_answer(str(record["answer"]))
    kept = LATENT_TOKEN * k if kind == "latent" else "\n".join(rationale.splitlines()[:k])
    return {**record, "answer": f"{kept}\n{ANSWER_MARKER} {final}" if kept else f"{ANSWER_MARKER} {final}"}


def add_latent_token(tokenizer: Any) -> bool:
    """Give `tokenizer` the `LATENT_TOKEN` special token (a no-op if it has it); True if it was added.

    `lstrip` folds the space before the first slot into it, so `latent:N` is exactly N tokens
    under any tokenizer; the caller resizes the model's embeddings.
    """
    from tokenizers import AddedToken

    if LATENT_TOKEN in tokenizer.get_vocab():
        return False
    token = AddedToken(LATENT_TOKEN, lstrip=True, rstrip=False, normalized=False, special=True)
    return tokenizer.add_tokens([token], special_tokens=True) > 0


@dataclass
class Formatted:
    """A formatted example and the character span of each segment.

    `text[:prompt_end]` is the prompt, `text[prompt_end:reasoning_end]` the reasoning and the
    rest the answer (`\\n#### 42`). `shared [len(text)]`, when the prompt is a chat template's, is
    each character's index in the plain-template text of the same record (`UNSHARED` for the
    template's own characters): the coordinates every reader of the record shares, whatever its prompt.
    `segments [len(text)]`, when set, is every character's segment instead: a conversation's assistant
    turns are several spans, with prompt (user turns) between them; `prompt_end` is then where the first
    learned character is.
    """

    text: str
    prompt_end: int
    reasoning_end: int
    shared: Tensor | None = None
    segments: Tensor | None = None

    def shared_ends(self, ends: Tensor) -> Tensor:
        """Token ends `[T]` (characters of `text`, `NO_CHAR` for special tokens) in shared coordinates."""
        if self.shared is None:
            return ends
        return torch.where(ends >= 0, self.shared[ends.clamp(min=0)], ends)


def format_prompt(question: str, template: str = DEFAULT_TEMPLATE, tokenizer: Any = None) -> str:
    """The prompt string a model is trained and evaluated with.

    With a tokenizer that has a chat template, the question goes in a user turn and the
    assistant turn is opened; otherwise `template.format(question=...)`.
    """
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
    return template.format(question=question)


def format_example(
    record: Mapping[str, Any],
    template: str = DEFAULT_TEMPLATE,
    tokenizer: Any = None,
    rationale_field: str | None = None,
    own_template: str | None = None,
) -> Formatted:
    """Format a question/answer record as prompt + " " + rationale + "\\n#### " + final.

    `rationale_field` names a column with another rationale (e.g. a teacher's own chain of
    thought) to use instead of the reference one; its `####` final answer wins if it has one,
    and a text without `####` is all rationale (the reference final answer stays).

    `own_template`, a prompt template one reader (a teacher) has instead of `template` (e.g. with a
    few-shot prefix), is placed as a chat template's prompt is: `shared` maps its question and all after
    the prompt onto the `template` text, its own characters are `UNSHARED`. Under a chat template the
    user turn holds it filled in.

    The other formats (docs/data.md): prompt/completion is `prompt + completion` (the completion is the
    answer segment), text is all answer, and a conversation is `tokenizer`'s chat template if it has one
    (whatever `use_chat_template` says: conversational data is written for it), else the plain rendering;
    `template` and `####` mean nothing to them. `own_template` wraps a standard prompt as it wraps a question.
    """
    fmt = record_format(record)
    if fmt != formats.QUESTION_ANSWER:
        if rationale_field is not None:
            raise DataError(f"rationale_field {rationale_field!r} replaces a question_answer record's rationale; "
                            f"a {fmt} record has none: drop the teacher's rationale_field")
        return _format_other(record, fmt, tokenizer, own_template)
    rationale, final = split_answer(str(record["answer"]))
    if rationale_field is not None:
        if rationale_field not in record:
            raise DataError(f"record has no rationale field {rationale_field!r} (has {sorted(record)})")
        alt = str(record[rationale_field])
        # split_answer reads a marker-less text as a final answer; here it is a bare chain of thought
        rationale, final = split_answer(alt) if ANSWER_MARKER in alt else (alt.strip(), final)
    question = str(record["question"])
    if own_template is None:
        prompt = format_prompt(question, template, tokenizer)
    elif _has_template(tokenizer):
        prompt = format_prompt(own_template.format(question=question), template, tokenizer)
    else:
        prompt = own_template.format(question=question)
    plain = format_prompt(question, template)
    reasoning = f" {rationale}" if rationale else ""
    text = f"{prompt}{reasoning}\n{ANSWER_MARKER} {final}"
    shared = None if prompt == plain else shared_chars(prompt, plain, question, len(text))
    return Formatted(text, len(prompt), len(prompt) + len(reasoning), shared)


def _format_other(record: Mapping[str, Any], fmt: str, tokenizer: Any, own_template: str | None = None
                  ) -> Formatted:
    """A messages, prompt/completion or text record as `Formatted` (its learned text is the answer segment).
    `own_template` wraps a standard prompt as it wraps a question (`{question}` is the prompt)."""
    if own_template is not None and (fmt == formats.TEXT or formats.is_conversational(record)):
        raise DataError(f"a teacher's template wraps a question or a standard prompt; a {fmt} record has neither "
                        "(a conversation is read through each reader's chat template): drop the teacher's template")
    if fmt == formats.TEXT:
        return Formatted(str(record["text"]), 0, 0)
    if not formats.is_conversational(record):  # standard prompt/completion: the texts joined as given (as TRL)
        plain = str(record["prompt"])
        prompt = plain if own_template is None else own_template.format(question=plain)
        text = prompt + str(record["completion"])
        shared = None if prompt == plain else shared_chars(prompt, plain, plain, len(text))
        return Formatted(text, len(prompt), len(prompt), shared)
    messages, learned = formats.conversation(record)
    if _has_template(tokenizer):
        r = formats.render_chat(tokenizer, messages, learned)
        shared = torch.full((len(r.text),), UNSHARED, dtype=torch.long)  # the template's own text
        for start, end, plain_start in r.shared:
            shared[start:end] = torch.arange(plain_start, plain_start + end - start)
    else:
        r, shared = formats.render_plain(messages, learned)[0], None
    seg = torch.full((len(r.text),), PROMPT, dtype=torch.long)
    for start, end in r.learned:
        seg[start:end] = ANSWER
    return Formatted(r.text, r.learned[0][0], r.learned[0][0], shared, seg)


def prompt_text(record: Mapping[str, Any]) -> str:
    """What a prompt template wraps and `token_fields` spans are relative to: the question, or a standard prompt."""
    return str(record["question"] if "question" in record else record["prompt"])


def _has_template(tokenizer: Any) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def shared_chars(prompt: str, plain: str, question: str, n: int) -> Tensor:
    """`[n]` index in the plain-prompt text of every character of a text whose prompt is `prompt` (a chat
    template's) instead of `plain`: the question and all after the prompt map across, the rest is UNSHARED."""
    shared = torch.full((n,), UNSHARED, dtype=torch.long)
    q, q_plain = prompt.rfind(question), plain.rfind(question)  # the last: after a reader's few-shot prefix
    if q >= 0 and q_plain >= 0:  # a template that rewrites the question shares none of it
        shared[q : q + len(question)] = torch.arange(q_plain, q_plain + len(question))
    shared[len(prompt) :] = torch.arange(len(plain), len(plain) + n - len(prompt))
    return shared


# ----------------------------------------------------------------------------- tokenisation


def char_segments(f: Formatted) -> Tensor:
    """Segment id of every character of `f.text`: `[len(text)]`."""
    if f.segments is not None:
        return f.segments
    seg = torch.full((len(f.text),), ANSWER, dtype=torch.long)
    seg[: f.reasoning_end] = REASONING
    seg[: f.prompt_end] = PROMPT
    return seg


def token_segments(tokenizer: Any, f: Formatted, chat: bool) -> tuple[list[int], Tensor, Tensor]:
    """Tokenize `f.text` (no special tokens added under a chat template: it holds its own) and place
    every token in a segment. Returns `ids`, `ends [T]` (each token's last character, -1 for special
    tokens) and `seg [T]`. A token belongs to the segment of its *last* character: " 17" after the
    prompt's "Answer:" is a reasoning token, so the LM loss learns to emit it; special tokens read
    as prompt before the first character and take the segment of the token before them after it (a
    chat template's end-of-turn, when the tokenizer gives it no characters)."""
    enc = tokenizer(f.text, return_offsets_mapping=True, add_special_tokens=not chat, truncation=False)
    ends = torch.tensor([e - 1 if e > s else NO_CHAR for s, e in enc["offset_mapping"]], dtype=torch.long)  # [T]
    return list(enc["input_ids"]), ends, end_segments(f, ends)


def end_segments(f: Formatted, ends: Tensor) -> Tensor:
    """`[T]` the segment of each token of `f.text` from its last character `ends [T]` (`token_segments`)."""
    # forward fill from the last token with characters: segments of a conversation are not monotone,
    # so a running max (which this equals on question/answer text) would learn the user turns after the first
    at = torch.arange(len(ends))
    last = torch.cummax(torch.where(ends >= 0, at, -1), dim=0).values if len(ends) else at  # [T]
    seg = char_segments(f)[ends[last.clamp(min=0)].clamp(min=0)]  # [T]
    return torch.where(last >= 0, seg, torch.tensor(PROMPT))


def prompt_reads(student: Any, teachers: Mapping[str, Any], template: str = DEFAULT_TEMPLATE,
                 use_chat_template: bool = False, example: Mapping[str, Any] | None = None,
                 own_templates: Mapping[str, str] | None = None) -> str:
    """One line naming the prompt the student and each teacher read (`teachers`: name -> tokenizer, None for
    one that reads the student's tokens). Under `use_chat_template` each reader takes its own chat template
    if it has one and `template` otherwise; their tokens are paired on the characters they share.
    `example`, one record of the data, says its format (question/answer when None): a conversation takes
    each reader's chat template whatever `use_chat_template` says, other formats are read as given.
    `own_templates`: teacher name -> the prompt template it reads instead of `template` (`format_example`)."""
    fallback = f"prompt_template {template!r}"
    own_templates = own_templates or {}
    if example is not None and formats.is_conversational(example):
        use_chat_template, fallback = True, "the plain rendering ('Role: content' lines)"
    elif example is not None and record_format(example) != formats.QUESTION_ANSWER:
        given = f"prompts: every reader reads the {record_format(example)} records' text as given"
        return given + "".join(f"; teacher {n} reads its own template {_brief(t)} around the prompt"
                               for n, t in own_templates.items())

    def reads(tok: Any, name: str | None = None) -> str:
        own = own_templates.get(name)
        if use_chat_template and getattr(tok, "chat_template", None):
            return "its chat template" + (f", its user turn its own template {_brief(own)}" if own else "")
        if own:
            return f"its own template {_brief(own)} (its text outside the question pairs with no student token)"
        return fallback + (" (it has no chat template)" if use_chat_template else "")

    parts = [f"student reads {reads(student)}"]
    parts += [f"teacher {n} reads " + ("the student's tokens" if tok is None else reads(tok, n))
              for n, tok in teachers.items()]
    return "prompts: " + "; ".join(parts)


def _brief(template: str, n: int = 60) -> str:
    """A template as one console line shows it: whole when short, else its two ends (a fact sheet is long)."""
    if len(template) <= n:
        return repr(template)
    return f"{template[: n // 2]!r}...{template[-n // 2 :]!r} ({len(template)} characters)"


def tokenize_example(
    tokenizer: Any,
    record: Mapping[str, Any],
    max_length: int = 512,
    template: str = DEFAULT_TEMPLATE,
    rationale_field: str | None = None,
    use_chat_template: bool = False,
    own_template: str | None = None,
) -> dict[str, Tensor]:
    """Tokenize one record for training (`own_template`: this reader's prompt, `format_example`).

    Returns:
        dict of 1-D tensors `[T]`: `input_ids`, `attention_mask`, `labels` (prompt = -100, so the
        LM loss sees only reasoning + answer), `segment_ids` (0 prompt, 1 reasoning, 2 answer), `char_ends`
        (each token's last character in the plain-prompt text, whatever prompt this reader has: `NO_CHAR`
        for specials, `UNSHARED` for a chat template's own text; cross-vocab logit KD and the time
        alignment pair two tokenizations' positions by it), and
        `field:<name>` for every per-token field the record carries (`fields.py`; `IGNORE` elsewhere).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"{type(tokenizer).__name__} is a slow tokenizer: segments need character offsets "
            "(`return_offsets_mapping`); load it with use_fast=True"
        )
    # the text is the reader's chat template's (which holds its own special tokens): a conversation's whatever
    # `use_chat_template` says (`format_example`), a question/answer prompt's under it; never a plain text's
    templated = formats.is_conversational(record) or (use_chat_template and record_format(record) == formats.QUESTION_ANSWER)
    chat = templated and _has_template(tokenizer)
    f = format_example(record, template, tokenizer if chat else None, rationale_field, own_template)
    ids, ends, seg = token_segments(tokenizer, f, chat)
    if ids and tokenizer.eos_token_id is not None and ids[-1] != tokenizer.eos_token_id:
        ids.append(tokenizer.eos_token_id)  # the model learns to stop after the answer
        seg = torch.cat([seg, torch.tensor([ANSWER])])
    if len(ids) > max_length:  # one message per max_length: Python shows it once, not once per example
        lost = ("its tail is not learned" if record_format(record) == formats.TEXT else "its answer may be lost")
        warnings.warn(f"an example was cut to max_length={max_length} tokens; {lost} (raise max_length)", stacklevel=2)
    input_ids = torch.tensor(ids[:max_length], dtype=torch.long)
    seg = seg[:max_length]
    labels = torch.where(seg == PROMPT, torch.tensor(-100), input_ids)
    out = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "labels": labels,
        "segment_ids": seg,
        "char_ends": torch.cat([f.shared_ends(ends), torch.full((len(ids) - len(ends),), NO_CHAR)])[:max_length],  # + EOS
    }
    if record.get(token_fields.FIELD_KEY):
        try:
            per_token = token_fields.tokens_of(token_fields.freeze(record[token_fields.FIELD_KEY]), f.text,
                                               prompt_text(record), ends, f.prompt_end)
        except ValueError as err:
            raise DataError(str(err)) from None
        ignore = torch.full((len(ids) - len(ends),), token_fields.IGNORE)  # the appended EOS
        out.update({f"field:{k}": torch.cat([v, ignore])[:max_length] for k, v in per_token.items()})
    return out


def pad_batch(features: Sequence[Mapping[str, Tensor]], pad_id: int, side: str = "right") -> dict[str, Tensor]:
    """Pad 1-D tensors to the longest in the batch: `[T]` each -> `[B, T_max]`."""
    T = max(len(f["input_ids"]) for f in features)
    # a per-token field is the union over the batch: a record without it has no value at any token
    field_keys = sorted({k for f in features for k in f if k.startswith("field:")})
    fill = {"input_ids": pad_id, "attention_mask": 0, "labels": -100, "segment_ids": PAD, "char_ends": NO_CHAR,
            **dict.fromkeys(field_keys, token_fields.IGNORE)}
    out: dict[str, Tensor] = {}
    for key, value in fill.items():
        if key not in features[0] and key not in field_keys:
            continue
        rows = []
        for f in features:
            x = f.get(key, torch.full_like(f["input_ids"], value))
            n = T - len(x)
            pad = torch.full((n,), value, dtype=x.dtype)
            rows.append(torch.cat([x, pad]) if side == "right" else torch.cat([pad, x]))
        out[key] = torch.stack(rows)  # [B, T]
    return out


@dataclass
class TeacherView:
    """How one teacher sees an example: its own tokenizer, rationale column and/or prompt `template`, and
    `rewrite`, a record -> record map applied before it tokenizes (`teacher_control: permuted`)."""

    tokenizer: Any
    rationale_field: str | None = None
    rewrite: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
    template: str | None = None


@dataclass
class DistillCollator:
    """Tokenize records per batch for the student and every teacher that sees the text differently.

    Returns a batch with the student's `input_ids, attention_mask, labels, segment_ids` `[B, T]`,
    `index [B]` (record ids, for per-sample teacher weights and the teacher cache), `labelled [B]`
    (False for transfer records: no LM loss) and `teacher_inputs`:
    `{teacher name: {input_ids, attention_mask, segment_ids}}` for teachers listed in `teachers`
    (those with another tokenizer or rationale; the others reuse the student's tensors). Records with
    per-token fields (`fields.py`) add `token_fields: {name: [B, T]}` to the batch and to each
    teacher's inputs, in that reader's own tokenization.
    `student_input` shortens the student's rationale (`shorten_rationale`); teachers always read
    the whole record.

    `transfer` records (a transfer set; their `index` continues after the labelled records') are
    appended to every batch, `transfer_batch_size` of them, drawn with a generator seeded by
    `seed` and the batch's own indices: a resumed run (same sampler state) draws the same ones.
    """

    tokenizer: Any
    max_length: int = 512
    template: str = DEFAULT_TEMPLATE
    use_chat_template: bool = False
    teachers: dict[str, TeacherView] = field(default_factory=dict)
    student_input: str = "full"
    transfer: Sequence[Mapping[str, Any]] = ()
    transfer_batch_size: int = 0
    seed: int = 0
    # (view, record) -> tokenized features: a run sees each record in many epochs, and tokenizing it for
    # the student and every teacher was ~12 % of a distillation step on the demo. Bounded: a large
    # dataset read once gains nothing from it, and would keep every tokenization in memory
    _features: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    max_cached: int = 20_000

    def _transfer_draw(self, records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        if not self.transfer or self.transfer_batch_size <= 0:
            return []
        ids = [int(r.get("index", i)) for i, r in enumerate(records)]
        key = zlib.crc32(str((self.seed, ids)).encode())
        g = torch.Generator().manual_seed(key)
        pick = torch.randint(len(self.transfer), (self.transfer_batch_size,), generator=g)
        return [self.transfer[i] for i in pick.tolist()]

    def _encode(self, view: str, tok: Any, records: Sequence[Mapping], rationale_field: str | None = None,
                own_template: str | None = None) -> dict[str, Tensor]:
        """`view` names who reads (the student, or a teacher): each view tokenizes a record one way."""
        feats = []
        for r in records:
            try:  # the record's content is the key: equal records tokenize equally
                key = (view, tuple(r.items()))
                f = self._features.get(key)
            except TypeError:  # an unhashable field: tokenized every time
                key, f = None, None
            if f is None:
                f = tokenize_example(tok, r, self.max_length, self.template, rationale_field, self.use_chat_template,
                                     own_template)
                if key is not None and len(self._features) < self.max_cached:
                    self._features[key] = f
            feats.append(f)
        batch = pad_batch(feats, tok.pad_token_id if tok.pad_token_id is not None else 0)
        per_token = {k.removeprefix("field:"): batch.pop(k) for k in list(batch) if k.startswith("field:")}
        if per_token:
            batch["token_fields"] = per_token  # {name: [B, T]}
        return batch

    def __call__(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        n_labelled = len(records)
        records = [*records, *self._transfer_draw(records)]
        student_records = [shorten_rationale(r, self.student_input) for r in records]
        batch: dict[str, Any] = self._encode("", self.tokenizer, student_records)
        batch["index"] = torch.tensor([int(r.get("index", i)) for i, r in enumerate(records)])
        batch["labelled"] = torch.arange(len(records)) < n_labelled  # [B]
        teacher_inputs = {}
        for name, view in self.teachers.items():
            seen = records if view.rewrite is None else [view.rewrite(r) for r in records]
            enc = self._encode(name, view.tokenizer, seen, view.rationale_field, view.template)
            enc.pop("labels")
            teacher_inputs[name] = enc
        if teacher_inputs:
            batch["teacher_inputs"] = teacher_inputs
        return batch


def teacher_view(batch: dict, name: str) -> dict:
    """Teacher `name`'s inputs in a `DistillCollator` batch: its own (`teacher_inputs[name]`: another
    tokenizer, its own rationale or rewritten text), else the student's."""
    return batch.get("teacher_inputs", {}).get(name, batch)
