"""Command configs as data: one dataclass per command, YAML file + command-line overrides.

Every command declares its options as a dataclass whose fields carry their help text
(`option(default, "help")`), as TRL and `transformers.TrainingArguments` do; `parse_config`
turns `--config x.yaml --key value ...` into an instance (CLI wins over YAML), so `--help`, YAML
keys and docs come from one place. Both `--max_length` and `--max-length` spellings work.
Range checks live in each dataclass's `__post_init__` and raise `ConfigError` before anything loads.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import inspect
import math
import os
import re
import sys
import tempfile
import textwrap
from collections.abc import Mapping
from dataclasses import MISSING, field, fields
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")
PROBE_BYTES = 1 << 16  # a disk that cannot take 64 KiB more cannot take a run's results either


class UserError(Exception):
    """Bad input (or a run its input made diverge), not a bug: the CLI prints its message in one line and
    exits 2. Its kinds live beside what they check; this light base lets the CLI catch them all without
    importing torch or transformers (an argparse exit or a config error stays fast)."""


class ConfigError(UserError, ValueError):
    """A configuration problem, raised before anything loads; the message names the fix."""


# What an option changes, declared once per option (`option(..., affects=ROLE)`). The commands derive
# from it what they compare: a capture's identity (teacher_inputs, teacher_outputs), whether a
# finished run is reused (all but bookkeeping) and whether a run loads teachers (teacher_signal).
# Pick the first role that fits. (`--help` is sectioned by task instead: `GROUPS`.)
ROLES = {
    "teacher_outputs": "what a teacher computes and a capture stores (a capture made with another value is refused)",
    "teacher_inputs": "what teachers read (a capture of other tokens is refused: it stores a hash of them)",
    "teacher_signal": "loss weights on teacher outputs (all 0: no teacher is loaded)",
    "student_loss": "what the student learns and how (a finished run is reused only when these match)",
    "bookkeeping": "where and how often a run writes (may change between a run and its resumption or reuse)",
}
# What an option is for, declared once per option (`option(..., group=GROUP)`): the sections of
# `--help`, in this order (a command whose options declare none gets one section). Each value is the
# section's heading: its name, then what its options choose.
GROUPS = {
    "models": "models: the student and its teachers, how they load and run, controls",
    "data": "data: what the student and its teachers read, and how it is tokenized",
    "alignment": "alignment: each teacher's KV onto the student's (time, layer, head, dim)",
    "signals": "signals and losses: LM loss, KV loss, CODI, logit KD, and their weights",
    "training": "training: optimiser, on-policy generation, accuracy curve, NaN policy",
    "output": "output: where and how often a run writes",
}
OPTION_META = ("affects", "card", "valid", "group")  # option() metadata beside `help`
_BOUND = re.compile(r"(>=|>|<=|<)\s*(\S+)$")
_INTERVAL = re.compile(r"in\s*([\[(])\s*(\S+)\s*,\s*(\S+)\s*([\])])$")


def option(default: Any = MISSING, help: str = "", *, affects: str | None = None, card: str | None = None,
           valid: str | None = None, group: str | None = None, **metadata: Any) -> Any:
    """A dataclass field with help text (`metadata["help"]`); list/dict defaults are copied per instance.

    affects: the option's role, a key of `ROLES`. card: the model-card section that shows it
    (`card.py`), if any. valid: the numbers it accepts, checked by `check_ranges` (e.g. ">= 0", "> 0",
    "in (0, 1]", ">= 1 or -1"; NaN and inf are never valid; None is valid only where it is the default).
    group: the `--help` section that lists it, a key of `GROUPS`.
    """
    if affects is not None and affects not in ROLES:
        raise ValueError(f"affects={affects!r} is not one of {tuple(ROLES)}")
    if group is not None and group not in GROUPS:
        raise ValueError(f"group={group!r} is not one of {tuple(GROUPS)}")
    if valid is not None:
        within(0, valid)  # a typo in the rule fails at import
    meta = {"help": help, **metadata}
    meta.update({k: v for k, v in (("affects", affects), ("card", card), ("valid", valid), ("group", group))
                 if v is not None})
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: default.copy(), metadata=meta)
    return field(default=default, metadata=meta)


def within(value: float, valid: str) -> bool:
    """`value` is a finite number that satisfies `valid` (alternatives joined by " or ": a bound such as
    ">= 0", an interval such as "in (0, 1]", or one number such as "-1")."""
    ok = False
    for part in valid.split(" or "):
        part = part.strip()
        if bound := _BOUND.match(part):
            op, x = bound.group(1), float(bound.group(2))
            ok |= {">=": value >= x, ">": value > x, "<=": value <= x, "<": value < x}[op]
        elif interval := _INTERVAL.match(part):
            lo_open, lo, hi, hi_open = interval.group(1) == "(", float(interval.group(2)), float(interval.group(3)), \
                interval.group(4) == ")"
            ok |= (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
        else:
            try:
                ok |= value == float(part)
            except ValueError:
                raise ValueError(f"valid={valid!r}: {part!r} is not a bound ('>= 0'), an interval "
                                 "('in (0, 1]') or a number") from None
    return ok and math.isfinite(value)


def check_ranges(obj: Any, rules: dict[str, str] | None = None, where: str = "") -> None:
    """Refuse any numeric field of the dataclass `obj` that is NaN, inf or outside its declared `valid`
    rule (`rules` adds rules for fields declared elsewhere, e.g. inherited ones), in one line that
    names the option and its valid range. A number without a rule must still be finite."""
    for f in fields(obj):
        value, rule = getattr(obj, f.name), f.metadata.get("valid", (rules or {}).get(f.name))
        if value is None and (f.default is None or rule is None):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if rule is None:
                continue
            raise ConfigError(f"{where}{f.name} must be a number {rule}, got {value!r}")
        if not within(value, rule or "in [-inf, inf]"):
            why = "" if math.isfinite(value) else " (NaN and inf are never valid)"
            raise ConfigError(f"{where}{f.name} must be {rule or 'a finite number'}, got {value!r}{why}")


def suggest(key: str, valid: Any) -> str:
    """`"; did you mean 'x'?"` for the closest valid name, or ""."""
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of {allowed}")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's layout, with each option named once: `--max_length N`, not also `--max-length N` (both
    spellings still parse)."""

    def _format_action_invocation(self, action):
        names = [s for i, s in enumerate(action.option_strings)
                 if s.replace("-", "_") not in {t.replace("-", "_") for t in action.option_strings[:i]}]
        if names != action.option_strings:
            action = copy.copy(action)
            action.option_strings = names
        return super()._format_action_invocation(action)


