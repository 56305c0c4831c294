"""Dataset formats: which one a dataset is, its records, and a conversation's text with its learned spans.

Four formats (TRL's, plus the GSM8K preset this project started from); docs/data.md defines each one's
segments:

    question_answer    {"question", "answer"}: answer = rationale + "#### <final>" (GSM8K; a field_map renames)
    messages           {"messages": [{"role", "content"}, ...]}: LM loss on the assistant turns
    prompt_completion  {"prompt", "completion"}: strings (standard) or message lists (conversational)
    text               {"text"}: LM loss on every token

A conversation is rendered twice: by a reader's chat template, and as the *plain rendering*
(`"User: ...\\nAssistant: ..."` lines) that a reader without a chat template gets. The plain rendering
is also the coordinate system every reader shares: a chat template's rendering says where each message's
content sits in it, so two tokenizers with different templates pair tokens by the characters of the content.
Pure Python (no torch): `kvdistill.data` turns the spans into tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvdistill import fields as token_fields
from kvdistill.config import UserError

QUESTION_ANSWER, MESSAGES, PROMPT_COMPLETION, TEXT = "question_answer", "messages", "prompt_completion", "text"
# auto-detection tries them in this order: question/answer first, so every dataset that loaded before
# the other formats existed still loads as it did
FORMATS = (QUESTION_ANSWER, MESSAGES, PROMPT_COMPLETION, TEXT)
DATASET_FORMATS = ("auto", *FORMATS)
COLUMNS: dict[str, tuple[str, ...]] = {
    QUESTION_ANSWER: ("question", "answer"),
    MESSAGES: ("messages",),
    PROMPT_COMPLETION: ("prompt", "completion"),
    TEXT: ("text",),
}
LEARNED = {  # what the LM loss learns, for `describe_format`
    QUESTION_ANSWER: "the answer (rationale = reasoning, '#### <final>' = answer segment)",
    MESSAGES: "the assistant turns (answer segment)",
    PROMPT_COMPLETION: "the completion (answer segment)",
    TEXT: "every token (answer segment)",
}
# stands in for one message's content to find where a chat template puts it; no template writes it
_SENTINEL = "KVDISTILL_CONTENT_SENTINEL_3f9a"

Message = tuple[str, str]  # (role, content): a tuple, so a record stays hashable (the collator caches by it)


class DataError(UserError, ValueError):
    """Bad data input; the message names the problem and the fix."""


def row_fields(where: str, row: Mapping[str, Any]) -> dict:
    """`{token_fields: frozen}` of a row that has per-token fields (`fields.py`), else `{}`; a bad one is a
    DataError naming the field and span."""
    if row.get(token_fields.FIELD_KEY) is None:
        return {}
    try:
        return {token_fields.FIELD_KEY: token_fields.freeze(row[token_fields.FIELD_KEY], where)}
    except ValueError as err:
        raise DataError(str(err)) from None


def accepted() -> str:
    """The formats and their columns, as error messages name them."""
    return "; ".join(f"{f} ({', '.join(COLUMNS[f])})" for f in FORMATS)


# ----------------------------------------------------------------------------- detection


def detect_format(columns: Sequence[str], source: str, dataset_format: str = "auto",
                  field_map: Mapping[str, str] | None = None) -> tuple[str, dict[str, str]]:
    """The format of a dataset with `columns`, and its column map `{our name: their column}`.

    `dataset_format` other than "auto" names the format; else a `field_map` names it by its keys (a
    question/answer map, or e.g. `{"messages": "conversations"}`); else the first format of `FORMATS`
    whose columns the dataset has. A dataset that fits none is a `DataError` naming its columns.
    """
    if dataset_format not in DATASET_FORMATS:
        raise DataError(f"dataset_format {dataset_format!r} is not one of {DATASET_FORMATS}")
    if field_map:
        fits = [f for f in FORMATS if set(field_map) <= set(COLUMNS[f])]
        if not fits or dataset_format not in ("auto", fits[0]):
            raise DataError(f"field_map keys {sorted(field_map)} do not name the columns of "
                            f"{'a dataset format' if dataset_format == 'auto' else dataset_format}; "
                            f"the formats read {accepted()}")
        fmt = fits[0]
        # a question/answer map is given whole (today's meaning); another format's keeps its unmapped columns
        return fmt, dict(field_map) if fmt == QUESTION_ANSWER else {**{c: c for c in COLUMNS[fmt]}, **field_map}
    if dataset_format == "auto":
        fits = [f for f in FORMATS if set(COLUMNS[f]) <= set(columns)]
        if not fits:
            raise DataError(f"{source} has columns {sorted(columns)}, which fit no dataset format; give it the "
                            f"columns of one: {accepted()} (or rename them with a field_map)")
        dataset_format = fits[0]
    return dataset_format, {c: c for c in COLUMNS[dataset_format]}


def record_format(record: Mapping[str, Any]) -> str:
    """The format of one loaded record, read from its keys in the order of `FORMATS`."""
    for fmt in FORMATS:
        if all(c in record for c in COLUMNS[fmt]):
            return fmt
    raise DataError(f"a record with keys {sorted(record)} fits no dataset format; the formats read {accepted()}")


def is_conversational(record: Mapping[str, Any]) -> bool:
    """A record read through chat templates: messages, or prompt/completion given as message lists."""
    return "messages" in record or isinstance(record.get("prompt"), tuple)


def describe_format(records: Sequence[Mapping[str, Any]], source: str = "data") -> str:
    """One line saying what format `records` are in and what the LM loss learns of them (logged at start)."""
    if not records:
        return f"{source}: no records"
    fmt = record_format(records[0])
    kind = ""
    if fmt == PROMPT_COMPLETION:
        kind = " conversational" if is_conversational(records[0]) else " standard"
    if fmt in (MESSAGES, PROMPT_COMPLETION) and is_conversational(records[0]):
        reads = "each reader's chat template ('Role: content' lines for one without)"
    elif fmt == QUESTION_ANSWER:
        reads = "prompt_template (or the chat template under use_chat_template)"
    else:
        reads = "the text as given"
    return f"{source}: {len(records)} records, format{kind} {fmt} (read through {reads}); LM loss on {LEARNED[fmt]}"


# ----------------------------------------------------------------------------- records


def to_record(where: str, row: Mapping[str, Any], fmt: str, fmap: Mapping[str, str]) -> dict[str, Any]:
    """One checked record of a messages / prompt_completion / text row, `{our column: value}`; message
    lists become tuples of `(role, content)` so the record stays hashable."""
    for theirs in fmap.values():
        if row.get(theirs) is None:
            raise DataError(f"{where} has no {theirs!r} value; give every record one (or remove that record)")
    value = {ours: row[theirs] for ours, theirs in fmap.items()}
    if row.get(token_fields.FIELD_KEY) is not None and not (fmt == PROMPT_COMPLETION and isinstance(value["prompt"], str)):
        raise DataError(f"{where} has token_fields: they are character spans of a question or of a standard "
                        f"prompt, which a {fmt} record has none of; drop the column or use one of those formats")
    if fmt == MESSAGES:
        msgs = messages_of(value["messages"], where, fmap["messages"])
        learned = [i for i, (role, _) in enumerate(msgs) if role == "assistant"]
        if not learned:
            raise DataError(f"{where}: its {fmap['messages']!r} has no assistant message, so nothing would be "
                            "learned; give every conversation an assistant turn (or remove that record)")
        empty = [i for i in learned if not msgs[i][1].strip()]
        if empty:
            raise DataError(f"{where}: assistant message {empty[0]} of {fmap['messages']!r} is empty; give it "
                            "content (or remove that record)")
        return {"messages": msgs}
    if fmt == PROMPT_COMPLETION:
        prompt, completion = value["prompt"], value["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion.strip():
                raise DataError(f"{where} has an empty {fmap['completion']!r}; give every record a completion "
                                "(or remove that record)")
            return {"prompt": prompt, "completion": completion, **row_fields(where, row)}  # spans of the prompt
        if isinstance(prompt, str) or isinstance(completion, str):
            raise DataError(f"{where}: {fmap['prompt']!r} and {fmap['completion']!r} must both be strings "
                            "(standard) or both lists of {role, content} messages (conversational)")
        out = {"prompt": messages_of(prompt, where, fmap["prompt"]),
               "completion": messages_of(completion, where, fmap["completion"])}
        if not any(c.strip() for _, c in out["completion"]):
            raise DataError(f"{where} has an empty {fmap['completion']!r}; give every record a completion")
        return out
    text = value["text"]
    if not isinstance(text, str) or not text.strip():
        raise DataError(f"{where}: its {fmap['text']!r} is {'empty' if isinstance(text, str) else 'not a string'}; "
                        "give every record a text (or remove that record)")
    return {"text": text}


def messages_of(value: Any, where: str, column: str) -> tuple[Message, ...]:
    """`[{"role", "content"}, ...]` (other keys dropped) as `((role, content), ...)`; already-converted
    tuples pass through."""
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where}: its {column!r} is not a non-empty list of {{role, content}} messages")
    out = []
    for i, m in enumerate(value):
        role, content = (m.get("role"), m.get("content")) if isinstance(m, Mapping) else (
            tuple(m) if isinstance(m, (list, tuple)) and len(m) == 2 else (None, None))
        if not isinstance(role, str) or not isinstance(content, str):
            raise DataError(f"{where}: message {i} of its {column!r} ({str(m)[:60]}) has no string role and "
                            "content; write each message as {\"role\": \"user\", \"content\": \"...\"}")
        out.append((role, content))
    return tuple(out)


def conversation(record: Mapping[str, Any]) -> tuple[tuple[Message, ...], tuple[bool, ...]]:
    """A conversational record's messages and which of them are learned: a messages record's assistant
    turns, a conversational prompt/completion's completion. Messages after the last learned one are dropped:
    nothing after them is learned, and causal attention makes them no context for what is."""
    if "messages" in record:
        msgs = messages_of(record["messages"], "record", "messages")
        learned = tuple(role == "assistant" for role, _ in msgs)
    else:
        prompt = messages_of(record["prompt"], "record", "prompt")
        msgs = prompt + messages_of(record["completion"], "record", "completion")
        learned = tuple(i >= len(prompt) for i in range(len(msgs)))
    last = max(i for i, x in enumerate(learned) if x)
    return msgs[: last + 1], learned[: last + 1]


# ----------------------------------------------------------------------------- rendering


@dataclass(frozen=True)
class Rendering:
    """A conversation as one reader's text.

    `learned` are the character spans of `text` the LM loss learns (each learned message's content and
    what ends its turn). `shared`, for a chat template's text, is `(start, end, plain_start)` per message:
    `text[start:end]` is `plain[plain_start : plain_start + end - start]` of the plain rendering; None when
    `text` is the plain rendering itself.
    """

    text: str
    learned: tuple[tuple[int, int], ...]
    shared: tuple[tuple[int, int, int], ...] | None = None


def role_header(role: str) -> str:
    """`"User: "`: what precedes a message's content in the plain rendering."""
    return f"{role[:1].upper()}{role[1:]}: "


