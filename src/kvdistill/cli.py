"""`kvdistill` command line: parses the sub-command and hands the rest to one command module.

Each command is a module of `kvdistill.commands` with a `main(argv) -> int`; modules are imported
only when their command runs, so `kvdistill --help` stays fast and a broken optional dependency
of one command does not break the others. The dispatcher owns the error policy: a problem with
the user's input (`ConfigError`, `DataError`, `ModelLoadError`, ...) prints one line naming the
problem and the fix and exits 2 (`config.UserError`, their common base); `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from kvdistill import __version__
from kvdistill.config import UserError
from kvdistill.io import WriteError, write_failure
from kvdistill.malloc import keep_freed_memory

# name -> (module with `main(argv)`, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("kvdistill.commands.train", "multi-teacher KV-distillation training (transformers.Trainer)"),
    "capture": ("kvdistill.commands.capture", "run each teacher once over a run's data, store its KV cache (safetensors)"),
    "eval": ("kvdistill.commands.eval", "GSM8K-style accuracy and perplexity of a causal LM"),
    "ablate": ("kvdistill.commands.ablate", "run variants x seeds, write ablation.md with paired tests"),
    "layer-map": ("kvdistill.commands.layer_map", "CKA between student and teacher layers -> top-k layer map JSON + heatmap"),
    "layout": ("kvdistill.commands.layout", "how a model lays out the numbers 0..p-1: Fourier share and circulant R² of its layer-0 codes"),
    "probe": ("kvdistill.commands.probe", "linear probes: which layer's K / V / hidden state carries a target -> JSON + heatmap"),
    "demo": ("kvdistill.commands.demo", "the embedded default: teachers -> layer maps -> students -> report (CPU, offline)"),
    "prune": ("kvdistill.commands.prune", "a shallower copy of a causal LM (some of its layers, weights copied) -> model dir"),
    "profile": ("kvdistill.commands.profile", "shapes, time and memory of each alignment stage for a model pair"),
    "ab-projector": ("kvdistill.commands.ab_projector", "Linear vs Elastic Bottleneck projector A/B test (seed 000)"),
    "bench": ("kvdistill.commands.bench", "benchmarks: alignment, CKA and step overhead -> JSON + Markdown"),
    "generate": ("kvdistill.commands.generate", "a teacher's sampled completions of a question set -> transfer set (jsonl)"),
    "gen-data": ("kvdistill.commands.gen_data", "write a synthetic GSM8K-format arithmetic dataset (jsonl)"),
    "real-pair": ("kvdistill.commands.real_pair", "the pip-shipped real pair (Gemma-3-270m -> SmolLM2-135M) as local model dirs"),
    "smoke": ("kvdistill.commands.smoke", "build the tiny offline fixtures and print their KV shapes"),
    "dry-run": ("kvdistill.commands.dry_run", "meta-device dry run: params, KV shapes, aligners, GPU memory of a config"),
}


# how a command picks up after a failed write, said after "then rerun"
RERUN = {"train": " with --resume_from_checkpoint last (it resumes from the last complete checkpoint)",
         "capture": " the same capture (it keeps the shards written)",
         "ablate": " the same ablation (it resumes where it stopped)"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvdistill",
        description="Multi-teacher KV-cache distillation with 4D (time, layer, head, dim) alignment.",
        epilog="Run `kvdistill COMMAND --help` for a command's options (`kvdistill train --help-all` also lists "
               "every transformers TrainingArguments option); `--debug` shows tracebacks.",
    )
    parser.add_argument("--version", action="version", version=f"kvdistill {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


class _Stderr(logging.StreamHandler):
    """A handler on whatever `sys.stderr` is when a line is written (not when it was made): in-process callers
    (tests, notebooks) swap the stream, and a handler bound to an old one would write to a closed file."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def console_logging() -> None:
    """kvdistill's own INFO lines (which prompt each teacher reads, its logit-KD mode, a conversion...) on
    stderr, once: from the main process only under `accelerate launch` (other ranks say warnings)."""
    log = logging.getLogger("kvdistill")
    if log.handlers:
        return
    handler = _Stderr()
    handler.setFormatter(logging.Formatter("kvdistill: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
    log.propagate = False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # handles --help / --version / unknown commands
        parser.print_help()
        return 2
    console_logging()
    keep_freed_memory()  # before any tensor: training steps reuse freed memory instead of faulting it in again
    module = importlib.import_module(COMMANDS[argv[0]][0])
    try:
        return int(module.main(argv[1:]) or 0)
    except UserError as err:
        if debug:
            raise
        print(f"kvdistill {argv[0]}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # `io.WriteError` (torch, safetensors and Python writes) is one
        failure = write_failure(err)
        if debug or failure is None:
            raise
        # a full disk mid-run: the failed write was cleaned up; the last complete checkpoint / shard stands
        failed = err if isinstance(err, WriteError) else WriteError(err.filename or "an output file", None, *failure)
        print(f"kvdistill {argv[0]}: error: {failed}{RERUN.get(argv[0], '')}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
