"""`kvdistill train --config x.yaml [--key value ...]`."""

from __future__ import annotations

import json
import sys

from kvdistill.train.config import ConfigError, parse_config


def main(argv: list[str]) -> int:
    try:
        cfg = parse_config(argv)
    except ConfigError as err:  # a bad config fails before any model loads
        print(f"kvdistill train: config error: {err}", file=sys.stderr)
        return 2
    from kvdistill.train.run import run_training

    out = run_training(cfg)
    summary = out / "train_summary.json"
    if summary.exists():
        print(json.dumps(json.loads(summary.read_text())["final"], indent=1))
    print(f"student and aligners saved to {out}")
    return 0
