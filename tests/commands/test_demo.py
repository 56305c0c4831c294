"""`kvdistill demo --quick`: the whole pipeline through the public commands (CI runs this)."""

import json
import re

import pytest

from kvdistill.commands.demo import main as demo_main


@pytest.mark.slow
def test_demo_quick_end_to_end(tmp_path):
    out = tmp_path / "demo"
    assert demo_main(["--quick", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    for png in ("accuracy.png", "maps/teacher_qwen2.png", "maps/teacher_llama.png", "runs/student_kv/curves_loss.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    # every accuracy in the report is the one in its eval summary
    for name in ("teacher_qwen2", "teacher_llama", "student_sft", "student_kv"):
        s = json.loads((out / "eval" / name / "summary.json").read_text())
        row = next(line for line in report.splitlines() if line.startswith(f"| {name} |"))
        assert re.search(rf"\| {s['accuracy']:.3f} \|", row), (row, s["accuracy"])
        assert s["n"] == 60
    # teachers beat a random model: their reference perplexity is far below the vocabulary size
    vocab = json.loads((out / "init" / "student" / "config.json").read_text())["vocab_size"]
    for name in ("teacher_qwen2", "teacher_llama"):
        assert json.loads((out / "eval" / name / "summary.json").read_text())["perplexity"] < vocab / 10
    # a second run reuses everything (teachers cached)
    mtime = (out / "teachers" / "teacher_qwen2" / "model.safetensors").stat().st_mtime
    assert demo_main(["--quick", "--out", str(out)]) == 0
    assert (out / "teachers" / "teacher_qwen2" / "model.safetensors").stat().st_mtime == mtime
