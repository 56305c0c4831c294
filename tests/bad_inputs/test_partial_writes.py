"""A write that fails half-way (full disk, an unencodable character) leaves the old file or nothing,
never a 0-byte or partial one: the atomic writes every results file goes through."""

from __future__ import annotations

import pytest

from kvdistill.evaluate.scoring import write_results
from kvdistill.io import write_text_atomic

UNENCODABLE = "\udc80"  # a lone surrogate: UTF-8 cannot encode it, so the write fails after the file is open


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(path, f"new {UNENCODABLE}")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_eval_results_that_fail_to_write_leave_no_items_file(tmp_path):
    out = tmp_path / "eval"
    with pytest.raises(UnicodeEncodeError):
        write_results({"accuracy": 1.0, "items": [{"prediction": f"4{UNENCODABLE}"}]}, out)
    assert not out.exists() or not any(out.iterdir())
