"""docs/api.md's example runs as written, on the real pair (Gemma-3-270m teaching SmolLM2-135M-Instruct)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def example() -> str:
    """The doc's first ```python block."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert blocks, f"{DOC} has no ```python block"
    return blocks[0]


@pytest.mark.real
def test_the_api_example_distils_the_real_pair(real_pair, tmp_path, monkeypatch):
    code = example()
    for role in ("teacher", "student"):  # the fixture's directories, wherever the pair was converted
        local = {"teacher": "models/real/gemma-3-270m", "student": "models/real/smollm2-135m-instruct"}[role]
        assert f'"{local}"' in code
        code = code.replace(f'"{local}"', repr(real_pair[role]))
    monkeypatch.chdir(tmp_path)  # runs/api_example lands here
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)
    trainer = scope["trainer"]
    assert trainer.state.global_step == 2
    assert [t.logit_kd for t in trainer.teachers] == ["cross_vocab"]  # another tokenizer: shared boundaries
    assert trainer.state.log_history[0]["kv_loss"] > 0
    assert (tmp_path / "runs" / "api_example" / "config.json").is_file()
