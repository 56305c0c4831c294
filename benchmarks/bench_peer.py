"""Benchmark: kvdistill beside TRL's stable DistillationTrainer and its experimental GKDTrainer, on one job.

The job: one same-vocabulary teacher, logit-only distillation (generalized JSD with `BETA` over the
completion tokens / their count; no LM loss, no KV term), the same records, batch, seed and sampling
settings. All trainers are built in this process and timed interleaved (`interleaved_times`: kvdistill,
GKD, Distillation, ..., the order reversed every other repeat), on each pair:

- the tiny fixtures (a 2-layer Qwen2 student of a 4-layer Qwen2 teacher, vocabulary 320);
- full mode only, the real models of models/real/ (`bash scripts/real_pair.sh`): SmolLM2-135M-Instruct ->
  its every other layer, and Gemma-3-270m -> its every other layer (vocabulary 262,144), each student made
  by `kvdistill.prune` from its teacher (a pair whose teacher is missing is a row saying how to get it).

Per pair:
- (a) off-policy step: kvdistill's `training_step` on the data's completions vs `GKDTrainer.training_step`
  at lmbda 0. DistillationTrainer has no off-policy mode (it always samples: no lmbda, its `_prepare_inputs`
  generates on every training step), so its row `trl_distillation_given_ms` is its `compute_loss` + backward
  on the same completions: no TRL training mode, the loss's share of a step.
- (b) on-policy step: kvdistill's `written_batch` (the student samples; every reader re-tokenizes the text)
  + `training_step`, vs `GKDTrainer.training_step` at lmbda 1 and `DistillationTrainer.training_step`, which
  sample inside. `*_tokens`: the completion tokens each one's step was taught on (sampling stops at EOS, so
  the three can differ; kvdistill's seed is per step, TRL's draws go on).
- (c) the loss on one fixed batch: the same tokens and weights into each trainer's `compute_loss` (TRL's
  DistillationTrainer in its own layout: prompts left-padded, completions right-padded); then the three loss
  formulas on the same logits / hidden states at loss temperature 1 and 2.
- (d) peak memory of one step of each case (`commands.profile.measure`: CUDA's peak allocation, on CPU the
  torch profiler's memory events), above what was allocated before the step.

Every setting the trainers share is named in the result's `settings`; each one is set explicitly on every
side, TRL's defaults that differ included: `gradient_checkpointing` (TRL: True, which also turns off the
KV cache of GKD's generation), `bf16` (TRL: True, which autocasts the teacher), DistillationConfig's
`beta` (1.0), `top_k`, `pad_to_multiple_of` ("auto": none on CPU/CUDA), `max_completion_length` (512),
`shuffle_dataset`. kvdistill's `lmbda` is read only where the Trainer draws an optimizer step's batches
(`get_batch_samples`), which these direct `training_step` calls skip: one kvdistill trainer gives both
steps, each given its batch (the data's, or `written_batch`'s).

Where the definitions differ (reported, not hidden): the loss temperature. GKD's `temperature` is the
sampling temperature only, its loss always at 1; DistillationTrainer's `temperature` is both the sampling
and the loss temperature, without a T^2 factor; kvdistill's `temperature` samples and
`logit_kd_temperature` T divides both logits and scales the sum by T^2 (Hinton et al.). At T = 1 (used
here) the three are one formula; `formula_*_t2_over_t2` checks them at T = 2 with kvdistill's T^2 divided out.
kvdistill's KD reads the tokenizer's rows of a padded head, TRL every row: none of these pairs pads.

Headline `ratio_vs_trl_distillation` = kvdistill's on-policy step time / DistillationTrainer's, the largest
over the pairs (target <= 1.0); `ratio_vs_trl` = the larger of (a) and (b) against GKDTrainer, likewise.
Skipped, with the reason, when `trl` is not installed (`pip install 'kvdistill[peer]'`).
`--quick`: the tiny pair, 8 new tokens, 3 repeats; otherwise all pairs, 64 new tokens, 7 repeats.
Batch 2, 1 torch thread.

    python benchmarks/bench_peer.py [--quick]
    kvdistill bench --only peer
"""

