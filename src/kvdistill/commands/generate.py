"""`kvdistill generate`: a teacher's completions of a question set, written as a transfer set.

Sequence-level KD (Kim & Rush 2016): the student learns from the text the teacher writes, which
works whatever the two tokenizers are. This command samples `n_samples` completions per question
from the teacher (greedy at `temperature: 0`), keeps, when a question has a gold answer, only the
completions whose answer is right (`filter_correct`), and writes them as jsonl rows
`{question, answer, index, sample, correct, gold}`: `answer` is the completion, so the file is read
by `kvdistill train --transfer_data FILE` as it is (the default field map). Train on it with
`transfer_lm_weight > 0` (the student's LM loss on the teacher's text) and/or the teacher signals.

Generation is `kvdistill.evaluate.scoring`'s (left-padded batches through HF `generate`, stop
strings of the prompt template), scoring `score_completions`' exact match.

Example:
    kvdistill generate --model runs/teacher_qwen2 --data data/ --split transfer_questions \\
        --n_samples 4 --temperature 0.7 --output runs/transfer.jsonl
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvdistill.commands.eval import _tokenizer_dir, check_lengths, training_prompt_settings
from kvdistill.config import ConfigError, check_choice, option, parse_config, to_plain
from kvdistill.data import DEFAULT_TEMPLATE, format_prompt, load_records, require_finals
from kvdistill.evaluate.scoring import (
    CHAT_MODES,
    default_stop_strings,
    generate_batch,
    score_completions,
    truncate_at_stop,
    use_chat,
)
from kvdistill.io import write_text_atomic
from kvdistill.runs import resolve_model


@dataclass
class GenerateConfig:
    """Options of `kvdistill generate`."""

    model: str | None = option(None, "The teacher: Hub id, model dir, or kvdistill run/checkpoint dir. Required.")
    data: str | None = option(None, "Questions: Hub id, local jsonl/json/parquet file or dir, or 'synthetic'. "
                              "Required.")
    split: str = option("train", "Dataset split.")
    field_map: str | None = option(None, 'Column map: a name (gsm8k, svamp, math) or {"question": col, "answer": col}.')
    limit: int | None = option(None, "Only the first N questions.")
    output: str | None = option(None, "The transfer set to write (jsonl). Required.", aliases=["--out"])
    n_samples: int = option(1, "Completions per question (> 1 needs temperature > 0).")
    temperature: float = option(0.0, "Sampling temperature; 0: greedy.")
    top_p: float = option(1.0, "Nucleus sampling: keep the smallest token set of this probability.")
    max_new_tokens: int = option(256, "Generation budget per completion.")
    batch_size: int = option(8, "Questions per generation batch.")
    filter_correct: bool = option(True, "Keep only completions whose answer matches the question's gold answer "
                                  "(questions without one keep every completion).")
    template: str | None = option(None, "Prompt template with {question}; default: the training template of a "
                                  f"kvdistill run, else {DEFAULT_TEMPLATE!r}.")
    chat_template: str | None = option(None, "auto | on | off; default: as the kvdistill run was trained, else auto.")
    seed: int = option(0, "Sampling seed.")
    dtype: str = option("auto", "auto | fp32 | bf16 | fp16.")
    device: str | None = option(None, "cpu, cuda, cuda:1 ... (default: cuda if available).")

    def __post_init__(self) -> None:
        for key in ("model", "data", "output"):
            if not getattr(self, key):
                raise ConfigError(f"no {key}: pass --{key}")
        for key in ("n_samples", "max_new_tokens", "batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"--{key} must be >= 1, got {getattr(self, key)}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {self.limit} (leave it out for all questions)")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}")
        if self.n_samples > 1 and self.temperature == 0:
            raise ConfigError(f"--n_samples {self.n_samples} greedy completions would all be the same; "
                              "set --temperature > 0 (e.g. 0.7) or --n_samples 1")
        if self.chat_template is not None:
            check_choice("chat_template", self.chat_template, CHAT_MODES)
        self.field_map = to_plain(self.field_map)


def sample_completions(model: Any, tokenizer: Any, prompts: list[str], *, n_samples: int, temperature: float,
                       top_p: float, max_new_tokens: int, batch_size: int, stop_strings: list[str],
                       add_special_tokens: bool) -> list[list[str]]:
    """`n_samples` completions of every prompt (`[N][n_samples]`), cut at the first stop string."""
    sampling = ({"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0
                else {"do_sample": False})
    out: list[list[str]] = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        new = generate_batch(model, tokenizer, batch, max_new_tokens=max_new_tokens, stop_strings=stop_strings,
                             add_special_tokens=add_special_tokens, num_return_sequences=n_samples, **sampling)
        texts = [truncate_at_stop(t, stop_strings) for t in tokenizer.batch_decode(new, skip_special_tokens=True)]
        out += [texts[i * n_samples : (i + 1) * n_samples] for i in range(len(batch))]  # rows grouped per prompt
    return out


def run_generate(cfg: GenerateConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Load the teacher and the questions, sample, filter, write `cfg.output`; returns the summary."""
    from kvdistill.models import check_vocab, load_model, load_tokenizer, resolve_device

    out = Path(cfg.output)
    if out.suffix != ".jsonl":
        raise ConfigError(f"--output {out} must be a .jsonl file (it is read back as transfer_data)")
    model_dir = resolve_model(cfg.model, "generating with", log)
    trained = training_prompt_settings(model_dir) or {}
    template = cfg.template or trained.get("template") or DEFAULT_TEMPLATE
    chat_mode = cfg.chat_template or trained.get("chat_template") or "auto"
    device = resolve_device(cfg.device)
    records = load_records(cfg.data, split=cfg.split, field_map=cfg.field_map, limit=cfg.limit)
    require_finals(records, "kvdistill generate (its prompts are questions)")
    tokenizer = load_tokenizer(_tokenizer_dir(model_dir))
    model = load_model(model_dir, dtype=cfg.dtype, device=device).eval()
    check_vocab(model, tokenizer, model_dir)
    check_lengths(model, tokenizer, records, model_dir, str(cfg.data),
                  {"template": template, "chat_template": chat_mode, "max_new_tokens": cfg.max_new_tokens,
                   "perplexity": False})
    chat = use_chat(tokenizer, chat_mode)
    prompts = [format_prompt(str(r["question"]), template, tokenizer if chat else None) for r in records]
    log(f"generate: {model_dir} on {cfg.data}:{cfg.split} ({len(records)} questions x {cfg.n_samples}, "
        f"temperature {cfg.temperature}, top_p {cfg.top_p})")
    torch.manual_seed(cfg.seed)
    completions = sample_completions(
        model, tokenizer, prompts, n_samples=cfg.n_samples, temperature=cfg.temperature, top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
        stop_strings=default_stop_strings(template), add_special_tokens=not chat,
    )
    graded = [i for i, r in enumerate(records) if str(r.get("answer") or "").strip()]  # those with gold
    rows = []
    for k in range(cfg.n_samples):
        texts = [c[k] for c in completions]
        items, _ = score_completions([records[i] for i in graded], [texts[i] for i in graded])
        scored = {i: item for i, item in zip(graded, items)}
        for i, (r, text) in enumerate(zip(records, texts)):
            item = scored.get(i)
            if cfg.filter_correct and item is not None and not item["correct"]:
                continue
            rows.append({"question": r["question"], "answer": text, "index": i, "sample": k,
                         "correct": None if item is None else item["correct"],
                         "gold": None if item is None else item["gold"]})
    rows.sort(key=lambda r: (r["index"], r["sample"]))
    write_text_atomic(out, "".join(json.dumps(r) + "\n" for r in rows))
    n = len(records) * cfg.n_samples
    summary = {"questions": len(records), "completions": n, "kept": len(rows), "filter_correct": cfg.filter_correct,
               "kept_correct": sum(r["correct"] is True for r in rows), "output": str(out)}
    log(f"wrote {len(rows)} of {n} completions to {out}" + (" (correct ones only)" if cfg.filter_correct else ""))
    return summary


def main(argv: list[str]) -> int:
    run_generate(parse_config(GenerateConfig, argv, "kvdistill generate", __doc__))
    return 0
