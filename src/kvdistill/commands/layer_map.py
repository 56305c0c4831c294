"""`kvdistill layer-map`: which teacher layers each student layer learns from (CKA top-k).

Runs the student and a teacher over the same texts (each with its own tokenizer), measures the
linear CKA between every student layer and every teacher layer (`align.cka.StreamingCKA`, all
pairs at once, minibatch by minibatch), keeps the top-k teacher layers per student layer and
writes the map as layer-map JSON (`align.layers.save_layer_map`) with a heatmap PNG beside it.

When the teacher tokenizes the text differently, its per-token features are resampled onto the
student's tokens with the segment-aware time alignment (`align.time`) before they are compared,
so the CKA rows are the student's tokens on both sides. With `--pooling mean` each model averages
its own tokens per sample and no resampling is needed.

Output names: one teacher writes `--output_file` (e.g. `map.json`) and `map.png`; several teachers write
one map each, `map.<teacher-name>.json` / `.png`, where the teacher name is the last component of
its path or Hub id (the name the trainer gives a teacher by default).

Example:
    kvdistill layer-map --student Qwen/Qwen2.5-0.5B --teacher Qwen/Qwen2-1.5B Qwen/Qwen2-7B \\
        --data openai/gsm8k --samples 100 --top_k 2 --debiased --monotonic --output_file maps/qwen.json
"""

from __future__ import annotations

import datetime as _dt
import gc
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from kvdistill.align.cka import POOLINGS, StreamingCKA, drop_first_tokens, pool_features, topk_layer_map
from kvdistill.align.heads import flatten_heads
from kvdistill.align.layer_map import save_layer_map
from kvdistill.align.time import resample, time_index
from kvdistill.cache import extract_kv
from kvdistill.config import ConfigError, check_choice, check_output_dir, option, parse_config, to_plain
from kvdistill.data import DEFAULT_TEMPLATE, DistillCollator
from kvdistill.models import check_length, check_vocab, max_positions, model_device, num_layers
from kvdistill.runs import resolve_model

# what each representation compares; "kv" (the default) is what a KV loss reads: the mean of the keys'
# and the values' CKA (real LMs' hidden states are ruled by massive activations: docs/real_pair_layer_map.md)
FEATURES = {"kv": ("keys", "values"), "hidden": ("hidden",), "keys": ("keys",), "values": ("values",)}
REPRESENTATIONS = tuple(FEATURES)


def _model_name(model: nn.Module) -> str:
    return str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "")


def layer_features(
    model: nn.Module,
    batch: Mapping[str, Tensor],
    representation: str = "kv",
    key_space: str = "post_rope",
) -> tuple[Tensor, ...]:
    """One model's per-layer token features for a batch, one forward pass.

    Args:
        model: any HF causal LM (run under no_grad).
        batch: `input_ids`, `attention_mask`, `segment_ids` `[B, T]`.
        representation: "hidden" (each decoder layer's output; the embeddings are dropped),
            "keys" or "values" (the cache, heads flattened to `H·D`), "kv" (keys and values).
        key_space: keys "post_rope" (as cached) or "pre_rope".

    Returns:
        one `[L, B, T, F]` tensor per feature of `FEATURES[representation]`, F = d_model or H_kv·D.
    """
    if representation not in REPRESENTATIONS:
        raise ValueError(f"representation must be one of {REPRESENTATIONS}, got {representation!r}")
    device = model_device(model)
    kv = extract_kv(
        model,
        batch["input_ids"].to(device),
        batch["attention_mask"].to(device),
        batch["segment_ids"].to(device),
        key_space=key_space,
        output_hidden_states=representation == "hidden",
    )
    feats = {
        "hidden": lambda: kv.hidden_states[1:],  # [L, B, T, d]: drop the embeddings, one per decoder layer
        "keys": lambda: flatten_heads(kv.keys),  # [L, B, T, H·D]
        "values": lambda: flatten_heads(kv.values),  # [L, B, T, H·D]
    }
    return tuple(feats[f]() for f in FEATURES[representation])


