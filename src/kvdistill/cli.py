"""`kvdistill` command line: parses the sub-command and hands the rest to one function.

Each command lives in its own module with a `main(argv) -> int`; modules are imported only
when their command runs, so `kvdistill --help` stays fast and a broken optional dependency
of one command does not break the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvdistill import __version__

# name -> (module with `main(argv)`, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "smoke": ("kvdistill.testing", "build the tiny offline fixtures and print their KV shapes"),
    "demo": ("kvdistill.demo", "the embedded default: teachers -> layer maps -> students -> report (CPU, offline)"),
    "train": ("kvdistill.train.cli", "multi-teacher KV-distillation training (transformers.Trainer)"),
    "eval": ("kvdistill.evaluate.eval", "GSM8K-style accuracy and perplexity of a causal LM"),
    "ablate": ("kvdistill.evaluate.ablate", "run variants x seeds, write ablation.md with paired tests"),
    "layer-map": ("kvdistill.align.layer_map", "CKA between student and teacher layers -> top-k map JSON + heatmap"),
    "profile": ("kvdistill.profile", "shapes, time and memory of each alignment stage for a model pair"),
    "ab-projector": ("kvdistill.ab_projector", "Linear vs Elastic Bottleneck projector A/B test (seed 000)"),
    "gen-data": ("kvdistill.synthetic", "write a synthetic GSM8K-format arithmetic dataset (jsonl)"),
    "bench": ("kvdistill.bench", "benchmarks: alignment, CKA and step overhead -> JSON + Markdown"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvdistill",
        description="Multi-teacher KV-cache distillation with 4D (time, layer, head, dim) alignment.",
        epilog="Run `kvdistill COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"kvdistill {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # handles --help / --version / unknown commands
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
