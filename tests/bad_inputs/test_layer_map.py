"""`kvdistill layer-map` refuses bad input in one line, and writes no map JSON / heatmap of a failed run.

Each case: `pytest.param(argv builder, substrings of the error line, id=...)`.
"""

from __future__ import annotations

import importlib.util

import pytest

NO_BNB = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed")


def lm(c, teacher=None, **overrides) -> list:
    """`kvdistill layer-map` args: student vs the world's teacher on 4 samples, map into `c.out`."""
    args = {"student": c.world.student, "teacher": teacher or c.world.teacher, "data": c.world.data, "samples": 4,
            "output_file": c.out / "map.json", **overrides}
    return ["layer-map", *(x for k, v in args.items() for x in (f"--{k}", v)), "--no_progress"]


CASES = [
    pytest.param(lambda c: ["layer-map", "--student", c.world.student, "--output_file", c.out / "map.json"],
                 ("pass --student, --teacher (one or more) and --output_file",), id="no_teacher"),
    pytest.param(lambda c: lm(c, samples=0), ("--samples, --top_k and --batch_size must be >= 1",), id="samples_0"),
    pytest.param(lambda c: lm(c, top_k=9), ("--top_k 9 is more than the 4 layers of teacher", "set --top_k <= 4"),
                 id="top_k_above_teacher_layers"),
    pytest.param(lambda c: lm(c, representation="attention"), ("representation='attention' is not one of",),
                 id="unknown_representation"),
    pytest.param(lambda c: lm(c, quantization="4bit"), ("needs bitsandbytes", "pip install"),
                 id="quantization_without_bitsandbytes", marks=NO_BNB),
    pytest.param(lambda c: lm(c, teacher=c.file("teacher.safetensors", "x")),
                 ("teacher.safetensors is a file, not a model directory",), id="teacher_path_is_a_file"),
    pytest.param(lambda c: lm(c, teacher=c.model("teacher", truncate="model.safetensors")),
                 ("teacher_copy', its weights are damaged or incomplete",), id="teacher_truncated_safetensors"),
    pytest.param(lambda c: lm(c, max_length=4096), ("--max_length 4096 is longer than the 512 positions",
                                                    "set --max_length <= 512"), id="max_length_longer_than_the_model"),
    pytest.param(lambda c: lm(c, data=c.data({"question": "2+2?", "answer": None}), split="train"),
                 ("train.jsonl line 4 has no 'answer' value",), id="data_record_without_answer"),
    pytest.param(lambda c: lm(c, output_file=c.file("out", "a file") / "map.json"),
                 ("--output_file's directory", "is a file, not a directory"), id="output_file_under_a_file"),
    pytest.param(lambda c: lm(c), ("--output_file's directory", "is not writable (File too large)", "free space"),
                 id="output_disk_full", marks=pytest.mark.subprocess(fsize_limit=4096)),
]


@pytest.mark.parametrize("argv, expect", CASES)
def test_layer_map_refuses(argv, expect, refused):
    refused(argv, expect)