def render_plain(messages: Sequence[Message], learned: Sequence[bool]) -> tuple[Rendering, list[int]]:
    """The plain rendering `"User: hi\\nAssistant: hello\\nUser: ..."` and where each content starts.

    A learned message learns its content and the newline that ends its turn (the last one's end is the
    EOS the tokenizer appends); the role headers read as prompt.
    """
    parts, starts, spans, pos = [], [], [], 0
    for i, ((role, content), learn) in enumerate(zip(messages, learned)):
        start = pos + len(role_header(role))
        starts.append(start)
        if learn:
            spans.append((start, start + len(content) + (i < len(messages) - 1)))
        parts.append(role_header(role) + content)
        pos += len(parts[-1]) + 1
    return Rendering("\n".join(parts), tuple(spans)), starts


def render_chat(tokenizer: Any, messages: Sequence[Message], learned: Sequence[bool]) -> Rendering:
    """`messages` through `tokenizer`'s chat template, with the learned spans and the shared characters.

    Each message's content is located by rendering the conversation again with that content replaced by a
    sentinel (what a template writes before a message does not depend on its content), and checked
    verbatim (or stripped: some templates trim). A learned message also learns the template's end of its
    turn (`<|im_end|>`) when the template renders conversations prefix-consistently, so the student learns
    to stop; else only its content.
    """
    chat = [{"role": r, "content": c} for r, c in messages]
    full = apply_template(tokenizer, chat)
    plain_starts = render_plain(messages, learned)[1]
    shared, spans = [], []
    for k, ((role, content), learn) in enumerate(zip(messages, learned)):
        at = apply_template(tokenizer, [*chat[:k], {"role": role, "content": _SENTINEL}, *chat[k + 1:]]).find(_SENTINEL)
        body, skip = content, 0
        if at >= 0 and not full.startswith(body, at):
            body, skip = content.strip(), len(content) - len(content.lstrip())
        if at < 0 or not body or not full.startswith(body, at):
            if learn:
                raise DataError(f"the chat template of {name_of(tokenizer)} does not write {role} message {k} "
                                "as given, so its tokens cannot be learned or paired with another reader's; use "
                                "a tokenizer whose template keeps message content verbatim")
            continue  # the template rewrote it (or it is empty): none of its characters are shared
        shared.append((at, at + len(body), plain_starts[k] + skip))
        if learn:
            end = at + len(body)
            turn = apply_template(tokenizer, chat[: k + 1]).rstrip()  # the conversation up to this turn's end
            if full.startswith(turn) and len(turn) > end:
                end = len(turn)
            spans.append((at, end))
    # the trailing newline after the last end-of-turn teaches nothing: the tokenizer's EOS ends the text
    text = full[: max(len(full.rstrip()), spans[-1][1])]
    return Rendering(text, tuple(spans), tuple(shared))


def apply_template(tokenizer: Any, chat: list[dict[str, str]]) -> str:
    try:
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
    except Exception as err:  # jinja raises its own types (e.g. a template that wants alternating roles)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"the chat template of {name_of(tokenizer)} refuses a conversation with roles "
                        f"{[m['role'] for m in chat]}: {first}") from None


def name_of(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
