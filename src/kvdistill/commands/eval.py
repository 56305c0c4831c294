"""`kvdistill eval`: GSM8K-style accuracy, answer NLL and held-out perplexity of any HF causal LM.

Records without final answers (text, conversations, prompt/completion) get the held-out LM loss only:
`nll` per target token of what training learns of them, and its perplexity.

Loads a model (Hub id, model dir, or a kvdistill run / checkpoint dir, whose training prompt
settings are reused), scores it with `kvdistill.evaluate.scoring` and writes `items.jsonl` +
`summary.json`. `--data` is required: there is no default dataset.

Example:
    kvdistill eval --model runs/student --data synthetic --limit 200 --output_dir runs/student/eval
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdistill.card import record_evaluation
from kvdistill.config import ConfigError, check_choice, check_output_dir, option, parse_config, to_plain
from kvdistill.data import (
    DEFAULT_TEMPLATE,
    format_example,
    format_prompt,
    has_finals,
    load_records,
    record_format,
    shorten_rationale,
)
from kvdistill.evaluate.scoring import CHAT_MODES, evaluate_model, use_chat, write_results
from kvdistill.report import environment
from kvdistill.runs import resolve_model


@dataclass
class EvalConfig:
    """Options of `kvdistill eval`."""

    model: str | None = option(None, "Hub id, local model dir, or kvdistill run/checkpoint dir. Required.")
    data: str | None = option(None, "Hub id, local jsonl/json/parquet file or dir, or 'synthetic'. Required.")
    split: str = option("test", "Dataset split.")
    field_map: str | None = option(None, 'Column map: a name (gsm8k, svamp, math) or {"question": col, "answer": col}.')
    limit: int | None = option(None, "Evaluate only the first N questions.")
    batch_size: int = option(8, "Prompts per generation batch.")
    max_new_tokens: int = option(256, "Generation budget per question.")
    template: str | None = option(None, "Prompt template with {question}; default: the training template of a "
                                  f"kvdistill run, else {DEFAULT_TEMPLATE!r}.")
    chat_template: str | None = option(None, "Use the tokenizer's chat template: auto (if it has one), on, off; "
                                       "default: as the kvdistill run was trained, else off (training's default), "
                                       "so a base model and its student are scored on the same prompt.")
    stop: list[str] | None = option(None, "Stop strings; default: newline + the template text before {question}.")
    no_perplexity: bool = option(False, "Skip the reference perplexity.")
    no_answer_nll: bool = option(False, "Skip the answer NLL (the gold answer's NLL after the model's own "
                                 "rationale; one more forward per batch).")
    max_length: int = option(512, "Token limit of the perplexity examples.")
    teacher: str | None = option(None, "A teacher (Hub id, model dir or kvdistill run dir) of the same tokenizer: "
                                 "also KL(teacher || model) of the next-token distributions on the perplexity's "
                                 "tokens (`kl_to_teacher`, nats per target token).")
    dtype: str = option("auto", "auto | fp32 | bf16 | fp16.")
    device: str | None = option(None, "cpu, cuda, cuda:1 ... (default: cuda if available).")
    output_dir: str | None = option(None, "Write DIR/items.jsonl and DIR/summary.json.", aliases=["--out"])
    update_card: bool = option(False, "Also add the result to the evaluated model's card (its README.md, written by "
                               "kvdistill train); off: evaluating leaves the model dir as it was.")
    no_progress: bool = option(False, "No progress bar.")

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("no model: pass --model <hub id, model dir or kvdistill run dir>")
        for key in ("limit", "batch_size", "max_new_tokens", "max_length"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"--{key} must be >= 1, got {value}" + (" (leave it out for all questions)"
                                                                         if key == "limit" else ""))
        if self.chat_template is not None:
            check_choice("chat_template", self.chat_template, CHAT_MODES)
        self.field_map = to_plain(self.field_map)
        if not self.data:
            raise ConfigError("no data: pass --data <Hub id, jsonl/json/parquet file or dir, or 'synthetic'>")
        if self.teacher and self.no_perplexity:
            raise ConfigError("--teacher compares next-token distributions on the perplexity's tokens; drop "
                              "--no_perplexity or --teacher")


# ----------------------------------------------------------------------------- model dirs


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
    """`{"template", "chat_template", "student_input"}` a kvdistill run was trained with (its
    `kvdistill_config.yaml`).

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
                # what the student read in training (privileged mode): its perplexity is scored on that text
                "student_input": cfg.get("student_input") or "full",
            }
    return None