class _HelpAll(argparse.Action):
    """`--help-all`: `--help` with the options it leaves out (`hidden`, with their help texts) listed too."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)
        self.hidden: list[tuple[argparse.Action, str]] = []
        self.pointer: Any = None  # the section whose description points here

    def __call__(self, parser, namespace, values, option_string=None):
        for action, text in self.hidden:
            action.help = text
        if self.pointer is not None:
            self.pointer.description = None
        parser.print_help()
        parser.exit()


# options of `first` (TrainingArguments) named in the one-line pointer that stands for them in `--help`
_EXAMPLES = ("warmup_steps", "lr_scheduler_type", "bf16", "eval_strategy", "deepspeed")


def build_parser(cls: type, prog: str, description: str | None = None, first: type | None = None):
    """An `HfArgumentParser` for `cls` with `--config` first.

    Options that declare a `group` (`option(..., group=...)`) are listed in one section per key of
    `GROUPS`, in its order. `first`: a base class of `cls` (e.g. `TrainingArguments`) whose options
    (those `cls` does not redeclare) come last, under their own heading; `--help` shows that heading
    with a one-line pointer in their place, `--help-all` lists them.
    """
    from transformers import HfArgumentParser

    class Parser(HfArgumentParser):
        @staticmethod
        def _parse_dataclass_field(parser, field):  # argparse takes `help`, not the role metadata
            field = copy.copy(field)
            field.metadata = {k: v for k, v in field.metadata.items() if k not in OPTION_META}
            HfArgumentParser._parse_dataclass_field(parser, field)

    parser = Parser(cls, prog=prog, description=description, usage=f"{prog} [--config FILE.yaml] [--option value ...]",
                    formatter_class=_HelpFormatter)
    config = parser.add_argument("--config", default=None, help="YAML file of options; command-line flags override it.")
    parser._optionals.title = f"{prog} options"
    group = parser._optionals._group_actions  # the order --help prints
    group.remove(config)
    group.insert(1, config)  # after -h
    for action in group[2:]:
        if action.option_strings[:1] == [f"--no_{action.dest}"]:  # HfArgumentParser's complement of a True bool
            action.help = f"Same as --{action.dest} false."
        elif action.help and "%(default)" not in action.help:
            action.help += " (default: %(default)r)"
    own = list(inspect.get_annotations(cls))  # declaration order, overridden base fields included
    if first is not None:
        later = {f.name for f in fields(first)} - set(own)
        moved = [a for a in group if a.dest in later]
        group.sort(key=lambda a: own.index(a.dest) if a.dest in own else -1)  # -h, --config stay first
    groups = {f.name: f.metadata["group"] for f in fields(cls) if f.name in own and "group" in f.metadata}
    for key, heading in GROUPS.items() if groups else ():  # one --help section per group, in GROUPS' order
        section = parser.add_argument_group(heading)
        for a in [a for a in group if groups.get(a.dest) == key]:
            group.remove(a)
            section._group_actions.append(a)
    if first is not None:
        help_all = parser.add_argument("--help-all", "--help_all", action=_HelpAll,
                                       help=f"show this help with the {first.__name__} options too, and exit")
        group.remove(help_all)
        group.insert(1, help_all)  # after -h
        heading = parser.add_argument_group(f"{first.__module__.split('.')[0]} {first.__name__} options")
        names = sorted({a.dest for a in moved})
        examples = ", ".join(f"--{n}" for n in _EXAMPLES if n in names)
        examples = f" (e.g. {examples})" if examples else ""
        heading.description = textwrap.fill(f"{len(names)} more options, each with its {first.__name__} name "
                                            f"and meaning{examples}; --help-all lists them.", 76,
                                            subsequent_indent="  ")  # no line starts as an option line does
        help_all.pointer = heading
        for a in moved:
            group.remove(a)
            heading._group_actions.append(a)
            help_all.hidden.append((a, a.help))
            a.help = argparse.SUPPRESS
    return parser


def parse_config(cls: type[T], argv: list[str] | None, prog: str, description: str | None = None,
                 first: type | None = None) -> T:
    """`--config x.yaml` plus `--key value` overrides -> an instance of `cls` (CLI wins over YAML).

    An unknown YAML key or flag is a `ConfigError` that suggests the closest name. A dataclass
    with a `config_file` field receives the YAML's path there (to resolve paths relative to it).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(cls, prog, description, first)
    valid = {a.dest for a in parser._actions}
    flags = {s.lstrip("-") for a in parser._actions for s in a.option_strings}
    config_path = None
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            config_path = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else None)
            del argv[i : i + (1 if "=" in arg else 2)]
            break
    if config_path:
        path = Path(config_path)
        defaults = read_yaml(path, "--config")
        for key in defaults:
            if key not in valid:
                raise ConfigError(f"{config_path}: unknown key {key!r}{suggest(key, valid)}")
        if "config_file" in valid:
            defaults["config_file"] = str(path)
        parser.set_defaults(**defaults)
    for arg in argv:
        if arg.startswith("--") and arg[2:].split("=")[0] not in flags:
            key = arg[2:].split("=")[0]
            raise ConfigError(f"unknown option --{key}{suggest(key.replace('-', '_'), valid)}")
    try:
        return parser.parse_args_into_dataclasses(args=argv)[0]
    except TypeError as err:  # a required option missing from YAML and CLI
        raise ConfigError(str(err)) from None
    except ValueError as err:  # values left over, e.g. `--teachers a b` (one value per option)
        if "not used by the HfArgumentParser" not in str(err):
            raise
        extra = str(err).split(": ", 1)[-1]
        raise ConfigError(f"values without an option: {extra}; each option takes one value (give a list "
                          "as YAML, e.g. --teachers \"[a, b]\")") from None