@torch.no_grad()
def layer_similarity(
    student_model: nn.Module,
    teacher_model: nn.Module,
    student_tok: Any,
    teacher_tok: Any,
    records: Sequence[Mapping[str, Any]],
    *,
    representation: str = "kv",
    pooling: str = "tokens",
    debiased: bool = False,
    skip_tokens: int = 1,
    standardize: bool = False,
    batch_size: int = 4,
    max_length: int = 512,
    minibatch_size: int | None = 1024,
    time_mode: str = "segment",
    key_space: str = "post_rope",
    template: str = DEFAULT_TEMPLATE,
    use_chat_template: bool = False,
    cka_dtype: torch.dtype = torch.float64,
    progress: bool | None = None,
    desc: str = "layer-map",
) -> tuple[Tensor, dict[str, int]]:
    """CKA similarity `S [L_s, L_t]` between every student and every teacher layer on `records`.

    `S` is the mean over the features of `FEATURES[representation]` (keys and values for "kv").
    Rows are the student's tokens after its first `skip_tokens`, read where the teacher's source is
    past its own first `skip_tokens` (mean pooling: each model drops its own first tokens).

    Returns:
        (`S` float64 on CPU, counts `{"samples", "rows", "minibatches"}`).
    """
    from tqdm.auto import tqdm

    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if not records:
        raise ValueError("layer_similarity needs at least one record")
    s_collate = DistillCollator(student_tok, max_length, template, use_chat_template)
    t_collate = DistillCollator(teacher_tok, max_length, template, use_chat_template)
    accs = [StreamingCKA(minibatch_size, debiased=debiased, dtype=cka_dtype, standardize=standardize)
            for _ in FEATURES[representation]]
    device = model_device(student_model)
    modes = [(m, m.training) for m in (student_model, teacher_model)]
    for m, _ in modes:
        m.eval()
    try:
        starts = range(0, len(records), batch_size)
        for i in tqdm(starts, desc=desc, unit="batch", disable=None if progress is None else not progress):
            chunk = list(records[i : i + batch_size])
            sb, tb = s_collate(chunk), t_collate(chunk)  # [B, T_s], [B, T_t]
            fs = layer_features(student_model, sb, representation, key_space)  # ([L_s, B, T_s, F_s], ...)
            ft = layer_features(teacher_model, tb, representation, key_space)  # ([L_t, B, T_t, F_t], ...)
            ft = [f.to(device) for f in ft]
            s_mask = sb["attention_mask"].to(device)
            t_mask = tb["attention_mask"].to(device)
            s_keep = drop_first_tokens(s_mask, skip_tokens)  # [B, T_s]
            t_keep = drop_first_tokens(t_mask, skip_tokens)  # [B, T_t]
            if pooling == "mean":  # each model averages its own tokens: no time alignment needed
                for acc, xs, xt in zip(accs, fs, ft):
                    acc.update(pool_features(xs, s_keep, "mean"), pool_features(xt, t_keep, "mean"))
                continue
            same_tokens = sb["input_ids"].shape == tb["input_ids"].shape and torch.equal(
                sb["input_ids"], tb["input_ids"]
            )
            mask = s_keep
            if not same_tokens:  # the teacher read at the student's tokens (segment-aware lerp)
                idx = time_index(
                    t_mask, tb["segment_ids"].to(device), s_mask, sb["segment_ids"].to(device), mode=time_mode
                )
                ft = [resample(xt, idx, time_dim=2, batch_dim=1) for xt in ft]  # [L_t, B, T_s, F_t]
                # a kept left neighbour implies a kept right one (hi >= lo): no lerp reads a skipped token
                mask = mask & idx.valid & t_keep.gather(1, idx.lo)  # [B, T_s]
            for acc, xs, xt in zip(accs, fs, ft):
                acc.update(pool_features(xs, mask, "tokens"), pool_features(xt, mask, "tokens"))
        similarity = (sum(acc.compute() for acc in accs) / len(accs)).cpu()  # [L_s, L_t]
    finally:
        for m, was_training in modes:
            m.train(was_training)
    return similarity, {"samples": len(records), "rows": accs[0].num_rows, "minibatches": accs[0].num_minibatches}


