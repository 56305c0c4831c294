"""Benchmark: one full distillation step against its floor.

- full step: what `KVDistillTrainer` runs per micro-batch, `compute_loss` + `backward`: every
  teacher's forward under no_grad (KV stacked), the student's forward with its KV, time / layer /
  head / dim alignment per teacher, Mercator KV loss, CE, the logged metrics, and the backward
  through student + aligners.
- floor: what any distillation from these teachers costs at least, the same teachers' plain
  forwards (`use_cache=True`, no_grad, the head on the last position only: a KV loss reads no teacher
  logits) + the student's forward/backward with CE only.

`ratio = full / floor`, the median of the paired ratios of interleaved repeats (full and floor
alternate, after warm-up: `kvdistill.commands.bench.interleaved_times`), so a machine that slows down mid-run hits both. Target: <= 1.10 on the
realistic pair below, with one teacher and with two (the headline is the larger ratio). The tiny
fixtures row is for reference only: at 32-dim models the fixed per-op cost of the aligners and
metrics dominates, whatever the shapes.

Pairs (random init, saved and loaded like real models; the fixtures' BPE tokenizer; batch 2, the
recipe's per-device batch, of the synthetic GSM8K-style problems, about 100-190 tokens each):
- tiny: the test fixtures (student Qwen2 2 x 32, teachers Qwen2 4 x 64 and Llama 3 x 96 on another
  tokenizer);
- real (models/real, which `scripts/real_pair.sh` installs; otherwise a row that says so): Gemma-3-270m
  teaching SmolLM2-135M-Instruct, other tokenizers, 18 x 1 x 256 vs 30 x 3 x 64 caches, CPU fp32, short
  sequences (`REAL_MAX_LENGTH`: the records are 53-86 tokens in either tokenizer, none is cut); its own row,
  `real_pair_over_floor`, held to the same target (`passed` needs it when measured);
- large: student Qwen2 8 layers x 256 (2 KV heads x 64, 7 M params), teachers Qwen2 12 x 512
  (2 KV heads x 64) and Llama 12 x 512 (4 KV heads x 64), 36-37 M params each, vocab 4096: a step
  takes about half a second on one core.
`--quick` swaps the large pair for a half-size one and runs fewer repeats (the real pair: one, no warm-up).

Threads: `torch.set_num_threads(1)` for the run (restored after), so the numbers do not depend on
how many cores happen to be free; the optimizer step is outside both timings (it is the same).

Memory: peak bytes allocated *during* one step above what was allocated before it (weights are
not counted; activations, KV stacks, aligned targets and gradients are). CUDA:
`torch.cuda.max_memory_allocated`; CPU: the running sum of `torch.profiler` memory events
(`kvdistill.commands.profile.measure`). `tracemalloc` cannot see torch's CPU allocator, and `ru_maxrss`
is a process-wide high-water mark that warm-up already pushed up. Process max RSS is reported for
context only.

    python benchmarks/bench_step.py [--quick]
    kvdistill bench --only step
"""

from __future__ import annotations

import resource
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, Qwen2Config

from kvdistill.commands.bench import interleaved_times, run_standalone, torch_threads
from kvdistill.commands.profile import measure
from kvdistill.losses import token_ce_sum
from kvdistill.models import load_tokenizer
from kvdistill.real_pair import STUDENT, TEACHER
from kvdistill.tiny import build_tiny_world, save_random_model
from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config

TARGET = 1.10
BATCH = 2  # the recipe's per_device_train_batch_size