from __future__ import annotations

import logging
import tempfile
from functools import partial
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch

from kvdistill.commands.bench import interleaved_times, run_standalone, torch_threads
from kvdistill.commands.profile import measure
from kvdistill.data import format_prompt, tokenize_example
from kvdistill.losses import logit_kd_sum
from kvdistill.prune import prune
from kvdistill.real_pair import STUDENT as SMOLLM2
from kvdistill.real_pair import TEACHER as GEMMA
from kvdistill.tiny import build_tiny_world
from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config

TARGET = 1.0
BATCH = 2
BETA = 0.5
SEED = 1234
MAX_LENGTH = 256
LOSS_ATOL = 1e-5
REAL = Path(__file__).resolve().parents[1] / "models" / "real"
SKIP = "trl is not installed (pip install 'kvdistill[peer]')"
# the job, once: each trainer below is given it in its own option names
SETTINGS = {
    "batch": BATCH, "gradient_accumulation_steps": 1, "seed": SEED, "max_length": MAX_LENGTH,
    "loss": "generalized JSD over the completion tokens / their count; no LM loss, no KV term",
    "beta": BETA, "loss_temperature": 1.0, "lmbda": "0 off-policy, 1 on-policy (DistillationTrainer: always on)",
    "seq_kd": False, "do_sample": True, "sampling_temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": None,
    "repetition_penalty": 1.0, "stop": "the model's and tokenizer's EOS ids", "use_cache_in_generation": True,
    "gradient_checkpointing": False, "dtype": "fp32 student and teacher weights", "bf16": False, "fp16": False,
    "pad_to_multiple_of": None, "padding": "to the longest row", "dropout": "off (disable_dropout)",
    "chat_template": False, "prompt": "kvdistill's template, add_special_tokens true", "max_grad_norm": 0.0,
    "optimizer_step": "none (training_step: forward, loss, backward)", "torch_threads": 1,
}


def kvdistill_trainer(student: Path, teacher: Path, data: Path, out: Path, new_tokens: int, use_cpu: bool):
    argv = {
        "student": student, "student_dtype": "fp32", "teachers": f"[{{path: {teacher}, name: teacher, dtype: fp32}}]",
        "data": data, "output_dir": out, "max_samples": 32, "max_length": MAX_LENGTH, "ce_weight": 0.0,
        "allow_kv_only": "true", "kv_weight": 0.0, "logit_kd_weight": 1.0, "logit_kd_kind": "jsd", "beta": BETA,
        "logit_kd_temperature": 1.0, "lmbda": 1.0, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": new_tokens,
        "use_chat_template": "false", "gradient_checkpointing": "false", "bf16": "false", "seed": SEED,
        "per_device_train_batch_size": BATCH, "gradient_accumulation_steps": 1, "report_to": "none",
        "use_cpu": str(use_cpu).lower(), "disable_tqdm": "true", "max_grad_norm": 0.0,
    }
    return build_trainer(parse_config([x for k, v in argv.items() for x in (f"--{k}", str(v))]))


