"""Scoring a causal LM: GSM8K-style accuracy, answer NLL and held-out perplexity (used by `kvdistill eval`).

Accuracy: batched greedy generation (left padding, so every prompt ends at the same column
and the new tokens start together), stopped per row on EOS or on a stop string (the next
`\\nQuestion:` of the prompt template), then answer extraction (`#### n`, else the last
number) and exact match against the gold `#### n`, with a Wilson 95 % interval.

Perplexity: CE over the reference rationale + answer tokens given the prompt, tokenised
exactly as in training (`kvdistill.data.tokenize_example`: same template, same EOS), so a
student's held-out perplexity is comparable with its training CE.

Answer NLL (a continuous companion of exact match): the gold final answer's negative
log-likelihood, teacher-forced after the prompt and the model's *own* greedy rationale, i.e. of
the gold tokens in `prompt + " " + rationale + "\n#### " + gold` (the training format), where
`rationale` is the generated text before its first `####` (all of it when it has none; nothing
when the model went straight to `####`, giving `prompt + "\n#### " + gold`). Summed over the
tokens that hold a character of `gold` (a `" 42"` token counts; EOS does not), in nats.

Example:
    >>> result = evaluate_model(model, tokenizer, records, batch_size=16)
    >>> result["accuracy"], result["perplexity"]
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from kvdistill.cache import takes_logits_to_keep
from kvdistill.data import (
    ANSWER_MARKER,
    DEFAULT_TEMPLATE,
    DataError,
    format_prompt,
    has_finals,
    pad_batch,
    record_format,
    split_answer,
    tokenize_example,
)
from kvdistill.evaluate.answers import extract_answer, gold_answer, is_correct
from kvdistill.evaluate.stats import wilson_interval
from kvdistill.io import write_json_atomic, write_text_atomic
from kvdistill.models import max_positions, model_device

CHAT_MODES = ("auto", "on", "off")


# ----------------------------------------------------------------------------- helpers


def default_stop_strings(template: str = DEFAULT_TEMPLATE) -> list[str]:
    """Stop where the model starts the next question: `"\\n" + <template text before {question}>`.

    `"Question: {question}\\nAnswer:"` gives `["\\nQuestion:"]`; a template with nothing before
    the question gives no stop string (EOS and `max_new_tokens` still stop generation).
    """
    head = template.split("{question}", 1)[0].strip()
    return [f"\n{head}"] if head else []


def truncate_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """Cut `text` at the earliest stop string (the stop string itself is dropped)."""
    cut = len(text)
    for s in stop_strings:
        if s and (i := text.find(s)) != -1:
            cut = min(cut, i)
    return text[:cut]


def use_chat(tokenizer: Any, mode: str) -> bool:
    """Resolve `--chat-template auto|on|off` against what the tokenizer has."""
    if mode not in CHAT_MODES:
        raise ValueError(f"chat_template must be one of {CHAT_MODES}, got {mode!r}")
    has = bool(getattr(tokenizer, "chat_template", None))
    if mode == "on" and not has:
        raise ValueError("--chat-template on, but the tokenizer has no chat template; use auto or off")
    return has if mode == "auto" else mode == "on"


class StopOnStrings(StoppingCriteria):
    """Per-row stop once the generated text (after `prompt_len`) contains a stop string.

    Only the last few tokens are decoded each step (enough to hold the longest stop string),
    so the cost stays linear in the generation length.
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str], prompt_len: int) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.prompt_len = prompt_len
        self.window = max((len(s) for s in self.stop_strings), default=0) + 4

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs: Any) -> Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # [B]
        if not self.stop_strings:
            return done
        start = max(self.prompt_len, input_ids.shape[1] - self.window)
        tails = self.tokenizer.batch_decode(input_ids[:, start:], skip_special_tokens=True)
        for i, tail in enumerate(tails):
            done[i] = any(s in tail for s in self.stop_strings)
        return done


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids that end a generation: the model's generation config's EOS id(s), then the tokenizer's."""
    ids: list[int] = []
    gen_cfg = getattr(model, "generation_config", None)
    for value in (getattr(gen_cfg, "eos_token_id", None), tokenizer.eos_token_id):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    return ids