def read_yaml(path: str | Path, option: str) -> dict:
    """The mapping a YAML options file holds; any problem with it is a one-line `ConfigError` that
    names the file (and the line of a syntax error) and the `option` that gave it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{option} {path}: no such file; pass the path of an existing YAML file")
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8")) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason}); save it as UTF-8") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{path} is not valid YAML{where}: {problem}; fix the syntax there") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds a {type(data).__name__}, not a mapping of option: value; write one "
                          "`option: value` per line")
    return data


def check_output_dir(path: str | Path, option: str = "output_dir") -> Path:
    """Create the directory `path` and write (then remove) a probe file of `PROBE_BYTES` in it, so that
    a run fails at once, and names `option`, when its results could not be written (a file in the
    way, a read-only or (nearly) full file system) instead of after hours of work."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {path} is a file, not a directory; pass a directory (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path) as probe:  # removed on close, also when the write fails
            probe.write(bytes(PROBE_BYTES))
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise ConfigError(f"{option} {path} is not writable ({reason}); free space there or pass another "
                          f"{option}") from None
    return path


def to_plain(value: Any) -> Any:
    """A YAML/CLI value that may be a string holding YAML (`"{a: 1}"`, `"[x, y]"`) -> plain data. `null`,
    `~` and `none` are None on the command line as in a YAML file (`--teachers null`: no teachers), not
    a name to look up."""
    if isinstance(value, str) and value.strip().lower() in ("null", "~", "none"):
        return None
    if isinstance(value, str) and value.strip()[:1] in "{[":
        return yaml.safe_load(value)
    return value


def as_list(value: Any) -> list[str] | None:
    """A list option as given: `a b` on the command line, a YAML list, or one string holding YAML (`"[a, b]"`)."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    value = to_plain(value)
    return [value] if isinstance(value, str) else value


def teacher_name(teacher: str | Mapping[str, Any]) -> str:
    """The name of a `teachers:` entry (a path or a mapping): its `name`, else the last part of its path."""
    spec = {"path": teacher} if isinstance(teacher, str) else teacher
    name = spec.get("name")
    return Path(str(spec.get("path")).rstrip("/")).name if name is None else name


def teacher_controls(teachers: Any, run_control: str = "none") -> dict[str, str]:
    """`{teacher name: its control}` of a run's `teachers:` (an entry or a list of them): a teacher's own
    `control`, else the run's `teacher_control`. The one home of this rule, on plain YAML data, so the
    trainer (`KVDistillConfig.teacher_controls`), the card and `ablate` cannot drift apart."""
    entries = [teachers] if isinstance(teachers, (str, Mapping)) else teachers or []
    return {teacher_name(t): (None if isinstance(t, str) else t.get("control")) or run_control for t in entries}