def trl_trainers(student: Path, teacher: Path, examples: list[dict], out: Path, new_tokens: int, use_cpu: bool,
                 tokenizer: Any) -> dict[str, Any]:
    """GKDTrainer at lmbda 0 and 1 and DistillationTrainer, sharing one student and one teacher (a
    `training_step` leaves the weights as they were)."""
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import DistillationConfig, DistillationTrainer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    logging.getLogger("trl").setLevel(logging.ERROR)  # GKD's "use DistillationTrainer" advice at lmbda 1
    shared = {"per_device_train_batch_size": BATCH, "gradient_accumulation_steps": 1, "beta": BETA,
              "temperature": 1.0, "seed": SEED, "use_cpu": use_cpu, "report_to": "none", "disable_tqdm": True,
              "max_grad_norm": 0.0, "disable_dropout": True, "bf16": False, "gradient_checkpointing": False,
              "pad_to_multiple_of": None}
    models = {"model": AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32),
              "teacher_model": AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32),
              "processing_class": tokenizer}
    trainers = {f"gkd_{lmbda:g}": GKDTrainer(
        args=GKDConfig(output_dir=str(out / f"gkd_{lmbda:g}"), lmbda=lmbda, max_new_tokens=new_tokens, seq_kd=False,
                       max_length=MAX_LENGTH, **shared),
        train_dataset=datasets.Dataset.from_list(examples), **models) for lmbda in (0.0, 1.0)}
    trainers["distillation"] = DistillationTrainer(
        args=DistillationConfig(output_dir=str(out / "distillation"), max_completion_length=new_tokens, top_p=1.0,
                                top_k=0, min_p=None, repetition_penalty=1.0, shuffle_dataset=False, **shared),
        train_dataset=datasets.Dataset.from_list([{"prompt": e["prompt"]} for e in examples]), **models)
    trainers["distillation"].current_gradient_accumulation_steps = 1  # what `train()` sets before a first step
    return trainers


def trl_examples(tokenizer: Any, records: list[dict], template: str) -> list[dict]:
    """TRL's example formats, holding exactly kvdistill's tokens for each record: GKD's pre-tokenized
    example and DistillationTrainer's `prompt` text (which it tokenizes as kvdistill's sampling does)."""
    out = []
    for r in records:
        f = tokenize_example(tokenizer, r, MAX_LENGTH, template)
        ids = f["input_ids"].tolist()
        out.append({"prompt": format_prompt(r["question"], template), "input_ids": ids, "attention_mask": [1] * len(ids),
                    "completion_mask": (f["labels"] != -100).long().tolist()})
    return out


def distillation_inputs(batch: dict, pad_id: int) -> dict[str, torch.Tensor]:
    """A right-padded causal-LM batch (`labels` -100 off the completion) in DistillationTrainer's layout:
    `prompt_ids` left-padded, `completion_ids` right-padded, and their masks. Each row's positions shift by
    its left padding, which rotary attention does not see (it reads relative positions)."""
    from trl.trainer.utils import pad

    prompts, completions = [], []
    for ids, mask, labels in zip(batch["input_ids"], batch["attention_mask"], batch["labels"]):
        answer = (labels != -100).nonzero().flatten()
        start, end = int(answer[0]), int(answer[-1]) + 1
        assert bool((labels[start:end] != -100).all()), "the layouts compare a contiguous completion only"
        prompts.append(ids[:start][mask[:start].bool()])
        completions.append(ids[start:end])
    ones = [torch.ones_like(x) for x in prompts], [torch.ones_like(x) for x in completions]
    return {"prompt_ids": pad(prompts, pad_id, "left"), "prompt_mask": pad(ones[0], 0, "left"),
            "completion_ids": pad(completions, pad_id, "right"), "completion_mask": pad(ones[1], 0, "right")}