# ----------------------------------------------------------------------------- generation


@torch.no_grad()
def generate_completions(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    batch_size: int = 8,
    max_new_tokens: int = 256,
    stop_strings: Sequence[str] = (),
    add_special_tokens: bool = True,
    progress: bool | None = None,
) -> list[str]:
    """Greedy completions of `prompts`, cut at the first stop string.

    Prompts are sorted by length so each batch pads little, left-padded so generation starts
    in the same column for every row, and returned in the input order.

    Args:
        model: anything with HF `generate(input_ids, attention_mask, ...)`.
        tokenizer: the model's tokenizer (its padding side is restored afterwards).
        prompts: `[N]` prompt strings (already formatted, chat template included).
        add_special_tokens: False when the prompt text already holds them (chat template).
        progress: tqdm bar (None: only on a terminal).
    """
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out: list[str] = [""] * len(prompts)
    # disable=None: a bar on a terminal only, so logs of batch jobs stay clean
    bar = tqdm(total=len(prompts), desc="generate", unit="q", disable=None if progress is None else not progress)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        new = generate_batch(model, tokenizer, [prompts[i] for i in idx], max_new_tokens=max_new_tokens,
                             add_special_tokens=add_special_tokens, stop_strings=stop_strings,
                             do_sample=False, num_beams=1)
        texts = tokenizer.batch_decode(new, skip_special_tokens=True)
        for i, text in zip(idx, texts):
            out[i] = truncate_at_stop(text, stop_strings)
        bar.update(len(idx))
    bar.close()
    return out


def generate_batch(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    add_special_tokens: bool = True,
    stop_strings: Sequence[str] = (),
    **generate_kwargs: Any,
) -> Tensor:
    """One batch of prompts through HF `generate`; returns only the new tokens `[B, T_new]`.

    Prompts are left-padded (every row's new tokens start in the same column; the tokenizer's
    padding side is restored afterwards). Rows that stop early (EOS, a stop string) are filled
    with the pad id after their end. `generate_kwargs` go to `generate` as they are (greedy:
    `do_sample=False`; sampling: `do_sample=True, temperature=..., top_p=...`).
    """
    eos = eos_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(list(prompts), return_tensors="pt", padding=True, add_special_tokens=add_special_tokens)
    finally:
        tokenizer.padding_side = side
    enc = enc.to(model_device(model))
    prompt_len = enc["input_ids"].shape[1]
    generated = model.generate(
        input_ids=enc["input_ids"],  # [B, T_prompt], left-padded
        attention_mask=enc["attention_mask"],
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=eos or None,
        stopping_criteria=StoppingCriteriaList([StopOnStrings(tokenizer, stop_strings, prompt_len)]),
        **generate_kwargs,
    )  # [B, T_prompt + T_new]
    return generated[:, prompt_len:]


# ----------------------------------------------------------------------------- perplexity


@torch.no_grad()
def reference_perplexity(
    model: Any,
    tokenizer: Any,
    records: Sequence[Mapping[str, Any]],
    *,
    batch_size: int = 8,
    template: str = DEFAULT_TEMPLATE,
    use_chat_template: bool = False,
    max_length: int = 512,
    teacher: Any = None,
) -> dict[str, float | None]:
    """Perplexity of the reference rationale + answer (+ EOS) given the prompt.

    Tokenised as in training (`labels` = -100 on the prompt), summed over all target tokens
    of all records and divided by their count: `exp(total NLL / total tokens)`. With `teacher`
    (a model of the same tokenizer), also KL(teacher ‖ model) of the next-token distributions at the
    same positions, summed over the vocabulary, mean per target token.

    Returns:
        `{"perplexity", "nll" (mean per token), "tokens", "kl_to_teacher" (None without a teacher)}`.
    """
    device = model_device(model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    n_vocab = len(tokenizer)  # head rows past it are padding: neither model ever predicts them
    total_nll, total_kl, total_tokens = 0.0, 0.0, 0
    for start in range(0, len(records), batch_size):
        feats = [
            tokenize_example(
                tokenizer, r, max_length=max_length, template=template, use_chat_template=use_chat_template
            )
            for r in records[start : start + batch_size]
        ]
        batch = pad_batch(feats, pad_id)  # [B, T], right-padded
        logits = model(
            input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
        ).logits.float()  # [B, T, V]
        labels = batch["labels"].to(device)[:, 1:]  # [B, T-1]: token t+1 is predicted at t
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        total_nll += float(nll)
        total_tokens += int((labels != -100).sum())
        if teacher is not None:
            t_logits = teacher(input_ids=batch["input_ids"].to(device),
                               attention_mask=batch["attention_mask"].to(device)).logits.float()  # [B, T, V_t]
            log_s = logits[:, :-1, :n_vocab].log_softmax(-1)  # [B, T-1, V]
            log_t = t_logits[:, :-1, :n_vocab].log_softmax(-1)
            kl = torch.nn.functional.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1)  # [B, T-1]
            total_kl += float(kl[labels != -100].sum())
    mean = total_nll / max(total_tokens, 1)
    return {"perplexity": math.exp(min(mean, 700.0)), "nll": mean, "tokens": total_tokens,
            "kl_to_teacher": total_kl / max(total_tokens, 1) if teacher is not None else None}


