"""The dependency direction of SPEC §10 (import-linter contracts in pyproject.toml) and ruff, as tests."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        pytest.fail(f"{name} is not installed in the test environment (pip install -e '.[dev]')")
    return path


def test_import_contracts_hold():
    res = subprocess.run([_tool("lint-imports")], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout


def test_the_independence_contract_lists_every_command():
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (independent,) = [c for c in contracts if c["type"] == "independence"]
    here = ROOT / "src/kvdistill/commands"  # a command is a module or a package
    commands = {f"kvdistill.commands.{p.stem}" for p in here.glob("*.py") if p.stem != "__init__"} | {
        f"kvdistill.commands.{p.parent.name}" for p in here.glob("*/__init__.py")}
    assert commands - set(independent["modules"]) == set(), "list the new command in pyproject's contract"


def test_ruff_is_clean():
    res = subprocess.run([_tool("ruff"), "check", "src", "tests", "benchmarks"], cwd=ROOT, capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stdout[-3000:]


UNSAFE_LOADERS = {
    r"\btorch\.load\((?![^)]*weights_only\s*=\s*True)": "torch.load without weights_only=True unpickles code",
    r"\byaml\.(unsafe_)?load\(": "yaml.load builds arbitrary objects; use yaml.safe_load",
    r"\bpickle\.loads?\(": "pickle runs code from the file",
    r"(?<![.\w])(eval|exec)\(": "eval/exec of text",
}


def test_no_unsafe_loaders_in_the_package():
    """Run dirs, layer maps and captures are read as safetensors / JSON / YAML only."""
    found = []
    for path in sorted((ROOT / "src" / "kvdistill").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for pattern, why in UNSAFE_LOADERS.items():
                if re.search(pattern, line.split("#", 1)[0]):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {why}")
    assert not found, "\n".join(found)
    assert re.search(next(iter(UNSAFE_LOADERS)), "x = torch.load(f)")  # the scan can fail
    assert not re.search(next(iter(UNSAFE_LOADERS)), "x = torch.load(f, weights_only=True)")


def test_scipy_is_imported_where_it_is_used():
    """scipy.stats takes ~1 s to import: a module-level import would make every `kvdistill` start that
    reaches the stats (a training, a capture, a refused command) pay it; only tests and reports use it."""
    top_level = re.compile(r"^(import scipy|from scipy)\b", re.MULTILINE)
    found = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "src" / "kvdistill").rglob("*.py"))
             if top_level.search(p.read_text())]
    assert not found, found
