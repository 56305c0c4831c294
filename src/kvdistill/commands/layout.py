"""`kvdistill layout`: how a model lays out the numbers 0..p-1 (the modular regime's instrument).

A linear probe cannot tell (p distinct tokens decode from any code, trained or not); grokking modular
arithmetic leaves a code of the numbers that is sparse in the Fourier basis of the operation's cycle.
For each model (and, with `--untrained`, a seeded random-init copy of its config), reads each number's
token alone and scores its embedding and its layer-0 pre-RoPE key and value (`kvdistill.lab.probe.
layout_scores`): the share of the code's power in its 2 strongest frequencies of the cycle (uniform:
2 / (n // 2)) and the R² of its Gram matrix by a function of the cyclic distance. The cycle is
0, 1, ..., p-1 (addition), or with `--generator g` the powers g^0, ..., g^(p-2) mod p (multiplication).

Writes `layout.json` and prints a table.

Example:
    kvdistill layout --model outputs/demo_modular/teachers/teacher_qwen2 outputs/demo_modular/teachers/teacher_other \\
        --numbers 17 --generator 3 --untrained --output_dir outputs/demo_modular/layout_mul
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvdistill.config import ConfigError, as_list, check_output_dir, option, parse_config
from kvdistill.data import DataError
from kvdistill.lab.probe import LAYOUT_CODES, cycle_order, layer0_codes, layout_scores
from kvdistill.runs import resolve_model

FORMAT = "kvdistill-layout/1"


@dataclass
class LayoutConfig:
    """Options of `kvdistill layout`."""

    model: list[str] | None = option(None, "One or more models: local dirs (e.g. a teacher's run dir) or Hub ids. "
                                     "Required.")
    numbers: int | None = option(None, "p: the numbers 0..p-1, each one token of the model's tokenizer. Required.")
    generator: int | None = option(None, "A primitive root g of p: score the multiplicative cycle g^0, g^1, ... mod p "
                                   "(a * b mod p) instead of 0, 1, ..., p-1 (a + b mod p).")
    untrained: bool = option(False, "Also score a random-init copy of each model's config (seeded by --seed and the "
                             "model's name): the reference a trained model must beat.")
    output_dir: str | None = option(None, "Directory for layout.json. Required.", aliases=["--out"])
    dtype: str = option("auto", "Model dtype: auto | fp32 | bf16 | fp16 (codes are scored in float64).")
    device: str | None = option(None, "cpu, cuda, cuda:1 ... (default: cuda if available).")
    seed: int = option(0, "The untrained copies' weights.")

    def __post_init__(self) -> None:
        self.model = as_list(self.model)
        if not self.model or not self.output_dir or self.numbers is None:
            raise ConfigError("pass --model (one or more model dirs or Hub ids), --numbers P and --output_dir DIR")
        if self.numbers < 3:
            raise ConfigError(f"--numbers must be >= 3 (a cycle with a nonzero frequency), got {self.numbers}")
        try:
            cycle_order(self.numbers, self.generator)
        except ValueError as err:
            raise ConfigError(f"--generator: {err}") from None


def number_ids(tok: Any, order: list[int], name: str) -> torch.Tensor:
    """The token id of each number in `order` (a DataError naming the first that is not one token)."""
    ids = [tok(str(v), add_special_tokens=False)["input_ids"] for v in order]
    for v, got in zip(order, ids):
        if len(got) != 1:
            raise DataError(f"{name}: the number {v} is {len(got)} tokens of its tokenizer, not one; the layout is read "
                            "per number token (build the tokenizer with whole-number tokens, or lower --numbers)")
    return torch.tensor([got[0] for got in ids])


def main(argv: list[str]) -> int:
    from kvdistill.io import write_json_atomic
    from kvdistill.models import config_hash, load_model, load_tokenizer, resolve_device, untrained_copy
    from kvdistill.report import environment

    a = parse_config(LayoutConfig, argv, "kvdistill layout", __doc__)
    order = cycle_order(a.numbers, a.generator)
    rows = []
    for path in a.model:
        found = resolve_model(path, "scoring")  # a run: its final model or newest complete checkpoint
        model, tok = load_model(found, dtype=a.dtype, device=resolve_device(a.device)), load_tokenizer(found)
        ids = number_ids(tok, order, str(path))
        variants = [(str(path), model, False)] + ([(f"{path} (untrained)", untrained_copy(model, str(path), a.seed).to(model.device), True)]
                                                  if a.untrained else [])
        for label, m, untrained in variants:
            codes = layer0_codes(m, ids)
            rows += [{"model": label, "untrained": untrained, "config_hash": config_hash(m), "code": kind,
                      **layout_scores(codes[kind])} for kind in LAYOUT_CODES]
    out = check_output_dir(a.output_dir, "--output_dir")  # after the work (seconds): a refused model writes nothing
    cycle = "0, 1, ..., p-1" if a.generator is None else f"{a.generator}^k mod p"
    write_json_atomic(out / "layout.json", {"format": FORMAT, "numbers": a.numbers, "generator": a.generator,
                                            "cycle": cycle, "rows": rows,
                                            "provenance": {"seed": a.seed, "dtype": a.dtype, "environment": environment()}})
    print(f"{out / 'layout.json'}: the numbers 0..{a.numbers - 1} on the cycle {cycle}; top-2 frequency share "
          f"(uniform {rows[0]['uniform']:.3f}) and circulant R²")
    for r in rows:
        print(f"  {r['model']:<48} {r['code']:<6} share {r['share']:.3f} (frequencies {r['frequencies']})  "
              f"circulant R² {r['circulant_r2']:.3f}")
    return 0
