"""The README's promises, checked: its commands parse, its links resolve, its Python excerpt is the tested one.

Every command of a ```bash block that runs `kvdistill <cmd>` (also through `accelerate launch -m kvdistill.cli`
or `bash scripts/demo.sh`, which execs `kvdistill demo`) must name a command of `kvdistill.cli.COMMANDS` and only
options that command takes: its argv goes through the command's own config parser (its `main` is run up to its
`parse_config` call, which is stopped there and then run for real: nothing loads, trains or writes). A YAML named
by `--config` / `--config_file` must exist. Each check is also run on a planted error, so it can fail.
"""

from __future__ import annotations

import importlib
import re
import shlex
import unicodedata
from pathlib import Path

import pytest

from kvdistill.cli import COMMANDS
from kvdistill.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
API = ROOT / "docs" / "api.md"
MAX_LINES = 250


# ----------------------------------------------------------------------------- reading the README


def fenced(text: str, lang: str) -> list[str]:
    """The bodies of the ```lang blocks of a Markdown text."""
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def shell_commands(text: str) -> list[list[str]]:
    """Each command line of the ```bash blocks as argv: continuation lines joined, comments and leading
    `VAR=value` assignments dropped (a line that only assigns is no command)."""
    out = []
    for block in fenced(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
                argv = argv[1:]
            if argv:
                out.append(argv)
    return out


def kvdistill_call(argv: list[str]) -> tuple[str, list[str]] | None:
    """`(command, its arguments)` when `argv` runs a kvdistill command, else None."""
    if argv[0] == "kvdistill" and len(argv) > 1 and not argv[1].startswith("-"):
        return argv[1], argv[2:]
    if argv[:2] == ["accelerate", "launch"] and "kvdistill.cli" in argv:
        i = argv.index("kvdistill.cli")
        if argv[i - 1] == "-m" and i + 1 < len(argv):
            return argv[i + 1], argv[i + 2:]
    if argv[:2] == ["bash", "scripts/demo.sh"]:  # `exec kvdistill demo "$@"`
        return "demo", argv[2:]
    return None


def option_value(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


class _Parsed(BaseException):  # not an Exception: no `except Exception` in a command's main can swallow it
    pass


def parse_command(command: str, args: list[str]):
    """Run `kvdistill <command> args` up to its `parse_config` call, then that parser for real; returns the
    parsed config (a `ConfigError` / `SystemExit` for an unknown or bad option)."""
    module = importlib.import_module(COMMANDS[command][0])
    real, calls = module.parse_config, []

    def stop(*a, **k):
        calls.append((a, k))
        raise _Parsed

    module.parse_config = stop
    try:
        module.main(list(args))
    except _Parsed:
        pass
    finally:
        module.parse_config = real
    assert calls, f"kvdistill {command}: main returned before parsing its options"
    a, k = calls[0]
    return real(*a, **k)


def command_problems(text: str) -> list[str]:
    """What is wrong with the kvdistill commands of a README text (empty: nothing)."""
    problems = []
    for argv in shell_commands(text):
        for flag in ("--config", "--config_file"):
            path = option_value(argv, flag)
            if path is not None and not (ROOT / path).is_file():
                problems.append(f"{shlex.join(argv)}: {flag} {path} does not exist")
        call = kvdistill_call(argv)
        if call is None:
            continue
        command, args = call
        if command not in COMMANDS:
            problems.append(f"{shlex.join(argv)}: no command {command!r}")
            continue
        try:
            if command in ("train", "capture"):
                # the training config as dry-run reads it: a GPU recipe (bf16, a CKA layer-map file not yet
                # made) parses on this CPU
                from kvdistill.commands.dry_run import parse_dry_run

                parse_dry_run(list(args))
            else:
                parse_command(command, args)
        except ConfigError as err:
            # a model an earlier README command writes (`kvdistill smoke` -> outputs/tiny/...) is absent on a
            # fresh clone until the reader runs that command: not a problem of this one
            if not re.search(r"path 'outputs/[^']*' does not exist", str(err)):
                problems.append(f"{shlex.join(argv)}: {err}")
        except SystemExit as err:  # argparse: a value of the wrong type
            problems.append(f"{shlex.join(argv)}: argparse exit {err.code}")
    return problems


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[`*_]", lambda m: "_" if m.group() == "_" else "", heading.strip().lower())
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def link_problems(text: str, base: Path = ROOT) -> list[str]:
    """Relative links of a README text whose file (or heading anchor) does not exist."""
    problems = []
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = base / path if path else README
        if not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"{target}: no heading #{anchor} in {path or 'README.md'}")
    return problems


def code_lines(block: str) -> list[str]:
    return [line.rstrip() for line in block.splitlines() if line.strip()]


def is_subsequence(lines: list[str], source: list[str]) -> bool:
    it = iter(source)
    return all(line in it for line in lines)  # `in` consumes the iterator: the order must hold


def excerpt_problems(text: str, api_text: str) -> list[str]:
    """A README Python block must compile and be the tested example of docs/api.md with lines left out (its
    lines, in order, are lines of one of api.md's Python blocks)."""
    problems, sources = [], [code_lines(b) for b in fenced(api_text, "python")]
    for block in fenced(text, "python"):
        try:
            compile(block, "README.md", "exec")
        except SyntaxError as err:
            problems.append(f"README Python block does not compile: {err}")
        lines = code_lines(block)
        if not any(is_subsequence(lines, s) for s in sources):
            problems.append(f"README Python block is not an excerpt of docs/api.md's example: {lines[:2]} ...")
    return problems


# ----------------------------------------------------------------------------- the README as it is


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text()


def test_readme_is_short(readme):
    n = len(readme.splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; keep it <= {MAX_LINES} (details go to docs/)"


def test_readme_commands_name_real_commands_and_options(readme, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert [c for c in map(kvdistill_call, shell_commands(readme)) if c], "no kvdistill command found in README"
    assert command_problems(readme) == []


def test_readme_links_resolve(readme):
    assert link_problems(readme) == []


def test_readme_python_excerpt_is_the_tested_example(readme):
    assert fenced(readme, "python"), "README has no Python excerpt"
    assert excerpt_problems(readme, API.read_text()) == []


# ----------------------------------------------------------------------------- each check can fail


def test_each_check_fails_on_a_planted_error(monkeypatch):
    monkeypatch.chdir(ROOT)

    def block(body: str) -> str:
        return f"```bash\n{body}\n```\n"

    good = "kvdistill train --config configs/real_pair.yaml --kv_weight 0.5"
    assert command_problems(block(good)) == []
    assert command_problems(block(good + " --kv_weigth 0.5"))  # a misspelt option
    assert command_problems(block("kvdistill eval --model m --data d --no_such_flag 1"))
    assert command_problems(block("kvdistill eval --model m --data d --limit many"))  # a bad value
    assert command_problems(block("kvdistill distil --config configs/real_pair.yaml"))  # no such command
    assert command_problems(block("kvdistill train --config configs/missing.yaml"))
    assert command_problems(block("accelerate launch --config_file configs/accelerate/none.yaml -m kvdistill.cli "
                                  "train --config configs/real_pair.yaml"))
    assert command_problems(block("accelerate launch -m kvdistill.cli train --config configs/real_pair.yaml "
                                  "--num_gpus 2"))
    assert command_problems(block("bash scripts/demo.sh --quik"))
    assert command_problems(block("kvdistill dry-run --config configs/real_pair.yaml \\\n    --projectr linear"))

    assert link_problems("[ok](docs/api.md) [gone](docs/no_such.md)") == ["docs/no_such.md: no such file"]
    assert link_problems("[anchor](docs/training.md#no-such-heading)")
    assert link_problems("[web](https://example.org/x)") == []

    api = API.read_text()
    example = code_lines(fenced(api, "python")[0])
    assert excerpt_problems(f"```python\n{example[0]}\n```\n", api) == []
    assert excerpt_problems("```python\nfrom kvdistill import Nothing\n```\n", api)
    assert excerpt_problems(f"```python\n{example[1]}\n{example[0]}\n```\n", api)  # out of order
    assert excerpt_problems("```python\ntrainer.train(\n```\n", api)  # does not compile

    assert len(("x\n" * (MAX_LINES + 1)).splitlines()) > MAX_LINES