# name -> (architecture, hidden, layers, attention heads, KV heads, MLP width)
LARGE = {
    "student": ("qwen2", 256, 8, 4, 2, 704),
    "teacher_qwen2": ("qwen2", 512, 12, 8, 2, 1408),
    "teacher_llama": ("llama", 512, 12, 8, 4, 1408),
}
QUICK = {
    "student": ("qwen2", 128, 4, 2, 1, 352),
    "teacher_qwen2": ("qwen2", 256, 6, 4, 2, 704),
    "teacher_llama": ("llama", 256, 6, 4, 2, 704),
}
VOCAB = 4096
REAL_DIR = Path(__file__).resolve().parents[1] / "models" / "real"  # scripts/real_pair.sh links the pair here
REAL_SKIPPED = "skipped: run scripts/real_pair.sh"
REAL_MAX_LENGTH = 96
REAL_CASE = "real pair: Gemma-3-270m -> SmolLM2-135M"


def make_pair(root: Path, tokenizer_dir: Path, sizes: dict[str, tuple]) -> dict[str, Path]:
    """Random-init models of `sizes`, saved with the fixtures' tokenizer (loaded back like real ones)."""
    tok = load_tokenizer(tokenizer_dir)
    paths = {}
    for i, (name, (arch, hidden, layers, heads, kv_heads, inter)) in enumerate(sizes.items()):
        cls = Qwen2Config if arch == "qwen2" else LlamaConfig
        cfg = cls(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        )
        torch.manual_seed(i)
        paths[name] = save_random_model(cfg, tok, root / name)
    return paths


def real_pair_dirs() -> dict[str, Path] | None:
    """`{STUDENT: dir, TEACHER: dir}` of the real pair in models/real, or None where it is not installed."""
    dirs = {name: REAL_DIR / name for name in (STUDENT, TEACHER)}
    return dirs if all((d / "config.json").is_file() for d in dirs.values()) else None


def bench_case(
    case: str,
    student: Path,
    teachers: list[Path],
    data: Path,
    out: Path,
    device: torch.device,
    warmup: int,
    repeats: int,
    max_length: int = 256,
) -> dict[str, Any]:
    """Time and measure one full step and its floor for one student/teachers pair."""
    teacher_list = "[" + ", ".join(f"{{path: {p}}}" for p in teachers) + "]"
    argv = {
        "student": student,
        "teachers": teacher_list,
        "data": data,
        "output_dir": out,
        "max_samples": 32,
        "max_length": max_length,
        "kv_weight": 0.1,
        "kv_warmup_steps": 0,
        "kv_loss": "mercator",
        "fusion": "loss_sum",
        "per_device_train_batch_size": BATCH,
        "gradient_accumulation_steps": 1,
        "report_to": "none",
        "use_cpu": str(device.type == "cpu").lower(),
        "disable_tqdm": "true",
    }
    trainer = build_trainer(parse_config([x for k, v in argv.items() for x in (f"--{k}", str(v))]))
    model = trainer.model
    model.train()
    ds = trainer.train_dataset
    batch = trainer._prepare_inputs(trainer.data_collator([ds[i] for i in range(BATCH)]))
    counts = trainer._get_num_items_in_batch([batch], device)
    student_lm = trainer.distill_model.student

    def full() -> None:
        model.zero_grad(set_to_none=True)
        trainer.compute_loss(model, batch, num_items_in_batch=counts).backward()
        trainer._metrics.clear()

    def floor() -> None:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for t in trainer.teachers:
                src = batch.get("teacher_inputs", {}).get(t.name, batch)
                t.model(input_ids=src["input_ids"], attention_mask=src["attention_mask"], use_cache=True,
                        logits_to_keep=1)
        logits = student_lm(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
        ).logits
        (token_ce_sum(logits, batch["labels"]) / counts[0]).backward()

    times = interleaved_times({"full": full, "floor": floor}, repeats, warmup=warmup, device=device)
    _, _, peak_full = measure(full, device)
    _, _, peak_floor = measure(floor, device)
    params = {
        "student": sum(p.numel() for p in student_lm.parameters()),
        "aligners": sum(
            p.numel() for n, p in trainer.distill_model.named_parameters() if not n.startswith("student.")
        ),
        "teachers": sum(p.numel() for t in trainer.teachers for p in t.model.parameters()),
    }
    full_ms, floor_ms = times.ms("full"), times.ms("floor")
    return {
        "case": case,
        "tokens": int(batch["attention_mask"].sum()),
        "student_M": params["student"] / 1e6,
        "teachers_M": params["teachers"] / 1e6,
        "aligners_M": params["aligners"] / 1e6,
        "full_ms": full_ms,
        "floor_ms": floor_ms,
        "overhead_ms": full_ms - floor_ms,
        "ratio": times.ratio("full", "floor"),
        "cpu_ratio": times.ratio("full", "floor", "cpu"),
        "peak_full_mib": peak_full / 2**20,
        "peak_floor_mib": peak_floor / 2**20,
    }


