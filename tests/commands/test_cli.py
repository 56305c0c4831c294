"""CLI entry and the README/CI contract."""

import re
import subprocess
import sys
from pathlib import Path

from kvdistill import __version__
from kvdistill.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]


def test_version_and_help(capsys):
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert __version__ in capsys.readouterr().out
    assert main([]) == 2
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_console_script_runs():
    r = subprocess.run([sys.executable, "-m", "kvdistill.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "layer-map" in r.stdout


def test_a_light_commands_errors_do_not_import_torch(tmp_path):
    """The CLI catches every user error by their light common base: an argparse exit or a config error of
    a command that needs no model answers in about a second, not after ~5 s of torch and model imports."""
    code = ("import sys\nfrom kvdistill.cli import main\n"
            f"assert main(['gen-data', '--n_train', '-1', '--output_dir', {str(tmp_path / 'd')!r}]) == 2\n"
            "try:\n    main(['gen-data', '--n_train', 'x'])\nexcept SystemExit as e:\n    assert e.code == 2\n"
            "print('torch' in sys.modules, 'transformers.modeling_utils' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]
    assert "kvdistill gen-data: error: n_train must be >= 0" in r.stderr and "Traceback" not in r.stderr


def test_every_user_error_is_caught_as_one_line():
    from kvdistill.config import ConfigError, UserError
    from kvdistill.data import DataError
    from kvdistill.models import ModelLoadError
    from kvdistill.train.trainer import NonFiniteError

    for kind in (ConfigError, DataError, ModelLoadError, NonFiniteError):
        assert issubclass(kind, UserError), kind


def test_every_command_module_has_main():
    import importlib

    for name, (module, _) in COMMANDS.items():
        mod = importlib.import_module(module)
        assert callable(getattr(mod, "main", None)), f"{name}: {module}.main missing"


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", readme, re.S)
    commands = [line.strip() for b in blocks for line in b.splitlines() if line.strip().startswith("bash scripts/")]
    assert "bash scripts/test.sh" in commands and "bash scripts/demo.sh" in commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci and "HF_HUB_OFFLINE=1" in ci