def compute_layer_map(
    student_model: nn.Module,
    teacher_model: nn.Module,
    student_tok: Any,
    teacher_tok: Any,
    records: Sequence[Mapping[str, Any]],
    *,
    k: int = 2,
    temperature: float | None = None,
    monotonic: bool = False,
    representation: str = "kv",
    pooling: str = "tokens",
    debiased: bool = False,
    skip_tokens: int = 1,
    standardize: bool = False,
    batch_size: int = 4,
    max_length: int = 512,
    minibatch_size: int | None = 1024,
    time_mode: str = "segment",
    key_space: str = "post_rope",
    template: str = DEFAULT_TEMPLATE,
    use_chat_template: bool = False,
    cka_dtype: torch.dtype = torch.float64,
    seed: int | None = None,
    provenance: Mapping[str, Any] | None = None,
    progress: bool | None = None,
) -> dict[str, Any]:
    """CKA similarity, top-k map and provenance for one student/teacher pair (no files written).

    Args:
        student_model, teacher_model: HF causal LMs (any devices; run in eval mode, restored after).
        student_tok, teacher_tok: their (fast) tokenizers; they may differ.
        records: `{"question", "answer"}` dicts; all are used.
        k, temperature, monotonic: top-k selection (see `align.cka.topk_layer_map`).
        representation: "kv" (mean of the keys' and the values' CKA) | "hidden" | "keys" | "values".
        pooling: "tokens" (every valid token is a CKA row) | "mean" (one row per sample).
        debiased: unbiased HSIC estimator per minibatch.
        skip_tokens: each sample's first tokens left out (attention sinks with massive activations).
        standardize: unit-variance channels per minibatch (outlier channels do not dominate).
        batch_size: samples per forward pass.
        max_length: tokens per example.
        minibatch_size: CKA rows per minibatch (memory: a `[L, n, n]` float64 Gram per model).
        time_mode: "segment" | "global" alignment of a differently tokenized teacher.
        key_space: "post_rope" | "pre_rope" keys (representation "keys").
        template, use_chat_template: prompt formatting, as in training.
        cka_dtype: Gram computation dtype (HSIC sums are float64 in any case).
        seed: recorded in the provenance (the caller samples the records).
        provenance: extra fields for the provenance (e.g. the data source).
        progress: tqdm bar (None: only on a terminal).

    Returns:
        `{"matrix": M [L_s, L_t] float32, "similarity": S [L_s, L_t] float64, "provenance": dict}`.

    Example:
        >>> res = compute_layer_map(student, teacher, s_tok, t_tok, records, k=2)
        >>> save_layer_map("map.json", res["matrix"], similarity=res["similarity"], provenance=res["provenance"])
    """
    import kvdistill
    from kvdistill.models import config_hash

    S, counts = layer_similarity(
        student_model, teacher_model, student_tok, teacher_tok, records,
        representation=representation, pooling=pooling, debiased=debiased, skip_tokens=skip_tokens,
        standardize=standardize, batch_size=batch_size,
        max_length=max_length, minibatch_size=minibatch_size, time_mode=time_mode, key_space=key_space,
        template=template, use_chat_template=use_chat_template, cka_dtype=cka_dtype, progress=progress,
        desc=f"layer-map {Path(_model_name(teacher_model).rstrip('/')).name or 'teacher'}",
    )  # fmt: skip
    M = topk_layer_map(S, k, temperature=temperature, monotonic=monotonic)
    prov = {
        "method": "linear CKA, minibatch HSIC" + (" (debiased)" if debiased else "")
        + (", standardized channels" if standardize else ""),
        "student": _model_name(student_model),
        "teacher": _model_name(teacher_model),
        "student_config_hash": config_hash(student_model),
        "teacher_config_hash": config_hash(teacher_model),
        "student_layers": int(S.shape[0]),
        "teacher_layers": int(S.shape[1]),
        **counts,
        "k": k,
        "temperature": temperature,
        "monotonic": monotonic,
        "representation": representation,
        "key_space": key_space if "keys" in FEATURES[representation] else None,
        "pooling": pooling,
        "debiased": debiased,
        "skip_tokens": skip_tokens,
        "standardize": standardize,
        "minibatch_size": minibatch_size,
        "cka_dtype": str(cka_dtype).replace("torch.", ""),
        "time_mode": time_mode,
        "max_length": max_length,
        "seed": seed,
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "kvdistill_version": kvdistill.__version__,
        **(provenance or {}),
    }
    return {"matrix": M, "similarity": S, "provenance": prov}