# ----------------------------------------------------------------------------- answer NLL


def answer_context(prompt: str, completion: str) -> str:
    """The text the gold answer is scored after: `prompt + " " + rationale + "\n#### "`.

    `rationale` is the completion before its first `####` (the whole completion when it has
    none), stripped; an empty one leaves `prompt + "\n#### "`, as training formats a record
    without rationale (`kvdistill.data.format_example`).
    """
    rationale = completion.split(ANSWER_MARKER, 1)[0].strip()
    return f"{prompt}{' ' + rationale if rationale else ''}\n{ANSWER_MARKER} "


@torch.no_grad()
def gold_answer_nll(
    model: Any,
    tokenizer: Any,
    contexts: Sequence[str],
    answers: Sequence[str],
    *,
    batch_size: int = 8,
    add_special_tokens: bool = True,
) -> list[tuple[float, int]]:
    """Teacher-forced NLL of each `answers[i]` right after `contexts[i]`, one forward per batch.

    The pair is tokenised as one text (so `"#### " + "42"` gives the tokens the model would
    write); a token is an answer token when its last character lies in the answer. A text
    longer than the model's positions keeps its last tokens. Rows are left-padded (explicit
    position ids), so every answer ends in the last column and only the last `k + 1` positions
    go through the LM head (`logits_to_keep`): `[B, k + 1, V]` logits, not `[B, T, V]`.

    Returns:
        `[N]` pairs `(nll, tokens)`: nats summed over the answer tokens, and their count.
    """
    if len(contexts) != len(answers):
        raise ValueError(f"{len(contexts)} contexts but {len(answers)} answers")
    device = model_device(model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    limit = max_positions(model) if hasattr(model, "config") else None
    cut = takes_logits_to_keep(model)  # older/remote-code models: all logits
    out: list[tuple[float, int]] = []
    for start in range(0, len(contexts), batch_size):
        ctx, ans = contexts[start : start + batch_size], answers[start : start + batch_size]
        enc = tokenizer([c + a for c, a in zip(ctx, ans)], add_special_tokens=add_special_tokens,
                        return_offsets_mapping=True)
        rows, targets = [], []
        for ids, offsets, c in zip(enc["input_ids"], enc["offset_mapping"], ctx):
            # last character (end - 1) inside the answer; special tokens have empty spans
            is_answer = [e > len(c) and e > s for s, e in offsets]
            ids, is_answer = ids[-limit:] if limit else ids, is_answer[-limit:] if limit else is_answer
            rows.append(torch.tensor(ids))
            targets.append(torch.where(torch.tensor(is_answer, dtype=torch.bool), torch.tensor(ids), -100))
        pad = dict(batch_first=True, padding_side="left")
        input_ids = torch.nn.utils.rnn.pad_sequence(rows, padding_value=pad_id, **pad)  # [B, T]
        labels = torch.nn.utils.rnn.pad_sequence(targets, padding_value=-100, **pad)  # [B, T]
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(r), dtype=torch.long) for r in rows], **pad)  # [B, T]
        positions = (mask.cumsum(1) - 1).clamp(min=0)  # [B, T]: each text starts at position 0
        keep = int((labels != -100).sum(1).max()) + 1  # the answer tokens and the position before them
        tail = {"logits_to_keep": keep} if cut else {}
        logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                       position_ids=positions.to(device), **tail).logits[:, -keep:].float()  # [B, keep, V]
        labels = labels.to(device)[:, -keep + 1 :]  # [B, keep-1]: token t+1 is predicted at t
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), labels, ignore_index=-100, reduction="none"
        )  # [B, keep-1], 0 where ignored
        out += [(float(v), int(n)) for v, n in zip(nll.sum(1), (labels != -100).sum(1))]
    return out


