"""Benchmark: an on-policy distillation step, and its generation against the student's own `generate`.

- off-policy step: what `KVDistillTrainer` runs per micro-batch on the data's answers,
  `compute_loss` + `backward` (two teachers: one sharing the student's tokenizer, one with another;
  logit KD (generalized JSD, beta 0.5) from the first, Mercator KV from both).
- on-policy step: the same after the batch is rewritten (`KVDistillTrainer.written_batch`): the
  student samples a completion per prompt, every reader re-tokenizes the text, then the same
  `compute_loss` + `backward` on it.
- generation: `onpolicy.sample_completions` on the batch's prompts (tokenize, left-padded batched
  `generate` with the KV cache, seeded in a forked RNG, decode, cut at EOS).
- floor: the student's own `generate` on the same pre-tokenized prompts, the same sampling settings,
  seed and token budget (so the same tokens come out): the work no implementation can skip.

Headline `over_floor` = generation / floor (target <= 1.15), the median of paired ratios of
interleaved repeats (`kvdistill.commands.bench.interleaved_times`). `step_ratio` = on-policy step /
off-policy step is reported beside it (no target: it is the price of generating, which grows with
`max_new_tokens`).

Pairs: the test fixtures (student Qwen2 2 x 32; teachers Qwen2 4 x 64 and Llama 3 x 96 on another
tokenizer) and `bench_step.py`'s large pair (its half-size pair with `--quick`). Batch 2, 64 new
tokens (16 with `--quick`), 1 torch thread.

    python benchmarks/bench_onpolicy.py [--quick]
    kvdistill bench --only onpolicy
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from kvdistill.commands.bench import interleaved_times, load_benchmark, run_standalone, torch_threads
from kvdistill.data import format_prompt
from kvdistill.onpolicy import sample_completions
from kvdistill.tiny import build_tiny_world
from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config

TARGET = 1.15
BATCH = 2
SEED = 1234


def bench_case(case: str, student: Path, teachers: list[Path], data: Path, out: Path, device: torch.device,
               new_tokens: int, warmup: int, repeats: int) -> dict[str, Any]:
    """Time the off-/on-policy steps and the generation against its floor for one student/teachers pair."""
    argv = {
        "student": student, "teachers": "[" + ", ".join(f"{{path: {p}}}" for p in teachers) + "]",
        "data": data, "output_dir": out, "max_samples": 32, "max_length": 256,
        "kv_weight": 0.1, "kv_warmup_steps": 0, "logit_kd_weight": 1.0, "logit_kd_kind": "jsd", "beta": 0.5,
        "lmbda": 1.0, "temperature": 1.0, "max_new_tokens": new_tokens, "seed": SEED,
        "per_device_train_batch_size": BATCH, "gradient_accumulation_steps": 1, "report_to": "none",
        "use_cpu": str(device.type == "cpu").lower(), "disable_tqdm": "true",
    }
    trainer = build_trainer(parse_config([x for k, v in argv.items() for x in (f"--{k}", str(v))]))
    model, args = trainer.model, trainer.args
    model.train()
    records = [trainer.train_dataset[i] for i in range(BATCH)]
    gold = trainer.data_collator(records)
    student, tok = trainer.distill_model.student, trainer.processing_class
    prompts = [format_prompt(r["question"], args.prompt_template) for r in records]
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "max_new_tokens": new_tokens,
                "max_length": args.max_length}

    def step(batch: dict) -> None:
        batch = trainer._prepare_inputs(batch)
        counts = trainer._get_num_items_in_batch([batch], device)
        model.zero_grad(set_to_none=True)
        trainer.compute_loss(model, batch, num_items_in_batch=counts).backward()
        trainer._metrics.clear()

    def generation() -> None:
        sample_completions(student, tok, prompts, **sampling, seed=SEED)

    side, tok.padding_side = tok.padding_side, "left"
    enc = tok(prompts, return_tensors="pt", padding=True).to(device)  # [B, T_prompt], left-padded
    tok.padding_side = side
    budget = min(new_tokens, args.max_length - enc["input_ids"].shape[1])

    @torch.no_grad()
    def floor() -> None:
        student.eval()
        with torch.random.fork_rng(devices=[device] if device.type != "cpu" else [], device_type=device.type):
            torch.manual_seed(SEED)
            student.generate(**enc, max_new_tokens=budget, do_sample=True, temperature=args.temperature,
                             top_p=args.top_p, top_k=0, use_cache=True, pad_token_id=tok.pad_token_id)
        student.train()

    fns = {"off_policy": lambda: step(gold), "on_policy": lambda: step(trainer.written_batch(gold, 0, True)),
           "generation": generation, "floor": floor}
    times = interleaved_times(fns, repeats, warmup=warmup, device=device)
    written = trainer.written_batch(gold, 0, True)
    return {
        "case": case,
        "completion_tokens": int((written["labels"] != -100).sum()),  # re-tokenized, both rows
        "off_policy_ms": times.ms("off_policy"),
        "on_policy_ms": times.ms("on_policy"),
        "generation_ms": times.ms("generation"),
        "floor_ms": times.ms("floor"),
        "step_ratio": times.ratio("on_policy", "off_policy"),
        "over_floor": times.ratio("generation", "floor"),
        "cpu_over_floor": times.ratio("generation", "floor", "cpu"),
    }


def run(quick: bool = False) -> dict[str, Any]:
    """On-/off-policy steps and generation vs floor on the tiny fixtures and a larger pair."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    warmup, repeats, new_tokens = (1, 3, 16) if quick else (2, 9, 64)
    step_bench = load_benchmark(Path(__file__).with_name("bench_step.py"))  # its pairs, not a copy of them
    with torch_threads(1), tempfile.TemporaryDirectory(prefix="kvdistill_bench_onpolicy_") as tmp:
        root = Path(tmp)
        world = build_tiny_world(root / "tiny", n_train=64, n_test=8)
        m = world.models
        large = step_bench.make_pair(root / "large", world.tokenizers["bpe"],
                                     step_bench.QUICK if quick else step_bench.LARGE)
        rows = [
            bench_case("tiny fixtures, 2 teachers", m["student"], [m["qwen2_teacher"], m["llama_teacher_alt_tok"]],
                       world.data_dir, root / "run_tiny", device, new_tokens, warmup, repeats),
            bench_case("half-size pair (quick), 2 teachers" if quick else "large pair, 2 teachers", large["student"],
                       [large["teacher_qwen2"], large["teacher_llama"]], world.data_dir, root / "run_large", device,
                       new_tokens, warmup, repeats),
        ]
    ratio = rows[-1]["over_floor"]
    return {
        "name": "onpolicy",
        "title": "On-policy distillation step, and its generation vs the student's own generate",
        "description": f"off_policy / on_policy: `compute_loss` + backward of `KVDistillTrainer` on the data's "
        f"answers / after `written_batch` (the student samples, every reader re-tokenizes); generation: "
        f"`onpolicy.sample_completions`; floor: the student's own `generate` on the same pre-tokenized prompts, "
        f"seed and budget ({new_tokens} new tokens). Batch {BATCH}, median of {repeats} interleaved repeats after "
        f"{warmup} warm-up, 1 torch thread, {device.type}. Headline over_floor = generation / floor on the larger "
        "pair; step_ratio = on-policy / off-policy step.",
        "results": rows,
        "ratio": ratio,
        "target": TARGET,
        "passed": ratio <= TARGET,
        "over_floor": ratio,
        "step_ratio": rows[-1]["step_ratio"],
        "device": device.type,
        "torch_threads": 1,
        "quick": quick,
    }


if __name__ == "__main__":
    run_standalone(run, __doc__, "tiny and half-size pairs, 16 new tokens, 3 repeats")
