"""Does each model of the pair read the recall sheet? For sheets of 8, 16 and 32 entities (data seed 0, the test
sheet at 32) and the dev sheet (seed 100): each fact asked with the sheet before it and without, the share of
facts whose value is the model's top next token after "Name: " and the mean probability it gives the value.
Writes teacher_reads.json beside this file and prints the table.

    python docs/results/evidence_real_recall/teacher_reads.py        # ~1 min on 2 cores
"""

import json
import platform
from pathlib import Path

import torch

from kvdistill.lab.tasks import facts
from kvdistill.models import load_model, load_tokenizer

HERE = Path(__file__).parent
MODELS = {"gemma-3-270m": "models/real/gemma-3-270m", "smollm2-135m-instruct": "models/real/smollm2-135m-instruct"}
SHEETS = [(8, 0), (16, 0), (32, 0), (32, 100)]  # (entities, data seed)


@torch.no_grad()
def reads(model, tok, records: list[dict]) -> tuple[float, float]:
    """(top-1 share, mean p) of each record's one-token value after its prompt, read one record at a time."""
    hits, probs = [], []
    for r in records:
        ids = tok(r["prompt"], return_tensors="pt", add_special_tokens=True).input_ids  # the prompt ends in ": "
        value = tok(r["completion"], add_special_tokens=False).input_ids
        assert len(value) == 1, "a digit is one token in both vocabularies"
        p = model(ids).logits[0, -1].float().softmax(-1)  # [V]
        hits.append(int(p.argmax()) == value[0])
        probs.append(float(p[value[0]]))
    return sum(hits) / len(hits), sum(probs) / len(probs)


def main() -> None:
    torch.manual_seed(0)
    rows = []
    for name, path in MODELS.items():
        model, tok = load_model(path, dtype="fp32").eval(), load_tokenizer(path)
        for entities, seed in SHEETS:
            splits = facts.make_splits(entities=entities, attributes=1, n_dev=0, n_test=0, seed=seed)
            for context, split in (("sheet", "with_sheet"), ("none", "every_fact")):
                top1, p = reads(model, tok, splits[split])
                rows.append({"model": name, "entities": entities, "seed": seed, "context": context, "top1": top1,
                             "p_value": p})
                print(f"| {name} | {entities} | {seed} | {context} | {top1:.3f} | {p:.3f} |", flush=True)
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or
           platform.machine()}
    (HERE / "teacher_reads.json").write_text(json.dumps({"rows": rows, "environment": env}, indent=1) + "\n")


if __name__ == "__main__":
    main()