def fixed_batch_losses(ours: Any, trl: dict[str, Any], fixed: dict, given: dict) -> dict[str, float]:
    """(c) one fixed batch: the same tokens and weights into each trainer's `compute_loss` (`given`: the batch in
    DistillationTrainer's layout); then the three formulas on the very same logits / final hidden states, at
    loss temperature 1 and 2 (kvdistill's T^2 factor divided out)."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    gkd, distill = trl["gkd_0"], trl["distillation"]
    plain = {k: fixed[k] for k in ("input_ids", "attention_mask", "labels")}
    ids = {k: plain[k] for k in ("input_ids", "attention_mask")}
    student, teacher = ours.distill_model.student, next(iter(ours.teachers)).model
    with torch.no_grad():
        losses = {"loss_kvdistill": float(ours.compute_loss(ours.model, fixed)),
                  "loss_trl_gkd": float(gkd.compute_loss(gkd.model, plain)),
                  "loss_trl_distillation": float(distill.compute_loss(distill.model, given))}
        s_hidden, t_hidden = student.base_model(**ids).last_hidden_state, teacher.base_model(**ids).last_hidden_state
        s_head, t_head = student.get_output_embeddings().weight, teacher.get_output_embeddings().weight  # [V, d]
        s_logits, t_logits = s_hidden @ s_head.T, t_hidden @ t_head.T  # [B, T, V]
        labels = plain["labels"]
        n = (labels[:, 1:] != -100).sum()
        formula = {}
        for temp in (1.0, 2.0):
            ours_f = float(logit_kd_sum(s_logits, t_logits, labels, "jsd", temp, beta=BETA) / n / temp**2)
            gkd_f = float(type(gkd).generalized_jsd_loss(s_logits[:, :-1], t_logits[:, :-1], labels[:, 1:], beta=BETA,
                                                          temperature=temp))
            distill_f = float(_chunked_divergence_loss(
                s_hidden[:, :-1], t_hidden[:, :-1], s_head, t_head,
                (labels[:, 1:] != -100).long(), BETA, temperature=temp)[0])  # its T: no T^2 factor
            formula[temp] = (abs(ours_f - gkd_f), abs(ours_f - distill_f))
    ref = losses["loss_kvdistill"]
    return {**losses, "loss_abs_diff_gkd": abs(ref - losses["loss_trl_gkd"]),
            "loss_abs_diff_distillation": abs(ref - losses["loss_trl_distillation"]),
            "formula_abs_diff_gkd_t1": formula[1.0][0], "formula_abs_diff_distillation_t1": formula[1.0][1],
            "formula_abs_diff_gkd_t2_over_t2": formula[2.0][0],
            "formula_abs_diff_distillation_t2_over_t2": formula[2.0][1]}


def step_fns(ours: Any, trl: dict[str, Any], gold: dict, gkd_batch: dict, given: dict, prompts: list[dict],
             device: torch.device, tokens: dict[str, list[float]]) -> dict[str, Any]:
    """One callable per case: a step of that trainer, weights untouched, the completion tokens per row it was
    taught on appended to `tokens[case]`."""

    def kvdistill(on_policy: bool) -> None:
        batch = ours._prepare_inputs(ours.written_batch(gold, 0, True)) if on_policy else gold
        ours.model.train()
        ours.training_step(ours.model, batch, ours._get_num_items_in_batch([batch], device))
        ours.model.zero_grad(set_to_none=True)
        ours._metrics.clear()
        tokens[f"kvdistill_{'on' if on_policy else 'off'}"].append(float((batch["labels"] != -100).sum()) / BATCH)

    def gkd(lmbda: str) -> None:
        t = trl[f"gkd_{lmbda}"]
        batch = dict(gkd_batch)  # at lmbda 1 the step replaces ids, mask and labels with its samples
        t.training_step(t.model, batch, t._get_num_items_in_batch([gkd_batch], device))
        t.model.zero_grad(set_to_none=True)
        tokens[f"trl_gkd_{'on' if lmbda == '1' else 'off'}"].append(float((batch["labels"] != -100).sum()) / BATCH)

    def distillation_on() -> None:
        t = trl["distillation"]
        t.model.train()
        t.training_step(t.model, prompts, None)  # samples inside (`_prepare_inputs`), then loss and backward
        t.model.zero_grad(set_to_none=True)
        tokens["trl_distillation_on"].append(t._metrics["train"]["completions/mean_length"][-1])
        t._metrics["train"].clear()

    def distillation_given() -> None:
        t = trl["distillation"]
        t.model.train()
        t.accelerator.backward(t.compute_loss(t.model, given))
        t.model.zero_grad(set_to_none=True)
        t._metrics["train"].clear()
        tokens["trl_distillation_given"].append(float(given["completion_mask"].sum()) / BATCH)

    return {"kvdistill_off": partial(kvdistill, False), "trl_gkd_off": partial(gkd, "0"),
            "trl_distillation_given": distillation_given, "kvdistill_on": partial(kvdistill, True),
            "trl_gkd_on": partial(gkd, "1"), "trl_distillation_on": distillation_on}


def build_job(student: Path, teacher: Path, data: Path, root: Path, device: torch.device, new_tokens: int
              ) -> tuple[Any, dict[str, Any], dict, dict, dict, list[dict]]:
    """The job's trainers and batches: `(kvdistill's trainer, TRL's trainers, kvdistill's batch, GKD's batch,
    the batch in DistillationTrainer's layout, its prompts)`, all holding the same first `BATCH` records."""
    ours = kvdistill_trainer(student, teacher, data, root / "kvdistill", new_tokens, device.type == "cpu")
    tok = ours.processing_class
    records = [ours.train_dataset[i] for i in range(BATCH)]
    examples = trl_examples(tok, records, ours.args.prompt_template)
    trl = trl_trainers(student, teacher, examples, root, new_tokens, device.type == "cpu", tok)
    gold = ours._prepare_inputs(ours.data_collator(records))
    gkd_batch = trl["gkd_0"]._prepare_inputs(trl["gkd_0"].data_collator(examples))
    given = {k: v.to(device) for k, v in distillation_inputs(gold, tok.pad_token_id).items()}
    return ours, trl, gold, gkd_batch, given, [{"prompt": e["prompt"]} for e in examples]