def check_lengths(model: Any, tokenizer: Any, records: list[dict], name: str, data: str,
                  settings: dict[str, Any]) -> None:
    """Refuse, before generating, the longest prompt + `max_new_tokens`, or the longest perplexity
    example (cut at `max_length`), when it is longer than the positions the model was built for."""
    from kvdistill.models import check_length, max_positions

    template, limit = settings.get("template") or DEFAULT_TEMPLATE, max_positions(model)
    try:
        chat = use_chat(tokenizer, settings.get("chat_template", "auto"))
    except ValueError as err:  # --chat_template on, and the tokenizer has none
        raise ConfigError(f"{err} ({name})") from None

    def longest(texts: list[str], extra: int = 0) -> tuple[int, int]:  # (record, tokens)
        lengths = [len(ids) + extra for ids in tokenizer(texts, add_special_tokens=not chat)["input_ids"]]
        i = max(range(len(lengths)), key=lengths.__getitem__)
        return i, lengths[i]

    if has_finals(records):  # generated answers: the longest prompt plus the generation budget
        i, n = longest([format_prompt(r["question"], template, tokenizer if chat else None) for r in records])
        new = settings.get("max_new_tokens", 256)
        fix = (f"lower --max_new_tokens to {limit - n}, or leave the longest questions out" if limit and n < limit
               else "leave questions this long out of the data")
        check_length(model, n + new, name, f"question {i} of {data} ({n} tokens) plus --max_new_tokens {new}", fix)
    if settings.get("perplexity", True):  # as `tokenize_example` makes them: + EOS, cut at max_length
        i, n = longest([format_example(r, template, tokenizer if chat else None).text for r in records], extra=1)
        n = min(n, settings.get("max_length", 512))
        check_length(model, n, name, f"record {i} of {data} ({n} tokens with its answer, for the perplexity)",
                     f"set --max_length <= {limit}, or pass --no_perplexity")


