"""`--debug` trades the one-line message for the traceback: the other half of the error policy."""

from __future__ import annotations

import pytest

from kvdistill.cli import main
from kvdistill.config import ConfigError


def test_debug_shows_the_traceback(world, capsys):
    argv = ["eval", "--model", str(world.student), "--limit", "-5"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == ("kvdistill eval: error: --limit must be >= 1, got -5 (leave it out "
                                               "for all questions)")
    with pytest.raises(ConfigError, match="--limit must be >= 1"):  # uncaught: the interpreter prints it
        main([*argv, "--debug"])
