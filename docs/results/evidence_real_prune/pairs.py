"""The report's tables from this directory's files: paired comparisons (ablation.json), the cost per arm, and
the post-hoc KL to the teacher (kl/, `kvdistill eval --teacher` on the runs that kept their weights).

    python docs/results/evidence_real_prune/pairs.py
"""

import json
import statistics
from pathlib import Path

from kvdistill.evaluate.stats import paired_ttest, tost

HERE = Path(__file__).parent
RUNS = json.loads((HERE / "ablation.json").read_text())["variants"]
SEEDS = [str(s) for s in range(11, 21)]
PAIRS = [("logit_kd_kv", "logit_kd"), ("logit_kd_kv", "logit_kd_kv_shuffled"),
         ("logit_kd_kv", "logit_kd_kv_untrained"), ("logit_kd", "baseline"), ("logit_kd_hidden", "logit_kd"),
         ("logit_kd_kv", "logit_kd_hidden"), ("logit_kd_kv", "baseline")]
NOT_COSTS = {("11", v) for v in RUNS} | {("13", "logit_kd_hidden"), ("13", "logit_kd_kv_shuffled")}  # shared/resumed


def table(col, seeds, unit):
    print(f"| variant | vs | Δ {unit} | 95 % CI | paired t p | TOST ±0.02 p | seeds lower |\n|---|---|---|---|---|---|---|")
    for a, b in PAIRS:
        x, y = col(a, seeds), col(b, seeds)
        r, t = paired_ttest(x, y), tost(x, y, 0.02, paired=True)
        print(f"| {a} | {b} | {r.mean_diff:+.3f} | [{r.ci_low:+.3f}, {r.ci_high:+.3f}] | {r.p_value:.2g} | "
              f"{t.p_value:.2g} | {sum(u < v for u, v in zip(x, y))}/{len(x)} |")


table(lambda v, seeds: [RUNS[v]["runs"][s]["nll"] for s in seeds], SEEDS, "held-out LM loss")
print("\n| arm | median train s (runs) | range |\n|---|---|---|")
for v in RUNS:
    ts = [RUNS[v]["runs"][s]["train_runtime"] for s in SEEDS if (s, v) not in NOT_COSTS]
    print(f"| {v} | {statistics.median(ts):.0f} ({len(ts)}) | {min(ts):.0f}-{max(ts):.0f} |")

kl = {p.stem: json.loads(p.read_text()) for p in sorted((HERE / "kl").glob("*.json"))}
kl_seeds = sorted({k.rsplit("_seed_", 1)[1] for k in kl if "_seed_" in k})  # seeds whose six runs kept weights
print(f"\nKL(teacher || student), nats per target token, seeds {', '.join(kl_seeds)}; the pruned student before "
      f"training {kl['pruned_untrained']['kl_to_teacher']:.3f}, the teacher's own LM loss {kl['teacher']['nll']:.4f}\n")
print("| arm | KL to the teacher | held-out LM loss |\n|---|---|---|")
for v in RUNS:
    ks = [kl[f"{v}_seed_{s}"] for s in kl_seeds]
    print(f"| {v} | {statistics.mean(k['kl_to_teacher'] for k in ks):.3f} ± "
          f"{statistics.stdev(k['kl_to_teacher'] for k in ks):.3f} | {statistics.mean(k['nll'] for k in ks):.4f} |")
print()
table(lambda v, seeds: [kl[f"{v}_seed_{s}"]["kl_to_teacher"] for s in seeds], kl_seeds, "KL to the teacher")
