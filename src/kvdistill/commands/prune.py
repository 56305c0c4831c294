"""`kvdistill prune`: a shallower copy of a causal LM, made of some of its decoder layers (weights copied).

The copy keeps the source's tokenizer, embeddings, final norm and head: a same-vocabulary student that
starts from its teacher's layers (`kvdistill.prune`). `--keep every_other` keeps layers 0, 2, 4, ...;
`--keep 0,5,11,17` names them. The output directory holds the model, its tokenizer and
`kvdistill_prune.json` (the source and the kept layers); it must be new or empty, and a failed run leaves
nothing in it.

Example:
    kvdistill prune --model models/real/gemma-3-270m --keep every_other --output_dir models/gemma_half
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdistill.config import ConfigError, option, parse_config


@dataclass
class PruneConfig:
    """Options of `kvdistill prune`."""

    model: str | None = option(None, "The causal LM to prune: a local model dir or Hub id. Required.")
    keep: str = option("every_other", "Decoder layers to keep: every_other (0, 2, 4, ...) or comma-separated "
                       "indices in increasing order (0,2,4).")
    output_dir: str | None = option(None, "Where to save the pruned model and its tokenizer (new or empty). Required.",
                                    aliases=["--out"])

    def __post_init__(self) -> None:
        if not self.model or not self.output_dir:
            raise ConfigError("pass --model DIR (the model to prune) and --output_dir DIR (a new directory)")


def main(argv: list[str]) -> int:
    from kvdistill.io import read_json
    from kvdistill.prune import MANIFEST, prune

    cfg = parse_config(PruneConfig, argv, "kvdistill prune", __doc__)
    out = prune(cfg.model, cfg.keep, cfg.output_dir)
    made = read_json(out / MANIFEST)
    print(f"kvdistill prune: kept layers {made['kept_layers']} of {made['source_layers']} -> {out}")
    return 0