def write_layer_map(
    result: Mapping[str, Any], out: str | Path, *, title: str | None = None
) -> tuple[Path, Path]:
    """Write `compute_layer_map`'s result as `out` (JSON) and `out` with suffix .png (heatmap).

    The heatmap goes first and the JSON (atomically) last: a map file is there only when both are.
    """
    from kvdistill.plots import plot_cka_heatmap

    out = Path(out)
    prov = result["provenance"]
    if title is None:
        title = f"CKA ({prov.get('representation', 'hidden')}, {prov.get('pooling', 'tokens')}): " + (
            f"{Path(str(prov.get('student', 'student'))).name} vs {Path(str(prov.get('teacher', 'teacher'))).name}"
        )
    png = plot_cka_heatmap(result["similarity"], result["matrix"], out.with_suffix(".png"), title=title)
    save_layer_map(
        out, result["matrix"], similarity=result["similarity"], provenance=dict(result["provenance"])
    )
    return out, png


def teacher_name(name_or_path: str) -> str:
    """File-name-safe short name of a teacher: the last component of its path or Hub id."""
    name = Path(str(name_or_path).rstrip("/")).name or "teacher"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def output_paths(out: str | Path, teachers: Sequence[str]) -> list[Path]:
    """`out` for one teacher; `<stem>.<teacher-name><suffix>` each for several (names deduplicated)."""
    out = Path(out)
    if out.suffix.lower() != ".json":
        out = out.with_name(out.name + ".json")
    if len(teachers) == 1:
        return [out]
    paths, seen = [], set()
    for i, t in enumerate(teachers):
        name = teacher_name(t)
        if name in seen:
            name = f"{name}-{i}"
        seen.add(name)
        paths.append(out.with_name(f"{out.stem}.{name}{out.suffix}"))
    return paths


def sample_records(records: Sequence[dict], n: int | None, seed: int) -> list[dict]:
    """`n` records drawn without replacement by `seed`, in their original order (all if n is None)."""
    if n is None or n >= len(records):
        return list(records)
    keep = sorted(random.Random(seed).sample(range(len(records)), n))
    return [records[i] for i in keep]


@dataclass
class LayerMapConfig:
    """Options of `kvdistill layer-map`."""

    student: str | None = option(None, "Student: Hub id or local model dir. Required.")
    teacher: list[str] | None = option(None, "One or more teachers: Hub ids or local dirs. Required.")
    data: str = option("synthetic", "Hub id, local jsonl/json/parquet file or dir, or 'synthetic'.")
    split: str = option("train", "Dataset split.")
    field_map: str | None = option(None, 'Column map: a name (gsm8k, svamp, math) or {"question": col, "answer": col}.')
    samples: int = option(100, "Texts to compare on, drawn with --seed.")
    top_k: int = option(2, "Teacher layers per student layer.")
    output_file: str | None = option(None, "Output layer-map JSON path (the heatmap goes next to it as .png). "
                                    "Required.", aliases=["--out"])
    representation: str = option("kv", f"What to compare: {REPRESENTATIONS}. kv: the mean of the flattened cache "
                                 "keys' and values' CKA (what a KV loss reads); hidden: layer outputs (dominated by "
                                 "massive activations in real LMs); keys or values alone.")
    pooling: str = option("tokens", f"CKA rows {POOLINGS}: every valid token, or the mean per sample.")
    debiased: bool = option(False, "Unbiased HSIC estimator per minibatch (recommended with small minibatches).")
    skip_tokens: int = option(1, "Leave each sample's first N tokens out of the CKA (the first token is an "
                              "attention sink with massive activations, and a BOS on one side only); 0: all tokens.")
    standardize: bool = option(False, "Unit-variance channels per minibatch, so a few massive channels do not "
                               "dominate (use with --representation hidden).")
    monotonic: bool = option(False, "A deeper student layer never maps to a shallower teacher layer.")
    temperature: float | None = option(None, "Softmax temperature for the top-k weights (default: plain "
                                       "normalisation).")
    batch_size: int = option(4, "Samples per forward pass.")
    max_length: int = option(512, "Tokens per example.")
    minibatch_size: int = option(1024, "CKA rows per minibatch; memory ~ (L_s + L_t) x n^2 x 8 bytes.")
    cka_dtype: str = option("float64", "Gram precision: float64 | float32 (halves CKA time and memory).")
    time_mode: str = option("segment", "Alignment of a teacher that tokenizes differently: segment | global.")
    key_space: str = option("post_rope", "Keys as cached (post_rope) or before RoPE (pre_rope), for "
                            "representation keys.")
    template: str = option(DEFAULT_TEMPLATE, "Prompt template with {question} (as in training).")
    chat_template: bool = option(False, "Format prompts with the tokenizers' chat templates.")
    dtype: str = option("auto", "Model dtype: auto | fp32 | bf16 | fp16 (CKA is float64 anyway).")
    quantization: str | None = option(None, "Load teachers quantized: 4bit | 8bit.")
    device: str | None = option(None, "cpu, cuda, cuda:1 ... (default: cuda if available).")
    seed: int = option(0, "Which --samples texts are drawn.")
    no_progress: bool = option(False, "No progress bar.")

    def __post_init__(self) -> None:
        if not self.student or not self.teacher or not self.output_file:
            raise ConfigError("pass --student, --teacher (one or more) and --output_file map.json")
        if self.samples < 1 or self.top_k < 1 or self.batch_size < 1:
            raise ConfigError("--samples, --top_k and --batch_size must be >= 1")
        if self.skip_tokens < 0 or self.skip_tokens >= self.max_length:
            raise ConfigError(f"--skip_tokens must be in [0, --max_length {self.max_length}), got {self.skip_tokens}")
        for name, allowed in (("representation", REPRESENTATIONS), ("pooling", POOLINGS),
                              ("cka_dtype", ("float64", "float32")), ("time_mode", ("segment", "global")),
                              ("key_space", ("post_rope", "pre_rope")), ("quantization", (None, "4bit", "8bit"))):
            check_choice(name, getattr(self, name), allowed)
        self.field_map = to_plain(self.field_map)