def bench_pair(case: str, student: Path, teacher: Path, data: Path, root: Path, device: torch.device,
               new_tokens: int, warmup: int, repeats: int) -> dict[str, Any]:
    ours, trl, gold, gkd_batch, given, prompts = build_job(student, teacher, data, root, device, new_tokens)
    losses = fixed_batch_losses(ours, trl, gold, given)  # before any step: the weights as loaded

    tokens: dict[str, list[float]] = {c: [] for c in ("kvdistill_off", "trl_gkd_off", "trl_distillation_given",
                                                      "kvdistill_on", "trl_gkd_on", "trl_distillation_on")}
    fns = step_fns(ours, trl, gold, gkd_batch, given, prompts, device, tokens)
    times = interleaved_times(fns, repeats, warmup=warmup, device=device)
    peak = {c: measure(fn, device)[2] / 2**20 for c, fn in fns.items()}  # after timing: its profiler slows a step
    cfg = ours.distill_model.student.config
    row = {"case": case, "student_layers": cfg.num_hidden_layers,
           "teacher_layers": next(iter(ours.teachers)).model.config.num_hidden_layers, "vocab": cfg.vocab_size,
           "new_tokens": new_tokens}
    for c in fns:
        row[f"{c}_ms"] = times.ms(c)
    row |= {
        "ratio_vs_trl_distillation": times.ratio("kvdistill_on", "trl_distillation_on"),
        "ratio_vs_trl_gkd_onpolicy": times.ratio("kvdistill_on", "trl_gkd_on"),
        "ratio_vs_trl_gkd_offpolicy": times.ratio("kvdistill_off", "trl_gkd_off"),
        "ratio_off_vs_trl_distillation_given": times.ratio("kvdistill_off", "trl_distillation_given"),
    }
    row |= {f"{c}_tokens": sum(v) / len(v) for c, v in tokens.items()}
    row |= {f"{c}_peak_mib": v for c, v in peak.items()}
    return row | losses


