"""Evaluation: answer extraction, statistics, `kvdistill eval` and `kvdistill ablate`.

Submodules are imported on use (`from kvdistill.evaluate.scoring import evaluate_model`), so
importing the package stays light.
"""

from kvdistill.evaluate.answers import extract_answer, is_correct, normalize_number
from kvdistill.evaluate.stats import (
    paired_bootstrap,
    paired_permutation_test,
    paired_ttest,
    tost,
    welch_ttest,
    wilson_interval,
)

__all__ = [
    "extract_answer",
    "is_correct",
    "normalize_number",
    "paired_bootstrap",
    "paired_permutation_test",
    "paired_ttest",
    "tost",
    "welch_ttest",
    "wilson_interval",
]