# ----------------------------------------------------------------------------- scoring


def score_completions(
    records: Sequence[Mapping[str, Any]], completions: Sequence[str]
) -> tuple[list[dict], dict[str, Any]]:
    """Per-item rows and the accuracy summary of `completions` against `records`' gold answers.

    Returns:
        `(items, summary)`: items are `{index, question, gold, prediction, extracted, correct}`;
        summary is `{accuracy, ci_low, ci_high, n, n_correct, n_no_answer}` (Wilson 95 %).
    """
    if len(records) != len(completions):
        raise ValueError(f"{len(records)} records but {len(completions)} completions")
    items = []
    for i, (rec, text) in enumerate(zip(records, completions)):
        gold = gold_answer(str(rec["answer"]))
        extracted = extract_answer(text)
        items.append(
            {
                "index": int(rec.get("index", i)),
                "question": rec["question"],
                "gold": gold,
                "prediction": text,
                "extracted": extracted,
                "correct": is_correct(extracted, gold),
            }
        )
    n = len(items)
    k = sum(it["correct"] for it in items)
    low, high = wilson_interval(k, n)
    summary = {
        "accuracy": k / n if n else math.nan,
        "ci_low": low,
        "ci_high": high,
        "n": n,
        "n_correct": k,
        "n_no_answer": sum(it["extracted"] is None for it in items),
    }
    return items, summary


