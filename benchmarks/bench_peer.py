"""Benchmark: kvdistill side by side with TRL's GKDTrainer on the same job.

The same student and teacher (one teacher sharing the student's tokenizer, logit-only distillation:
generalized JSD with `BETA`, no LM loss, no KV term), the same records, batch, seed and sampling
settings, both trainers built in this process and timed interleaved (`interleaved_times`):

- (a) off-policy KD step: `KVDistillTrainer.training_step` (lmbda 0) vs `GKDTrainer.training_step`
  (lmbda 0, seq_kd off) on the same records: forward of both models, the loss, backward.
- (b) on-policy step (lmbda 1): kvdistill's `written_batch` (the student samples, every reader
  re-tokenizes) + `training_step`, vs `GKDTrainer.training_step`, which samples inside (lmbda 1).
  Both sample `NEW_TOKENS` tokens at temperature 1, top_k off, top_p 1 (TRL's GKD has no top_p).
- (c) the loss of both trainers' `compute_loss` on one fixed batch (the same input_ids,
  attention_mask, labels tensors; the same weights), which must agree to 1e-5.

Precision: both teachers run in fp32 for (a)-(c). TRL's `GKDConfig` inherits `SFTConfig`'s default
`bf16=True`, under which `GKDTrainer.__init__` prepares the teacher with the accelerator, which wraps
its forward in bf16 autocast (the student only once `train()` prepares it, which the timed
`training_step` never calls): left at that default, TRL's teacher forward ran in bf16 against
kvdistill's fp32 one: all of the off-policy step's 1.23x (profiled: 0.98x at equal precision). So `bf16=False`
here, and a separate pair of cases, `*_bf16`, times TRL at that default against kvdistill with the
teacher's weights in bf16 (`dtype: bf16` in its teacher spec; kvdistill's `bf16: true` autocasts the
student only): the same speed-up taken kvdistill's way (their losses differ in bf16 rounding).

Where the definitions differ (reported, not hidden): TRL's GKD `temperature` is the sampling
temperature only, its loss always uses softmax temperature 1; kvdistill's `temperature` is the
sampling temperature too, and its loss temperature `logit_kd_temperature` T divides both logits
and scales the sum by T^2 (Hinton et al.). At T = 1 (used here) the two losses are the same
formula: sum of TRL's generalized JSD over completion tokens / their count. TRL's `beta` and
kvdistill's `beta` (logit_kd_kind jsd) mean the same. kvdistill's KD reads the tokenizer's
vocabulary rows of the heads only (the large pair pads them to 4,096 rows for 320 tokens), TRL's
every row: (c) reports the loss as configured and with every row read (`*_all_rows`), which must
agree with TRL's.

Headline `ratio_vs_trl` = the larger of the (a) and (b) step-time ratios kvdistill / TRL, fp32
teachers (target <= 1.0); `ratio_vs_trl_offpolicy_bf16` is (a) with bf16 teachers. Skipped, with
the reason, when `trl` is not installed (`pip install 'kvdistill[peer]'`).
`--quick`: the tiny fixtures, 8 new tokens, 3 repeats; otherwise `bench_step.py`'s large pair's
student and Qwen2 teacher, 64 new tokens. Batch 2, 1 torch thread.

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

from kvdistill.commands.bench import interleaved_times, load_benchmark, run_standalone, torch_threads
from kvdistill.data import format_prompt, tokenize_example
from kvdistill.losses import logit_kd_sum
from kvdistill.tiny import build_tiny_world
from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config

TARGET = 1.0
BATCH = 2
BETA = 0.5
SEED = 1234
LOSS_ATOL = 1e-5
SKIP = "trl is not installed (pip install 'kvdistill[peer]')"


def kvdistill_trainer(student: Path, teacher: Path, data: Path, out: Path, lmbda: float, new_tokens: int,
                      use_cpu: bool, teacher_dtype: str = "auto"):
    argv = {
        "student": student, "teachers": f"[{{path: {teacher}, dtype: {teacher_dtype}}}]", "data": data,
        "output_dir": out,
        "max_samples": 32, "max_length": 256, "ce_weight": 0.0, "allow_kv_only": "true", "kv_weight": 0.0,
        "logit_kd_weight": 1.0, "logit_kd_kind": "jsd", "beta": BETA, "logit_kd_temperature": 1.0,
        "lmbda": lmbda, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": new_tokens, "seed": SEED,
        "per_device_train_batch_size": BATCH, "gradient_accumulation_steps": 1, "report_to": "none",
        "use_cpu": str(use_cpu).lower(), "disable_tqdm": "true", "max_grad_norm": 0.0,
    }
    return build_trainer(parse_config([x for k, v in argv.items() for x in (f"--{k}", str(v))]))


def trl_trainer(student: Path, teacher: Path, examples: list[dict], out: Path, lmbda: float, new_tokens: int,
                use_cpu: bool, tokenizer: Any, bf16: bool = False):
    import datasets
    from transformers import AutoModelForCausalLM
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    logging.getLogger("trl").setLevel(logging.ERROR)  # its "use DistillationTrainer" advice at lmbda 1
    args = GKDConfig(output_dir=str(out), per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
                     lmbda=lmbda, beta=BETA, temperature=1.0, max_new_tokens=new_tokens, seq_kd=False,
                     max_length=256, seed=SEED, use_cpu=use_cpu, report_to="none", disable_tqdm=True,
                     max_grad_norm=0.0, disable_dropout=True, bf16=bf16)  # bf16: autocasts the teacher
    return GKDTrainer(model=AutoModelForCausalLM.from_pretrained(student),
                      teacher_model=AutoModelForCausalLM.from_pretrained(teacher), args=args,
                      train_dataset=datasets.Dataset.from_list(examples), processing_class=tokenizer)


def trl_examples(tokenizer: Any, records: list[dict], template: str) -> list[dict]:
    """TRL's pre-tokenized example format, holding exactly kvdistill's tokens for each record."""
    out = []
    for r in records:
        f = tokenize_example(tokenizer, r, 256, template)
        ids = f["input_ids"].tolist()
        out.append({"prompt": format_prompt(r["question"], template), "input_ids": ids, "attention_mask": [1] * len(ids),
                    "completion_mask": (f["labels"] != -100).long().tolist()})
    return out


def trainer_pair(student: Path, teacher: Path, data: Path, root: Path, lmbda: float, new_tokens: int,
                 use_cpu: bool, bf16: bool = False) -> tuple[Any, Any, dict, dict]:
    """kvdistill's and TRL's trainer on the same job, and each one's batch of the same first `BATCH` records.
    `bf16`: TRL at its default (bf16 autocast of the teacher), kvdistill with the teacher's weights in
    bf16."""
    tag = f"{lmbda}{'_bf16' if bf16 else ''}"
    ours = kvdistill_trainer(student, teacher, data, root / f"kvd_{tag}", lmbda, new_tokens, use_cpu,
                             "bf16" if bf16 else "auto")
    tok = ours.processing_class
    records = [ours.train_dataset[i] for i in range(BATCH)]
    examples = trl_examples(tok, records, ours.args.prompt_template)
    peer = trl_trainer(student, teacher, examples, root / f"trl_{tag}", lmbda, new_tokens, use_cpu, tok, bf16)
    return (ours, peer, ours._prepare_inputs(ours.data_collator(records)),
            peer._prepare_inputs(peer.data_collator(examples)))


def fixed_batch_losses(ours: Any, peer: Any, fixed: dict) -> dict[str, float]:
    """(c) one fixed batch: the same tensors into both `compute_loss`, the same weights; kvdistill's as
    configured (the tokenizer's vocabulary rows) and reading every head row as TRL does; then both loss
    formulas on the very same logits, at loss temperature 1 and 2 (kvdistill's T^2 factor divided out)."""
    model = ours.distill_model
    with torch.no_grad():
        loss_ours = float(ours.compute_loss(ours.model, fixed))
        vocab, model.vocab_size = model.vocab_size, None  # None: every row of the heads
        try:
            loss_all_rows = float(ours.compute_loss(ours.model, fixed))
        finally:
            model.vocab_size = vocab
        plain = {k: fixed[k] for k in ("input_ids", "attention_mask", "labels")}
        loss_peer = float(peer.compute_loss(peer.model, plain))
        student_logits = ours.distill_model.student(**{k: plain[k] for k in ("input_ids", "attention_mask")}).logits
        teacher_logits = next(iter(ours.teachers)).model(**{k: plain[k] for k in ("input_ids", "attention_mask")}).logits
        n = (plain["labels"][:, 1:] != -100).sum()
        formula = {}
        for temp in (1.0, 2.0):
            ours_f = logit_kd_sum(student_logits, teacher_logits, plain["labels"], "jsd", temp, beta=BETA) / n / temp**2
            peer_f = type(peer).generalized_jsd_loss(student_logits[:, :-1], teacher_logits[:, :-1],
                                                     plain["labels"][:, 1:], beta=BETA, temperature=temp)
            formula[temp] = abs(float(ours_f) - float(peer_f))
    return {"loss_kvdistill": loss_ours, "loss_trl": loss_peer, "loss_abs_diff": abs(loss_ours - loss_peer),
            "loss_kvdistill_all_rows": loss_all_rows,
            "loss_abs_diff_all_rows": abs(loss_all_rows - loss_peer),
            "formula_abs_diff_t1": formula[1.0], "formula_abs_diff_t2_over_t2": formula[2.0]}


def bench_pair(case: str, student: Path, teacher: Path, data: Path, root: Path, device: torch.device,
               new_tokens: int, warmup: int, repeats: int) -> dict[str, Any]:
    cases = {"off": (0.0, False), "on": (1.0, False), "off_bf16": (0.0, True)}  # (lmbda, bf16 teachers)
    pairs = {c: trainer_pair(student, teacher, data, root, lm, new_tokens, device.type == "cpu", bf16)
             for c, (lm, bf16) in cases.items()}

    def ours_step(case: str) -> None:
        t, _, gold, _ = pairs[case]
        batch = t._prepare_inputs(t.written_batch(gold, 0, True)) if cases[case][0] else gold
        t.model.train()
        t.training_step(t.model, batch, t._get_num_items_in_batch([batch], device))
        t.model.zero_grad(set_to_none=True)
        t._metrics.clear()

    def peer_step(case: str) -> None:
        _, t, _, batch = pairs[case]
        t.training_step(t.model, batch, t._get_num_items_in_batch([batch], device))
        t.model.zero_grad(set_to_none=True)

    steps = {"kvdistill": ours_step, "trl": peer_step}
    fns = {f"{who}_{c}": partial(step, c) for c in cases for who, step in steps.items()}
    times = interleaved_times(fns, repeats, warmup=warmup, device=device)

    return {
        "case": case,
        "kvdistill_off_ms": times.ms("kvdistill_off"), "trl_off_ms": times.ms("trl_off"),
        "ratio_vs_trl_offpolicy": times.ratio("kvdistill_off", "trl_off"),
        "kvdistill_on_ms": times.ms("kvdistill_on"), "trl_on_ms": times.ms("trl_on"),
        "ratio_vs_trl_onpolicy": times.ratio("kvdistill_on", "trl_on"),
        "kvdistill_off_bf16_ms": times.ms("kvdistill_off_bf16"), "trl_off_bf16_ms": times.ms("trl_off_bf16"),
        "ratio_vs_trl_offpolicy_bf16": times.ratio("kvdistill_off_bf16", "trl_off_bf16"),
        # training_step above leaves the weights untouched (no optimizer step)
        **fixed_batch_losses(*pairs["off"][:3]),
    }


def run(quick: bool = False) -> dict[str, Any]:
    """kvdistill vs TRL's GKDTrainer: step times (off-/on-policy) and the loss on one batch."""
    head = {"name": "peer", "title": "kvdistill vs TRL (GKDTrainer) on the same job"}
    if find_spec("trl") is None:
        return {**head, "skipped": SKIP, "results": []}
    import trl

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    warmup, repeats, new_tokens = (1, 3, 8) if quick else (2, 9, 64)
    with torch_threads(1), tempfile.TemporaryDirectory(prefix="kvdistill_bench_peer_") as tmp:
        root = Path(tmp)
        world = build_tiny_world(root / "tiny", n_train=64, n_test=8)
        if quick:
            student, teacher, case = world.models["student"], world.models["qwen2_teacher"], "tiny fixtures"
        else:
            step_bench = load_benchmark(Path(__file__).with_name("bench_step.py"))
            large = step_bench.make_pair(root / "large", world.tokenizers["bpe"], step_bench.LARGE)
            student, teacher, case = large["student"], large["teacher_qwen2"], "large pair, Qwen2 teacher"
        row = bench_pair(case, student, teacher, world.data_dir, root, device, new_tokens, warmup, repeats)
    ratio = max(row["ratio_vs_trl_offpolicy"], row["ratio_vs_trl_onpolicy"])
    return {
        **head,
        "description": f"Same student, teacher (shared tokenizer), records, batch {BATCH}, seed; logit-only "
        f"generalized JSD (beta {BETA}, loss temperature 1, no LM loss); (a) off-policy and (b) on-policy "
        f"(lmbda 1, {new_tokens} sampled tokens, temperature 1) `training_step` times, fp32 teachers (TRL's "
        f"GKDConfig bf16=False: its default True autocasts the teacher in bf16), median of {repeats} "
        f"interleaved repeats after {warmup} warm-up, 1 torch thread, {device.type}; *_bf16: (a) with "
        "TRL's default bf16 autocast of the teacher vs kvdistill's teacher weights in bf16 (`dtype: bf16`); "
        f"(c) both `compute_loss` on the same tensors (must agree to {LOSS_ATOL} with kvdistill "
        "reading every head row, `*_all_rows`, as TRL does), and both loss formulas on the same logits "
        "(formula_*: at loss temperature 1, and at 2 with kvdistill's T^2 divided out). "
        f"trl {trl.__version__}. Definitions differ in the loss temperature (TRL's GKD trainer: always 1; "
        "kvdistill: logit_kd_temperature T with a T^2 factor) and the vocabulary read (kvdistill: the "
        "tokenizer's rows of a padded head; TRL: every row).",
        "results": [row],
        "ratio": ratio,
        "target": TARGET,
        "passed": ratio <= TARGET,
        "ratio_vs_trl": ratio,
        "ratio_vs_trl_offpolicy": row["ratio_vs_trl_offpolicy"],
        "ratio_vs_trl_onpolicy": row["ratio_vs_trl_onpolicy"],
        "ratio_vs_trl_offpolicy_bf16": row["ratio_vs_trl_offpolicy_bf16"],
        "losses_equal": max(row["loss_abs_diff_all_rows"], row["formula_abs_diff_t1"]) <= LOSS_ATOL,
        "trl_version": trl.__version__,
        "device": device.type,
        "torch_threads": 1,
        "quick": quick,
    }


if __name__ == "__main__":
    run_standalone(run, __doc__, "tiny fixtures, 8 new tokens, 3 repeats")
