"""`kvdistill gen-data`: write a synthetic GSM8K-format arithmetic dataset (train.jsonl, test.jsonl)."""

from __future__ import annotations

from dataclasses import dataclass

from kvdistill.config import ConfigError, check_output_dir, option, parse_config
from kvdistill.synthetic import OPS, write_dataset


@dataclass
class GenDataConfig:
    """Options of `kvdistill gen-data`."""

    output_dir: str | None = option(None, "Output directory (train.jsonl, test.jsonl). Required.", aliases=["--out"])
    n_train: int = option(2000, "Training problems.")
    n_test: int = option(500, "Test problems.")
    seed: int = option(0, "Generator seed.")
    min_steps: int = option(2, "Fewest arithmetic steps per problem.")
    max_steps: int = option(3, "Most arithmetic steps per problem.")
    max_value: int = option(20, "Largest operand.")
    ops: str = option("add,sub", f"Comma-separated subset of {OPS}.")

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ConfigError("no output directory: pass --output_dir DIR")
        if self.n_train < 0 or self.n_test < 0 or not 1 <= self.min_steps <= self.max_steps or self.max_value < 2:
            raise ConfigError("need n_train, n_test >= 0, 1 <= min_steps <= max_steps and max_value >= 2")
        bad = set(self.ops.split(",")) - set(OPS)
        if bad:
            raise ConfigError(f"ops: unknown {sorted(bad)}; choose from {OPS}")


def main(argv: list[str]) -> int:
    cfg = parse_config(GenDataConfig, argv, "kvdistill gen-data", __doc__)
    check_output_dir(cfg.output_dir)
    try:
        out = write_dataset(
            cfg.output_dir, cfg.n_train, cfg.n_test, cfg.seed,
            min_steps=cfg.min_steps, max_steps=cfg.max_steps, max_value=cfg.max_value, ops=cfg.ops.split(","),
        )
    except ValueError as err:  # too few distinct problems for these knobs; the message names them
        raise ConfigError(str(err)) from None
    print(f"wrote {cfg.n_train} train / {cfg.n_test} test problems to {out}")
    return 0
