"""`kvdistill real-pair`: the pip-shipped real pair (Gemma-3-270m -> SmolLM2-135M) as local model directories.

Finds the two GGUF checkpoints that `scripts/real_pair.sh` installs, converts each once into a Hugging Face
directory (cached by the file's hash; about 80 s the first time on 2 cores, a second or two after), links them
under `--output_dir` and prints their shapes: what every README real-pair command reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvdistill.config import option, parse_config


@dataclass
class RealPairConfig:
    """Options of `kvdistill real-pair`."""

    output_dir: str = option("models/real", "Where to link the two model directories.")


def main(argv: list[str]) -> int:
    from kvdistill.real_pair import real_pair
    from kvdistill.report import markdown_table

    cfg = parse_config(RealPairConfig, argv, "kvdistill real-pair", __doc__)
    rows = []
    for name, path in real_pair(cfg.output_dir).items():
        c = json.loads((path / "config.json").read_text())
        template = (path / "chat_template.jinja").is_file() or "chat_template" in json.loads(
            (path / "tokenizer_config.json").read_text())
        rows.append([name, c["model_type"], c["num_hidden_layers"], c["num_attention_heads"],
                     c["num_key_value_heads"], c.get("head_dim"), f"{c['vocab_size']:,}",
                     c.get("sliding_window") or "-", "yes" if template else "no", str(path)])
    print(markdown_table(["model", "type", "layers", "q heads", "KV heads", "head dim", "vocab", "sliding window",
                          "chat template", "directory"], rows))
    return 0
