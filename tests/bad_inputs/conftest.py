"""Bad inputs, given the way a user gives them: real files in a temp dir, the real command line.

Every case is one invocation of `kvdistill COMMAND ...` that must be refused: a non-zero exit, no
Python traceback, a last stderr line `kvdistill COMMAND: error: ...` that names the problem and
the fix, and no file written in the case's output location. Most cases run in-process through
`kvdistill.cli.main`, the dispatcher and error policy of the console script (a child process
spends 8-20 s importing torch and transformers on a busy 2-core machine); the cases marked
`@pytest.mark.subprocess` run as `python -m kvdistill.cli ...` in a child process, like a shell
runs them, four at a time from the start of the session (`Children`).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvdistill.synthetic import make_splits, write_jsonl

SUBPROCESS_TIMEOUT_S = 300


@dataclass(frozen=True)
class World:
    """Tiny models and a small GSM8K-format data dir (train / dev / test), saved once per session."""

    student: Path  # Qwen2-style, 2 layers, 512 positions
    teacher: Path  # Qwen2-style, 4 layers, the student's tokenizer
    teacher_alt_tok: Path  # Llama-style, 3 layers, another tokenizer
    gpt2: Path  # learned position table of 512 rows: a longer input indexes past it
    alt_tokenizer: Path  # more tokens than `teacher` has embeddings for
    data: Path


@pytest.fixture(scope="session")
def world(tiny_world, tmp_path_factory) -> World:
    data = tmp_path_factory.mktemp("bad_inputs_data")
    train, held = make_splits(16, 16, seed=0)
    write_jsonl(train, data / "train.jsonl")
    write_jsonl(held[:8], data / "dev.jsonl")
    write_jsonl(held[8:], data / "test.jsonl")
    m = tiny_world.models
    return World(m["student"], m["qwen2_teacher"], m["llama_teacher_alt_tok"], m["gpt2"],
                 tiny_world.tokenizers["bpe_alt"], data)


def train_argv(world: World, **overrides: Any) -> list[str]:
    """`kvdistill train` argv of a 1-step SFT run on the tiny world (`output_dir` and what a case needs)."""
    args = {
        "student": world.student, "data": world.data, "kv_weight": 0, "max_steps": 1,
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "max_length": 128,
        "logging_steps": 1, "save_steps": 1000, "use_cpu": "true", "disable_tqdm": "true", "report_to": "none",
        "dataloader_num_workers": 0, "seed": 0,
    }
    args.update(overrides)
    return ["train", *(x for k, v in args.items() for x in (f"--{k}", str(v)))]


def teacher_list(*paths: Path | str, **keys: Any) -> str:
    """The `--teachers` value for these paths (`keys` go into every entry)."""
    extra = "".join(f", {k}: {v}" for k, v in keys.items())
    return "[" + ", ".join(f"{{path: {p}{extra}}}" for p in paths) + "]"


@pytest.fixture(scope="session")
def checkpoint(world, tmp_path_factory) -> Path:
    """A real `checkpoint-1` of a 1-step KV run with `world.teacher` (resume cases copy and damage it)."""
    from kvdistill.commands.train import main

    run = tmp_path_factory.mktemp("checkpoint_run")
    argv = train_argv(world, output_dir=run, kv_weight=0.1, kv_warmup_steps=0, save_steps=1,
                      teachers=teacher_list(world.teacher))
    assert main(argv[1:]) == 0
    return run / "checkpoint-1"


@dataclass
class Ctx:
    """What a case builds its bad input from: the world, its own temp dir, its output location `out`."""

    world: World
    tmp: Path
    checkpoint: Callable[[], Path]

    @property
    def out(self) -> Path:
        return self.tmp / "out"

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
        return path

    def data(self, *lines: dict | str | bytes, split: str = "train", good: int = 3) -> Path:
        """A data dir whose `split.jsonl` holds `good` valid records, then `lines` (dicts as JSON)."""
        valid = (self.world.data / "train.jsonl").read_bytes().splitlines()[:good]
        rows = [*valid, *(json.dumps(x).encode() if isinstance(x, dict) else x if isinstance(x, bytes)
                          else x.encode() for x in lines)]
        self.file(f"data/{split}.jsonl", b"\n".join(rows) + b"\n")
        return self.tmp / "data"

    def model(self, which: str = "student", drop: tuple[str, ...] = (), truncate: str | None = None) -> Path:
        """A copy of a world model dir without the files `drop`, with file `truncate` cut in half."""
        path = self.tmp / f"{which}_copy"
        shutil.copytree(getattr(self.world, which), path)
        for name in drop:
            (path / name).unlink()
        if truncate:
            data = (path / truncate).read_bytes()
            (path / truncate).write_bytes(data[: len(data) // 2])
        return path

    def train(self, **overrides: Any) -> list[str]:
        return train_argv(self.world, **{"output_dir": self.out, **overrides})

    teachers = staticmethod(teacher_list)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "subprocess(fsize_limit=None): run the case as `python -m kvdistill.cli` "
                            "in a child process; fsize_limit (bytes) sets its RLIMIT_FSIZE: a larger write "
                            "fails as on a full disk")


def start_cli(*args: Any, cwd: Path, fsize_limit: int | None = None) -> subprocess.Popen:
    """Start `python -m kvdistill.cli ARGS` in `cwd`, its stdout and stderr going to `cwd/stdout.log`
    and `cwd/stderr.log`; `fsize_limit` (bytes) is its RLIMIT_FSIZE, a disk that is (nearly) full."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "MPLBACKEND": "Agg"}

    def limit() -> None:  # Python ignores SIGXFSZ, so a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))

    with (cwd / "stdout.log").open("wb") as out, (cwd / "stderr.log").open("wb") as err:
        return subprocess.Popen([sys.executable, "-m", "kvdistill.cli", *map(str, args)], cwd=cwd, env=env,
                                stdout=out, stderr=err, preexec_fn=None if fsize_limit is None else limit)