def check_model(a: LayerMapConfig, model: nn.Module, tokenizer: Any, name: str) -> None:
    """The model reads this tokenizer's ids and `--max_length` tokens (else an error that names it)."""
    check_vocab(model, tokenizer, name)
    check_length(model, a.max_length, name, f"--max_length {a.max_length}", f"set --max_length <= {max_positions(model)}")


def main(argv: list[str]) -> int:
    from kvdistill.data import load_records
    from kvdistill.models import load_model, load_tokenizer, resolve_device

    a = parse_config(LayerMapConfig, argv, "kvdistill layer-map", __doc__)
    outs = output_paths(a.output_file, a.teacher)
    check_output_dir(outs[0].parent, "--output_file's directory")
    field_map = a.field_map
    device = resolve_device(a.device)
    torch.manual_seed(a.seed)
    records = sample_records(load_records(a.data, split=a.split, field_map=field_map), a.samples, a.seed)
    s_dir = resolve_model(a.student, "layer-map of the student")  # a run: its final model or newest complete checkpoint
    student, s_tok = load_model(s_dir, dtype=a.dtype, device=device), load_tokenizer(s_dir)
    check_model(a, student, s_tok, f"student {a.student}")
    for teacher_path, out in zip(a.teacher, outs):
        t_dir = resolve_model(teacher_path, "layer-map of the teacher")
        teacher = load_model(t_dir, dtype=a.dtype, device=device, quantization=a.quantization)
        t_tok = load_tokenizer(t_dir)
        check_model(a, teacher, t_tok, f"teacher {teacher_path}")
        if a.top_k > num_layers(teacher):
            raise ConfigError(f"--top_k {a.top_k} is more than the {num_layers(teacher)} layers of teacher "
                              f"{teacher_path}; set --top_k <= {num_layers(teacher)}")
        result = compute_layer_map(
            student, teacher, s_tok, t_tok, records,
            k=a.top_k, temperature=a.temperature, monotonic=a.monotonic, representation=a.representation,
            pooling=a.pooling, debiased=a.debiased, skip_tokens=a.skip_tokens, standardize=a.standardize,
            batch_size=a.batch_size, max_length=a.max_length,
            minibatch_size=a.minibatch_size, time_mode=a.time_mode, key_space=a.key_space,
            template=a.template, use_chat_template=a.chat_template, seed=a.seed,
            cka_dtype=getattr(torch, a.cka_dtype),
            provenance={"student": a.student, "teacher": teacher_path, "data": a.data, "split": a.split,
                        "quantization": a.quantization},
            progress=False if a.no_progress else None,
        )  # fmt: skip
        json_path, png_path = write_layer_map(result, out)
        print(f"{teacher_name(teacher_path)}: {json_path} (+ {png_path.name})")
        for row, M_row in enumerate(result["matrix"]):
            picks = [(t, float(M_row[t])) for t in M_row.nonzero().flatten().tolist()]
            picks.sort(key=lambda p: -p[1])
            print(f"  student {row:>3} <- " + ", ".join(f"teacher {t} ({w:.2f})" for t, w in picks))
        del teacher, result
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0
