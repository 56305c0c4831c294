"""`kvdistill eval`: GSM8K-style accuracy and held-out perplexity of any HF causal LM.

Accuracy: batched greedy generation (left padding, so every prompt ends at the same column
and the new tokens start together), stopped per row on EOS or on a stop string (the next
`\\nQuestion:` of the prompt template), then answer extraction (`#### n`, else the last
number) and exact match against the gold `#### n`, with a Wilson 95 % interval.

Perplexity: CE over the reference rationale + answer tokens given the prompt, tokenised
exactly as in training (`kvdistill.data.tokenize_example`: same template, same EOS), so a
student's held-out perplexity is comparable with its training CE.

Example:
    kvdistill eval --model runs/student --data synthetic --limit 200 --out runs/student/eval
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from kvdistill.data import DEFAULT_TEMPLATE, format_prompt, load_records, pad_batch, tokenize_example
from kvdistill.evaluate.answers import extract_answer, gold_answer, is_correct
from kvdistill.evaluate.stats import wilson_interval

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


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    gen_cfg = getattr(model, "generation_config", None)
    for value in (getattr(gen_cfg, "eos_token_id", None), tokenizer.eos_token_id):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    return ids


def _model_device(model: Any) -> torch.device:
    device = getattr(model, "device", None)
    if device is not None:
        return torch.device(device)
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


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
    device = _model_device(model)
    eos = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        # disable=None: a bar on a terminal only, so logs of batch jobs stay clean
        bar = tqdm(
            total=len(prompts), desc="generate", unit="q", disable=None if progress is None else not progress
        )
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            enc = tokenizer(
                [prompts[i] for i in idx],
                return_tensors="pt",
                padding=True,
                add_special_tokens=add_special_tokens,
            ).to(device)
            prompt_len = enc["input_ids"].shape[1]
            stopping = StoppingCriteriaList([StopOnStrings(tokenizer, stop_strings, prompt_len)])
            generated = model.generate(
                input_ids=enc["input_ids"],  # [B, T_prompt], left-padded
                attention_mask=enc["attention_mask"],
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                pad_token_id=pad_id,
                eos_token_id=eos or None,
                stopping_criteria=stopping,
            )  # [B, T_prompt + T_new]
            texts = tokenizer.batch_decode(generated[:, prompt_len:], skip_special_tokens=True)
            for i, text in zip(idx, texts):
                out[i] = truncate_at_stop(text, stop_strings)
            bar.update(len(idx))
        bar.close()
    finally:
        tokenizer.padding_side = side
    return out


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
) -> dict[str, float]:
    """Perplexity of the reference rationale + answer (+ EOS) given the prompt.

    Tokenised as in training (`labels` = -100 on the prompt), summed over all target tokens
    of all records and divided by their count: `exp(total NLL / total tokens)`.

    Returns:
        `{"perplexity", "nll" (mean per token), "tokens"}`.
    """
    device = _model_device(model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    total_nll, total_tokens = 0.0, 0
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
    mean = total_nll / max(total_tokens, 1)
    return {"perplexity": math.exp(min(mean, 700.0)), "nll": mean, "tokens": total_tokens}


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
    max_length: int = 512,
    progress: bool | None = None,
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

    Returns:
        the summary dict (`accuracy, ci_low, ci_high, n, n_correct, n_no_answer, perplexity,
        nll, target_tokens, chat_template, ...`) with the per-item rows under `"items"`.
    """
    if hasattr(model, "eval"):
        model.eval()
    chat = use_chat(tokenizer, chat_template)
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
    ppl: dict[str, float | None] = {"perplexity": None, "nll": None, "tokens": None}
    if perplexity and records:
        ppl = reference_perplexity(
            model,
            tokenizer,
            records,
            batch_size=batch_size,
            template=template,
            use_chat_template=chat,
            max_length=max_length,
        )
    summary.update(
        {
            "perplexity": ppl["perplexity"],
            "nll": ppl["nll"],
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


def write_text_atomic(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file and a rename: a killed run never leaves half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    return tmp.replace(path)


def write_results(result: Mapping[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """Write `items.jsonl` (one row per question) and `summary.json` (everything else).

    `summary.json` is written last, so its presence marks a finished evaluation.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items_path, summary_path = out / "items.jsonl", out / "summary.json"
    with items_path.open("w", encoding="utf-8") as fh:
        for row in result.get("items", []):
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    summary = {k: v for k, v in result.items() if k != "items"}
    write_text_atomic(summary_path, json.dumps(summary, indent=2, ensure_ascii=False))
    return items_path, summary_path


def read_items(out_dir: str | Path) -> list[dict]:
    """The per-item rows written by `write_results`."""
    with (Path(out_dir) / "items.jsonl").open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


# ----------------------------------------------------------------------------- model dirs


def resolve_model_dir(path: str | Path) -> str:
    """Where the HF weights of `path` are: the dir itself, its `student/`, or its latest checkpoint.

    A kvdistill run dir holds the final student at top level; a run still in progress only has
    `checkpoint-N/` dirs. Hub ids and plain model dirs are returned unchanged.
    """
    p = Path(path)
    if not p.is_dir() or (p / "config.json").exists():
        return str(path)
    if (p / "student" / "config.json").exists():
        return str(p / "student")
    ckpts = sorted(
        (c for c in p.glob("checkpoint-*") if c.name.split("-")[-1].isdigit()),
        key=lambda c: int(c.name.split("-")[-1]),
    )
    for c in reversed(ckpts):
        for cand in (c / "student", c):
            if (cand / "config.json").exists():
                return str(cand)
    return str(path)


def _tokenizer_dir(model_dir: str) -> str:
    """The model dir if it holds a tokenizer, else the nearest parent that does (run dir)."""
    p = Path(model_dir)
    if not p.is_dir():
        return model_dir
    for cand in (p, *p.parents[:2]):
        if any((cand / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
            return str(cand)
    return model_dir


def training_prompt_settings(model_dir: str | Path) -> dict[str, Any] | None:
    """`{"template", "chat_template"}` a kvdistill run was trained with (its `kvdistill_config.yaml`).

    Looked up in the model dir and its parent (a `checkpoint-N/` of a run); `None` for any
    other model, which then gets the defaults.
    """
    p = Path(model_dir)
    if not p.is_dir():
        return None
    for cand in (p, p.parent):
        cfg_path = cand / "kvdistill_config.yaml"
        if cfg_path.exists():
            import yaml

            cfg = yaml.safe_load(cfg_path.read_text()) or {}
            return {
                "template": cfg.get("prompt_template") or DEFAULT_TEMPLATE,
                # training falls back to the plain template when the tokenizer has no chat template
                "chat_template": "auto" if cfg.get("use_chat_template") else "off",
            }
    return None


def run_eval(
    model_path: str | Path,
    *,
    data: str = "synthetic",
    split: str = "test",
    field_map: Any = None,
    limit: int | None = None,
    out: str | Path | None = None,
    dtype: str = "auto",
    device: str | None = None,
    log: Callable[[str], None] = print,
    **kwargs: Any,
) -> dict[str, Any]:
    """Load a model (Hub id, model dir or kvdistill run dir) and data, evaluate, write to `out`.

    `kwargs` go to `evaluate_model` (batch_size, max_new_tokens, template, chat_template, ...).
    `template` / `chat_template` left out (or None) come from the run's training config when
    `model_path` is a kvdistill run, else the defaults (plain template, chat template if any).
    """
    from kvdistill.models import load_model, load_tokenizer

    model_dir = resolve_model_dir(model_path)
    trained = training_prompt_settings(model_dir) or {}
    for key in ("template", "chat_template"):
        if kwargs.get(key) is None:
            kwargs.pop(key, None)
            if key in trained:
                kwargs[key] = trained[key]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(_tokenizer_dir(model_dir))
    model = load_model(model_dir, dtype=dtype, device=device)
    records = load_records(data, split=split, field_map=field_map, limit=limit)
    log(f"eval: {model_dir} on {data}:{split} ({len(records)} questions, device {device})")
    result = evaluate_model(model, tokenizer, records, **kwargs)
    result.update(
        {
            "model": str(model_path),
            "model_dir": model_dir,
            "data": str(data),
            "split": split,
            "limit": limit,
            "dtype": dtype,
            "device": str(device),
        }
    )
    if out is not None:
        items_path, summary_path = write_results(result, out)
        log(f"wrote {items_path} and {summary_path}")
    return result


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvdistill eval",
        description="GSM8K-style accuracy (greedy, #### / last-number extraction, Wilson 95% CI) and "
        "reference perplexity of a causal LM.",
    )
    p.add_argument("--model", required=True, help="Hub id, local model dir, or kvdistill run/checkpoint dir")
    p.add_argument(
        "--data", default="synthetic", help="Hub id, local jsonl/json/parquet file or dir, or 'synthetic'"
    )
    p.add_argument("--split", default="test", help="dataset split (default: test)")
    p.add_argument(
        "--field-map",
        default=None,
        help='column map: a name (gsm8k, svamp, math) or JSON {"question": col, "answer": col}',
    )
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N questions")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generation batch")
    p.add_argument("--max-new-tokens", type=int, default=256, help="generation budget per question")
    p.add_argument(
        "--template",
        default=None,
        help="prompt template with {question}; default: the training template of a kvdistill run, else "
        + repr(DEFAULT_TEMPLATE),
    )
    p.add_argument(
        "--chat-template",
        choices=CHAT_MODES,
        default=None,
        help="use the tokenizer's chat template: auto (if it has one), on, off; default: as the kvdistill "
        "run was trained, else auto",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=None,
        help="stop string (repeatable); default: newline + the template text before {question}",
    )
    p.add_argument("--no-perplexity", action="store_true", help="skip the reference perplexity")
    p.add_argument("--max-length", type=int, default=512, help="token limit of the perplexity examples")
    p.add_argument("--dtype", default="auto", help="auto | fp32 | bf16 | fp16")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--out", default=None, help="write DIR/items.jsonl and DIR/summary.json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    field_map = a.field_map
    if field_map and field_map.strip().startswith("{"):
        field_map = json.loads(field_map)
    result = run_eval(
        a.model,
        data=a.data,
        split=a.split,
        field_map=field_map,
        limit=a.limit,
        out=a.out,
        dtype=a.dtype,
        device=a.device,
        batch_size=a.batch_size,
        max_new_tokens=a.max_new_tokens,
        template=a.template,
        chat_template=a.chat_template,
        stop_strings=a.stop,
        perplexity=not a.no_perplexity,
        max_length=a.max_length,
        progress=False if a.no_progress else None,
    )
    ppl = result["perplexity"]
    print(
        f"accuracy {result['accuracy']:.4f} ({result['n_correct']}/{result['n']}), "
        f"95% CI [{result['ci_low']:.4f}, {result['ci_high']:.4f}]"
        + (f", perplexity {ppl:.3f}" if ppl is not None else "")
    )
    return 0