def finish_cli(proc: subprocess.Popen, cwd: Path, timeout: float = SUBPROCESS_TIMEOUT_S) -> tuple[int, str, str]:
    """Wait for a `start_cli` child: `(exit code, stdout, stderr)`."""
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    read = lambda name: (cwd / name).read_text(encoding="utf-8", errors="replace")  # noqa: E731
    return rc, read("stdout.log"), read("stderr.log")


class Children:
    """The session's `subprocess` cases, run `width` at a time in collection order from the start of
    the session, ahead of the test that checks each, so that their imports overlap with the
    in-process cases and with each other instead of adding up."""

    def __init__(self, items: list, make_ctx: Callable[[], Ctx], width: int = 4):
        self.pending = [i for i in items if i.get_closest_marker("subprocess") is not None
                        and "argv" in getattr(getattr(i, "callspec", None), "params", {})]
        self.make_ctx, self.width = make_ctx, width
        self.running: dict[str, tuple[subprocess.Popen, Ctx, list[str], dict[Path, int]]] = {}
        self._top_up()

    def _top_up(self) -> None:
        while self.pending and sum(p.poll() is None for p, *_ in self.running.values()) < self.width:
            self._start(self.pending.pop(0))

    def _start(self, item) -> None:
        ctx = self.make_ctx()
        args = [str(a) for a in item.callspec.params["argv"](ctx)]
        limit = item.get_closest_marker("subprocess").kwargs.get("fsize_limit")
        before = files_under(ctx.out)
        self.running[item.nodeid] = (start_cli(*args, cwd=ctx.tmp, fsize_limit=limit), ctx, args, before)

    def result(self, nodeid: str) -> tuple[int, str, str, Ctx, list[str], dict[Path, int]]:
        """Wait for the case `nodeid` (starting it, and the next ones, if not yet started)."""
        while nodeid not in self.running and self.pending:
            self._start(self.pending.pop(0))
        proc, ctx, args, before = self.running.pop(nodeid)
        result = finish_cli(proc, ctx.tmp)
        self._top_up()
        return (*result, ctx, args, before)

    def close(self) -> None:
        for proc, *_ in self.running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session", autouse=True)
def children(request, world, tmp_path_factory):
    pool = Children([i for i in request.session.items if not any(m.args and m.args[0] is True
                                                                 for m in i.iter_markers("skipif"))],
                    lambda: Ctx(world, tmp_path_factory.mktemp("child"),
                                lambda: request.getfixturevalue("checkpoint")))
    yield pool
    pool.close()


def run_in_process(argv: list[Any], capsys) -> tuple[int, str, str]:
    """`kvdistill.cli.main(argv)` with the outcome a shell would see: an uncaught exception becomes
    its traceback on stderr and exit code 1, `SystemExit` (argparse) its code."""
    from kvdistill.cli import main

    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except Exception:
        traceback.print_exc()
        rc = 1
    out, err = capsys.readouterr()
    return rc, out, err


def files_under(path: Path) -> dict[Path, int]:
    """Every file under `path` with its size (none when `path` is not a directory)."""
    return {p: p.stat().st_size for p in path.rglob("*") if p.is_file()} if path.is_dir() else {}


def assert_refused(rc: int, stderr: str, command: str, expect: tuple[str, ...]) -> None:
    """Non-zero exit, no traceback, and a last stderr line `kvdistill COMMAND: error: ...` holding `expect`."""
    assert "Traceback" not in stderr, f"a traceback instead of a message:\n{stderr[-4000:]}"
    assert rc != 0, f"accepted (exit 0); stderr ends:\n{stderr[-2000:]}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    assert last.startswith(f"kvdistill {command}: error: "), f"the last stderr line is not one error message: {last!r}"
    missing = [s for s in expect if s not in last]
    assert not missing, f"the message lacks {missing}: {last!r}"


@pytest.fixture
def refused(world, tmp_path, capsys, monkeypatch, request):
    """`refused(argv, expect)`: run `kvdistill` with `argv(ctx)` (no program name) in-process, or in a
    child process under the `subprocess` mark, and assert it was refused: non-zero exit, no
    traceback, one last error line holding every substring of `expect` (the problem, where, the
    fix), and no file left in `ctx.out`. Returns stderr."""

    def check(argv: Callable[[Ctx], list[Any]], expect: tuple[str, ...]) -> str:
        if request.node.get_closest_marker("subprocess") is not None:  # started ahead with the others
            rc, _, err, ctx, args, before = request.getfixturevalue("children").result(request.node.nodeid)
        else:
            ctx = Ctx(world, tmp_path, lambda: request.getfixturevalue("checkpoint"))
            args = [str(a) for a in argv(ctx)]
            before = files_under(ctx.out)
            monkeypatch.chdir(tmp_path)
            rc, _, err = run_in_process(args, capsys)
        assert_refused(rc, err, args[0], expect)
        left = {p: n for p, n in files_under(ctx.out).items() if p not in before}
        assert not left, f"the refused run left files in {ctx.out}: {left}"
        return err

    return check


@pytest.fixture
def train_args(world):
    """`train_args(**overrides)`: `train_argv` on the session's world."""
    return lambda **overrides: train_argv(world, **overrides)