def pairs(root: Path, quick: bool) -> tuple[Path, list[tuple[str, Path | None, Path | str]]]:
    """The data and `(case, student, teacher)` per pair; a missing real model: `(case, None, why)`."""
    world = build_tiny_world(root / "tiny", n_train=64, n_test=8)
    found = [("tiny Qwen2 4 -> 2 layers", world.models["student"], world.models["qwen2_teacher"])]
    for name in ([] if quick else [SMOLLM2, GEMMA]):
        case = f"{name} -> its every other layer"
        teacher = REAL / name
        if not (teacher / "config.json").is_file():
            found.append((case, None, f"{teacher} is missing: run bash scripts/real_pair.sh"))
            continue
        # a directory name without dots: kvdistill reads a teacher's name from its path
        found.append((case, prune(teacher, "every_other", root / f"{name.split('-')[0]}_every_other"), teacher))
    return world.data_dir, found


def run(quick: bool = False) -> dict[str, Any]:
    """kvdistill vs TRL's DistillationTrainer and GKDTrainer: step times, losses on one batch, peak memory."""
    head = {"name": "peer", "title": "kvdistill vs TRL (DistillationTrainer, GKDTrainer) on the same job"}
    if find_spec("trl") is None:
        return {**head, "skipped": SKIP, "results": []}
    import trl

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    warmup, repeats, new_tokens = (1, 3, 8) if quick else (2, 7, 64)
    with torch_threads(1), tempfile.TemporaryDirectory(prefix="kvdistill_bench_peer_") as tmp:
        root = Path(tmp)
        data, found = pairs(root, quick)
        rows = [{"case": case, "skipped": teacher} if student is None else
                bench_pair(case, student, Path(teacher), data, root / f"pair{i}", device, new_tokens, warmup, repeats)
                for i, (case, student, teacher) in enumerate(found)]
    timed = [r for r in rows if "skipped" not in r]
    ratio = max(r["ratio_vs_trl_distillation"] for r in timed)
    losses = ("loss_abs_diff_gkd", "loss_abs_diff_distillation", "formula_abs_diff_gkd_t1",
              "formula_abs_diff_distillation_t1", "formula_abs_diff_gkd_t2_over_t2",
              "formula_abs_diff_distillation_t2_over_t2")
    return {
        **head,
        "description": f"Same student, teacher (shared vocabulary), records, batch {BATCH}, seed; logit-only "
        f"generalized JSD (beta {BETA}, loss temperature 1, no LM loss). (a) off-policy step (DistillationTrainer "
        "has no off-policy mode: `trl_distillation_given` is its compute_loss + backward on the data's "
        f"completions), (b) on-policy step ({new_tokens} sampled tokens at most, temperature 1, top_k 0, top_p 1; "
        "`*_tokens`: completion tokens per row, sampling stops at EOS), (c) each trainer's compute_loss on one "
        f"fixed batch and the three formulas on the same logits (must agree to {LOSS_ATOL}; at loss temperature 2 "
        "with kvdistill's T^2 divided out), (d) `*_peak_mib`: peak memory of one step above its start. Median of "
        f"{repeats} interleaved repeats after {warmup} warm-up, 1 torch thread, {device.type}, trl {trl.__version__}; "
        "every matched setting is under `settings` (TRL's defaults bf16 and gradient_checkpointing True turned "
        "off). Definitions differ in the loss temperature only: GKD's loss is always at 1, DistillationTrainer's "
        "`temperature` is its sampling and loss temperature without a T^2 factor, kvdistill's "
        "`logit_kd_temperature` T scales by T^2.",
        "results": rows,
        "ratio": ratio,
        "target": TARGET,
        "passed": ratio <= TARGET,
        "ratio_vs_trl_distillation": ratio,
        "ratio_vs_trl": max(max(r["ratio_vs_trl_gkd_offpolicy"], r["ratio_vs_trl_gkd_onpolicy"]) for r in timed),
        "losses_equal": max(r[k] for r in timed for k in losses) <= LOSS_ATOL,
        "settings": SETTINGS | {"max_new_tokens": new_tokens},
        "trl_version": trl.__version__,
        "device": device.type,
        "torch_threads": 1,
        "quick": quick,
    }


if __name__ == "__main__":
    run_standalone(run, __doc__, "the tiny pair, 8 new tokens, 3 repeats")
