"""`kvdistill smoke`: build the tiny offline model world, load it back like a user would, print KV shapes."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvdistill.config import option, parse_config


@dataclass
class SmokeConfig:
    """Options of `kvdistill smoke`."""

    output_dir: str | None = option(None, "Where to write the fixtures (default: a new temp dir).", aliases=["--out"])


def main(argv: list[str]) -> int:
    from kvdistill.cache import extract_kv
    from kvdistill.data import DistillCollator, load_records
    from kvdistill.models import load_model, load_tokenizer
    from kvdistill.report import param_count
    from kvdistill.tiny import build_tiny_world

    cfg = parse_config(SmokeConfig, argv, "kvdistill smoke", __doc__)
    root = Path(cfg.output_dir) if cfg.output_dir else Path(tempfile.mkdtemp(prefix="kvdistill_smoke_"))
    world = build_tiny_world(root)
    records = load_records(world.data_dir, split="test", limit=2)
    print(f"fixtures in {root}")
    print(f"{'model':<24}{'params':>10}  keys [L, B, H_kv, T, D]")
    for name, path in world.models.items():
        model, tok = load_model(path, dtype="fp32"), load_tokenizer(path)
        batch = DistillCollator(tok, max_length=128)(records)
        kv = extract_kv(model, batch["input_ids"], batch["attention_mask"], batch["segment_ids"])
        print(f"{name:<24}{param_count(model):>10,}  {list(kv.keys.shape)}")
    return 0
