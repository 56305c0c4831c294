"""A 16-bit student on CPU: fp16 weights are refused in one line (they overflow within a few steps),
bf16 weights are upcast to fp32 with a one-line warning (they round away small updates); the
measurements behind the rule are in docs/training.md ("dtype on CPU")."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the rule is about a student on CPU")
FP16 = ("loads in fp16", "overflows on CPU", "--student_dtype fp32", "--bf16")


def fp16_checkpoint(c):
    """A copy of the world's student saved in fp16: `student_dtype auto` loads it in fp16."""
    path = c.model("student")
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).half().save_pretrained(path)
    return path


@NO_CUDA
@pytest.mark.parametrize("argv, expect", [
    pytest.param(lambda c: c.train(student_dtype="fp16"), (*FP16, "(student_dtype fp16)"), id="asked_fp16"),
    pytest.param(lambda c: c.train(student=fp16_checkpoint(c)), (*FP16, "(student_dtype auto)"),
                 id="auto_from_an_fp16_checkpoint"),
])
def test_an_fp16_student_on_cpu_is_refused(argv, expect, refused):
    refused(argv, expect)


@NO_CUDA
def test_a_bf16_student_on_cpu_trains_in_fp32_and_says_why(train_args, tmp_path, monkeypatch, caplog):
    from kvdistill.cli import main

    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvdistill.train.build"):
        assert main(train_args(output_dir=tmp_path / "out", student_dtype="bf16")) == 0
    said = [r.getMessage() for r in caplog.records if "upcast to fp32 on CPU" in r.getMessage()]
    assert len(said) == 1 and "student_dtype bf16" in said[0] and "--bf16" in said[0], said
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}  # noqa: SIM118