def run(quick: bool = False) -> dict[str, Any]:
    """Full step vs floor on the tiny fixtures and a larger pair; a JSON-able dict for `kvdistill bench`."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    warmup, repeats = (1, 3) if quick else (3, 11)
    with torch_threads(1), tempfile.TemporaryDirectory(prefix="kvdistill_bench_step_") as tmp:
        root = Path(tmp)
        world = build_tiny_world(root / "tiny", n_train=64, n_test=8)
        m = world.models
        large = make_pair(root / "large", world.tokenizers["bpe"], QUICK if quick else LARGE)
        large_name = "half-size pair (quick)" if quick else "large pair"
        pair = [large["teacher_qwen2"], large["teacher_llama"]]
        rows = [
            bench_case(
                "tiny fixtures, 2 teachers",
                m["student"],
                [m["qwen2_teacher"], m["llama_teacher_alt_tok"]],
                world.data_dir,
                root / "run_tiny",
                device,
                warmup,
                repeats,
            ),
            bench_case(
                f"{large_name}, 1 teacher",
                large["student"],
                pair[:1],
                world.data_dir,
                root / "run_large1",
                device,
                warmup,
                repeats,
            ),
            bench_case(
                f"{large_name}, 2 teachers",
                large["student"],
                pair,
                world.data_dir,
                root / "run_large2",
                device,
                warmup,
                repeats,
            ),
        ]
        real = real_pair_dirs()
        if real is None:
            rows.append({"case": REAL_CASE, "skipped": REAL_SKIPPED})
        else:
            rows.append(bench_case(REAL_CASE, real[STUDENT], [real[TEACHER]], world.data_dir, root / "run_real",
                                   device, *((0, 1) if quick else (warmup, repeats)), max_length=REAL_MAX_LENGTH))
    ratio = max(r["ratio"] for r in rows[1:3])  # the stricter of the two synthetic realistic rows
    real_ratio = rows[3].get("ratio")
    return {
        "name": "step",
        "title": "Distillation step vs its floor (teacher forwards + student CE step)",
        "description": f"`compute_loss` + backward of `KVDistillTrainer` (flat linear aligners, "
        f"segment time alignment, Mercator) vs the same teachers' plain forwards (head on the last position "
        f"only) + the student's CE forward/backward; batch {BATCH}, median of {repeats} interleaved repeats after "
        f"{warmup} warm-up, 1 torch thread, {device.type}. ratio = median of paired full/floor ratios (cpu_ratio: "
        f"the same in process CPU time, which other jobs on the machine do not inflate); the headline is the "
        f"larger of the two {large_name} rows; the real pair (max_length {REAL_MAX_LENGTH}, fp32) is held to the "
        f"same target. Peak = bytes allocated during one step above the start "
        f"({'CUDA max_memory_allocated' if device.type == 'cuda' else 'torch.profiler memory events'}).",
        "results": rows,
        "ratio": ratio,
        "target": TARGET,
        "passed": ratio <= TARGET and (real_ratio is None or real_ratio <= TARGET),
        "over_floor": ratio,
        "real_pair_over_floor": real_ratio,
        "tiny_ratio": rows[0]["ratio"],
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "device": device.type,
        "torch_threads": 1,
        "quick": quick,
    }


if __name__ == "__main__":
    run_standalone(run, __doc__, "half-size pair, fewer repeats (about a minute)")
