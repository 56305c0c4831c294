"""`--help` reads by task: `kvdistill train --help` lists its own options in the sections of `GROUPS` (each
option declares its group once, `option(..., group=...)`), stands one line for the TrainingArguments ones,
and `--help-all` lists those too; every command's `--help` exits 0."""

import importlib
import inspect
import re
from dataclasses import fields

import pytest
from transformers import TrainingArguments

from kvdistill.cli import COMMANDS
from kvdistill.config import GROUPS, option
from kvdistill.train.config import KVDistillConfig, parse_config

OWN = list(inspect.get_annotations(KVDistillConfig))
INHERITED = [f.name for f in fields(TrainingArguments) if f.name not in OWN]
HEADING = re.compile(r"^(\S.*):$")  # a section heading: unindented, ends with a colon
OPTION = re.compile(r"^  (--[\w-]+)")  # an option line: its first name


def _help(capsys, monkeypatch, *argv: str) -> list[str]:
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exit_:
        parse_config(list(argv))
    assert exit_.value.code == 0
    return capsys.readouterr().out.splitlines()


def _sections(lines: list[str]) -> dict[str, list[str]]:
    """{heading: the option names listed under it}, in --help's order."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in lines:
        if heading := HEADING.match(line):
            current = sections.setdefault(heading.group(1), [])
        elif (name := OPTION.match(line)) and current is not None:
            current.append(name.group(1))
    return sections


def test_every_train_option_declares_its_help_group():
    missing = [f.name for f in fields(KVDistillConfig) if f.name in OWN and f.metadata.get("group") not in GROUPS]
    assert not missing, f"give these options option(..., group=<one of {list(GROUPS)}>): {missing}"


def test_option_refuses_a_group_that_is_not_a_help_section():
    with pytest.raises(ValueError, match="group='optimizer' is not one of"):
        option(1, "x", group="optimizer")


def test_train_help_lists_its_options_by_task_and_points_to_the_rest(capsys, monkeypatch):
    lines = _help(capsys, monkeypatch, "--help")
    sections = _sections(lines)
    headings = list(sections)
    assert headings == ["kvdistill train options", *GROUPS.values(), "transformers TrainingArguments options"]
    assert sections["kvdistill train options"] == ["--help-all", "--config"]  # and `-h, --help`
    for f in fields(KVDistillConfig):
        if f.name in OWN:
            assert f"--{f.name}" in sections[GROUPS[f.metadata["group"]]], f.name
    assert sections["transformers TrainingArguments options"] == []  # collapsed to a pointer
    listed = {n for names in sections.values() for n in names}
    assert not listed & {f"--{n}" for n in INHERITED}
    pointer = "\n".join(lines[lines.index("transformers TrainingArguments options:") + 1:])
    assert f"{len(INHERITED)} more options" in pointer and "--help-all lists them" in pointer
    assert len(lines) < 500  # it was 832 lines with every TrainingArguments option in it


def test_help_all_lists_every_training_arguments_option_last(capsys, monkeypatch):
    short = _help(capsys, monkeypatch, "--help")
    for flag in ("--help-all", "--help_all"):
        lines = _help(capsys, monkeypatch, flag)
        sections = _sections(lines)
        assert list(sections)[-1] == "transformers TrainingArguments options"
        assert set(sections["transformers TrainingArguments options"]) >= {f"--{n}" for n in INHERITED}
        assert lines[: short.index("transformers TrainingArguments options:")] == \
            short[: short.index("transformers TrainingArguments options:")]  # the same kvdistill part


def test_help_names_each_option_once_and_both_spellings_still_parse(capsys, monkeypatch):
    text = "\n".join(_help(capsys, monkeypatch, "--help"))
    assert "--max_length MAX_LENGTH" in text and "--max-length" not in text.replace("--max_length or --max-length", "")
    assert "  --no_share_layers     Same as --share_layers false." in text
    cfg = parse_config(["--student", "org/student", "--kv_weight", "0", "--max-length", "64", "--no-share-layers",
                        "--warmup-steps", "3"])
    assert (cfg.max_length, cfg.share_layers, cfg.warmup_steps) == (64, False, 3)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_commands_help_exits_0(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    main = importlib.import_module(COMMANDS[command][0]).main
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and "--help" in out