def run_eval(
    model_path: str | Path,
    *,
    data: str,
    split: str = "test",
    field_map: Any = None,
    limit: int | None = None,
    out: str | Path | None = None,
    dtype: str = "auto",
    device: str | None = None,
    log: Callable[[str], None] = print,
    update_card: bool = False,
    teacher: str | Path | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Load a model (Hub id, model dir or kvdistill run dir) and data, evaluate, write to `out` (and, with
    `update_card`, into the model card of a student kvdistill saved; the model dir is never written otherwise).

    `kwargs` go to `evaluate_model` (batch_size, max_new_tokens, template, chat_template, ...);
    the answer NLL is on unless `answer_nll=False`.
    `template` / `chat_template` left out (or None) come from the run's training config when
    `model_path` is a kvdistill run, else the defaults (plain template, no chat template, as training's).
    `teacher`: a model of the same tokenizer whose KL to this one is scored too (`kl_to_teacher`).
    """
    from kvdistill.models import check_vocab, load_model, load_tokenizer, resolve_device

    if out is not None:
        check_output_dir(out)
    model_dir = resolve_model(model_path, "evaluating", log)  # a run: its final model, else its newest complete checkpoint
    trained = training_prompt_settings(model_dir) or {}
    for key in ("template", "chat_template"):
        if kwargs.get(key) is None:
            kwargs.pop(key, None)
            if key in trained:
                kwargs[key] = trained[key]
    kwargs.setdefault("chat_template", "off")  # training's default: a base model reads what its student was taught on
    device = resolve_device(device)
    records = load_records(data, split=split, field_map=field_map, limit=limit)
    finals = has_finals(records)  # else (text, conversations, prompt/completion) the held-out LM loss only
    student_input = trained.get("student_input", "full")
    if student_input != "full":  # a privileged-mode student never learned the full rationale
        records = [shorten_rationale(r, student_input) for r in records]
    tokenizer = load_tokenizer(_tokenizer_dir(model_dir))
    if teacher is not None:  # before any weights load
        from kvdistill.teachers import same_tokenizer

        teacher_dir = resolve_model(teacher, "the KL is scored against", log)
        if not same_tokenizer(load_tokenizer(_tokenizer_dir(teacher_dir)), tokenizer):
            raise ConfigError(f"--teacher {teacher} has another tokenizer than {model_dir}: a KL per token needs "
                              "the same tokens; give a teacher of the model's tokenizer")
    model = load_model(model_dir, dtype=dtype, device=device)
    check_vocab(model, tokenizer, model_dir)
    check_lengths(model, tokenizer, records, model_dir, str(data), kwargs)
    if teacher is not None:
        kwargs["teacher"] = load_model(teacher_dir, dtype=dtype, device=device).eval()
    what = (f"{len(records)} questions" if finals else
            f"{len(records)} {record_format(records[0])} records: no final answers, the held-out LM loss only")
    prompt = f"; prompt {kwargs.get('template') or DEFAULT_TEMPLATE!r}" if finals else ""  # text has no prompt
    log(f"eval: {model_dir} on {data}:{split} ({what}, device {device}){prompt}, chat template "
        f"{kwargs['chat_template']}" + (" (as the run was trained)" if "chat_template" in trained else ""))
    result = evaluate_model(model, tokenizer, records, **{"answer_nll": True, **kwargs})
    result.update(
        {
            "model": str(model_path),
            "model_dir": model_dir,
            "data": str(data),
            "split": split,
            "limit": limit,
            "dtype": dtype,
            "student_input": student_input,
            "teacher": None if teacher is None else str(teacher),
            "device": str(device),
            "environment": environment(),
        }
    )
    if out is not None:
        items_path, summary_path = write_results(result, out)
        log(f"wrote {items_path} and {summary_path}")
    if update_card:
        card = record_evaluation(model_dir, result)
        log(f"added the result to the model card {card}" if card else
            f"--update_card: {model_dir} holds no model card written by kvdistill; left as it was")
    return result


def main(argv: list[str]) -> int:
    cfg = parse_config(EvalConfig, argv, "kvdistill eval", __doc__)
    result = run_eval(
        cfg.model, data=cfg.data, split=cfg.split, field_map=cfg.field_map, limit=cfg.limit, out=cfg.output_dir,
        dtype=cfg.dtype, device=cfg.device, batch_size=cfg.batch_size, max_new_tokens=cfg.max_new_tokens,
        template=cfg.template, chat_template=cfg.chat_template, stop_strings=cfg.stop,
        perplexity=not cfg.no_perplexity, answer_nll=not cfg.no_answer_nll, max_length=cfg.max_length, progress=False if cfg.no_progress else None,
        update_card=cfg.update_card, teacher=cfg.teacher,
    )
    ppl, nll, kl = result["perplexity"], result["answer_nll"], result.get("kl_to_teacher")
    kl_text = "" if kl is None else f", KL to the teacher {kl:.4f} nats/token"
    if result["accuracy"] is None:
        print(f"held-out LM loss {result['nll']:.4f} nats/token over {result['target_tokens']} tokens of "
              f"{result['n']} records, perplexity {ppl:.3f}{kl_text}")
        return 0
    print(
        f"accuracy {result['accuracy']:.4f} ({result['n_correct']}/{result['n']}), "
        f"95% CI [{result['ci_low']:.4f}, {result['ci_high']:.4f}]"
        + (f", answer NLL {nll:.3f}" if nll is not None else "")
        + (f", perplexity {ppl:.3f}" if ppl is not None else "") + kl_text
    )
    return 0
