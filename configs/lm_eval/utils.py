"""kvdistill's answer extraction for the lm-eval tasks in this directory (`!function utils.X`).

The filter and the gold answer call the functions `kvdistill eval` uses, so lm-eval's exact match
and kvdistill's accuracy can only differ where the generated text differs.
"""

from lm_eval.api.filter import Filter

from kvdistill.evaluate.answers import extract_answer, gold_answer

NO_ANSWER = "[no answer]"  # never equal to a gold number, as a missing prediction is never correct


def doc_to_target(doc: dict) -> str:
    """Normalised gold number of a GSM8K `answer` (`rationale ... #### n`)."""
    return gold_answer(doc["answer"]) or ""


class ExtractAnswer(Filter):
    """Each completion -> its normalised final answer (`#### n`, else `\\boxed{}`, else the last number)."""

    def apply(self, resps, docs):
        return [[extract_answer(r) or NO_ANSWER for r in per_doc] for per_doc in resps]