def evaluate_model(
    model: Any,
    tokenizer: Any,
    records: Sequence[Mapping[str, Any]],
    *,
    batch_size: int = 8,
    max_new_tokens: int = 256,
    template: str = DEFAULT_TEMPLATE,
    chat_template: str = "auto",
    stop_strings: Sequence[str] | None = None,
    perplexity: bool = True,
    answer_nll: bool = False,
    max_length: int = 512,
    progress: bool | None = None,
    teacher: Any = None,
) -> dict[str, Any]:
    """Accuracy (and perplexity) of a loaded model on GSM8K-format `records`.

    Args:
        model: an HF causal LM (or anything with `generate`; `__call__` -> `.logits` for perplexity).
        tokenizer: its tokenizer.
        records: `{"question", "answer"}` dicts (answer = rationale + `#### n`).
        template: prompt template the model was trained with (`{question}` placeholder).
        chat_template: "auto" (use the tokenizer's chat template if it has one), "on", "off".
        stop_strings: cut generation here; default from the template (`"\\nQuestion:"`).
        perplexity: also compute the reference perplexity.
        teacher: a model of the same tokenizer: the perplexity's tokens also give `kl_to_teacher`
            (`reference_perplexity`).
        answer_nll: also score each gold answer's NLL after the model's own rationale
            (`gold_answer_nll`; per item `answer_nll`, `answer_tokens`; summary `answer_nll`, the
            mean over items).

    Returns:
        the summary dict (`accuracy, ci_low, ci_high, n, n_correct, n_no_answer, perplexity,
        nll, target_tokens, chat_template, ...`) with the per-item rows under `"items"`.
    """
    if answer_nll and not getattr(tokenizer, "is_fast", False):  # before generating, not after
        raise DataError(f"{type(tokenizer).__name__} is a slow tokenizer: the answer NLL needs character offsets; "
                        "load it with use_fast=True, or pass --no_answer_nll")
    if hasattr(model, "eval"):
        model.eval()
    chat = use_chat(tokenizer, chat_template)
    if records and not has_finals(records):  # text, conversations, prompt/completion: nothing to generate and score
        return lm_loss_summary(model, tokenizer, records, batch_size=batch_size, template=template, chat=chat,
                               perplexity=perplexity, max_length=max_length, teacher=teacher)
    stops = list(default_stop_strings(template) if stop_strings is None else stop_strings)
    prompts = [format_prompt(str(r["question"]), template, tokenizer if chat else None) for r in records]
    t0 = time.perf_counter()
    completions = generate_completions(
        model,
        tokenizer,
        prompts,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        stop_strings=stops,
        add_special_tokens=not chat,
        progress=progress,
    )
    items, summary = score_completions(records, completions)
    summary["generate_seconds"] = time.perf_counter() - t0
    summary["answer_nll"] = None
    if answer_nll and records:
        scored = gold_answer_nll(
            model,
            tokenizer,
            [answer_context(p, c) for p, c in zip(prompts, completions)],
            [split_answer(str(r["answer"]))[1] for r in records],
            batch_size=batch_size,
            add_special_tokens=not chat,
        )
        for item, (nll, tokens) in zip(items, scored):
            item["answer_nll"], item["answer_tokens"] = nll, tokens
        summary["answer_nll"] = sum(nll for nll, _ in scored) / len(scored)
    ppl: dict[str, float | None] = {"perplexity": None, "nll": None, "tokens": None, "kl_to_teacher": None}
    if perplexity and records:
        ppl = reference_perplexity(
            model,
            tokenizer,
            records,
            batch_size=batch_size,
            template=template,
            use_chat_template=chat,
            max_length=max_length,
            teacher=teacher,
        )
    summary.update(
        {
            "perplexity": ppl["perplexity"],
            "nll": ppl["nll"],
            "kl_to_teacher": ppl["kl_to_teacher"],
            "target_tokens": ppl["tokens"],
            "chat_template": chat,
            "template": template,
            "stop_strings": stops,
            "batch_size": batch_size,
            "max_new_tokens": max_new_tokens,
            "items": items,
        }
    )
    return summary


def lm_loss_summary(model: Any, tokenizer: Any, records: Sequence[Mapping[str, Any]], *, batch_size: int,
                    template: str, chat: bool, perplexity: bool, max_length: int, teacher: Any = None
                    ) -> dict[str, Any]:
    """`evaluate_model`'s summary for records without final answers (text, conversations, prompt/completion):
    the held-out LM loss on what training learns of them (`nll` per target token, `perplexity`); accuracy and
    answer NLL are None (nothing is generated)."""
    if not perplexity:
        raise DataError(f"these are {record_format(records[0])} records, with no final answers to score: the "
                        "held-out LM loss is all an evaluation of them gives; drop --no_perplexity")
    ppl = reference_perplexity(model, tokenizer, records, batch_size=batch_size, template=template,
                               use_chat_template=chat, max_length=max_length, teacher=teacher)
    return {"accuracy": None, "ci_low": None, "ci_high": None, "n": len(records), "n_correct": None,
            "n_no_answer": None, "answer_nll": None, "perplexity": ppl["perplexity"], "nll": ppl["nll"],
            "kl_to_teacher": ppl["kl_to_teacher"],
            "target_tokens": ppl["tokens"], "chat_template": chat, "template": template, "batch_size": batch_size,
            "max_length": max_length, "items": []}


def write_results(result: Mapping[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """Write `items.jsonl` (one row per question) and `summary.json` (everything else).

    `summary.json` is written last, so its presence marks a finished evaluation.
    """
    out = Path(out_dir)
    items_path, summary_path = out / "items.jsonl", out / "summary.json"
    write_text_atomic(items_path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in result.get("items", [])))
    summary = {k: v for k, v in result.items() if k != "items"}
    write_json_atomic(summary_path, summary, indent=2)
    return items_path, summary_path


def read_items(out_dir: str | Path) -> list[dict]:
    """The per-item rows written by `write_results`."""
    with (Path(out_dir) / "items.jsonl").open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
