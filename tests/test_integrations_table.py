"""The TRL mapping tables of docs/integrations.md against the code.

Each table's header names a TRL config class (`| TRL `GKDConfig` | kvdistill | notes |`). In a row,
`name` (default V) claims that the option exists with that default (V in YAML); a bare `name` in the
kvdistill column claims that the option exists; "same as TRL" claims that TRL's option is spelt as
kvdistill's first one. kvdistill's side is checked always, TRL's where trl is installed.
"""

import re
import warnings
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
import yaml

from kvdistill.teachers import LOGIT_KD_MODES
from kvdistill.train.config import KVDistillConfig, TeacherConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"
HEADER = re.compile(r"^\| TRL `(\w+)` \| kvdistill \| notes \|$")
NAME = re.compile(r"`([a-z_]+)`(?: \(default ([^)]*)\))?")  # `name` or `name` (default V)


def tables() -> dict[str, list[tuple[str, str, str]]]:
    """{TRL config class: its rows as (TRL cell, kvdistill cell, notes cell)}."""
    lines, found = DOC.read_text().splitlines(), {}
    for i, line in enumerate(lines):
        if header := HEADER.match(line):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                cells = [c.strip() for c in row.strip().strip("|").split("|")]
                assert len(cells) == 3, f"{DOC.name}: a row of 3 cells, got {row!r}"
                rows.append(tuple(cells))
            found[header.group(1)] = rows
    return found


def default(cls, name):
    f = {f.name: f for f in fields(cls)}[name]
    return f.default_factory() if f.default is MISSING else f.default


def claims(cell: str) -> list[tuple[str, str | None]]:
    return [(name, value or None) for name, value in NAME.findall(cell)]


def test_the_doc_has_both_trl_tables_and_the_rows_the_issue_named():
    found = tables()
    assert set(found) == {"GKDConfig", "DistillationConfig"}
    gkd = {name for trl, _, _ in found["GKDConfig"] for name, _ in claims(trl)}
    assert {"temperature", "lmbda", "beta", "seq_kd", "teacher_model_name_or_path"} <= gkd


@pytest.mark.parametrize("table", ["GKDConfig", "DistillationConfig"])
def test_every_kvdistill_option_named_exists_with_the_stated_default(table):
    names = {f.name for f in fields(KVDistillConfig)}
    for trl, ours, notes in tables()[table]:
        assert trl == "—" or claims(trl), f"a TRL cell names a TRL option: {trl!r}"
        assert claims(ours), f"the kvdistill cell of the {trl} row names no option"
        for cell, bare_ok in ((ours, True), (notes, False)):
            for name, value in claims(cell):
                if value is None and not bare_ok:
                    continue  # a word in code font in the notes, not a claim about an option
                assert name in names, f"{table} row {trl}: kvdistill has no option {name!r}"
                if value is not None:
                    assert default(KVDistillConfig, name) == yaml.safe_load(value), \
                        f"{table} row {trl}: {name}'s default is {default(KVDistillConfig, name)!r}, not {value}"


def test_the_cross_vocabulary_paragraph_matches_the_teacher_options():
    text = DOC.read_text()
    assert "a\nteacher's `logit_kd` (in `teachers:`, default `auto`)" in text
    assert default(TeacherConfig, "logit_kd") == "auto"
    for mode in re.findall(r"`(\w+_vocab)`", text):
        assert mode in LOGIT_KD_MODES, mode


def trl_config(name: str):
    pytest.importorskip("trl", reason="trl is not installed (pip install 'kvdistill[peer]'): TRL's side of the "
                                      "table is not checked")
    import trl

    if hasattr(trl, name):
        return getattr(trl, name)
    with warnings.catch_warnings():  # trl.experimental warns on import
        warnings.simplefilter("ignore")
        from trl.experimental import gkd
    return getattr(gkd, name)


@pytest.mark.parametrize("table", ["GKDConfig", "DistillationConfig"])
def test_every_trl_option_named_exists_in_trl_with_the_stated_default(table):
    cls = trl_config(table)
    names = {f.name for f in fields(cls)}
    for trl, ours, _ in tables()[table]:
        for name, value in claims(trl):
            assert name in names, f"TRL's {table} has no option {name!r}"
            if value is not None:
                assert default(cls, name) == yaml.safe_load(value), \
                    f"TRL's {table}.{name} defaults to {default(cls, name)!r}, not {value}"
        if "same as TRL" in ours:
            assert claims(trl)[0][0] == claims(ours)[0][0], f"{table}: {trl} is said to be the same as {ours}"
