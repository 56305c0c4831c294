"""Fixtures of the command tests."""

import importlib

import pytest

from kvdistill.cli import COMMANDS


@pytest.fixture(scope="session")
def in_process():
    """A stand-in for `demo.run_parallel` without child processes: each command's `main`, one after another
    (what a `kvdistill` subprocess runs, less its ~5 s of imports)."""

    def run(jobs: dict[str, list[list[str]]], workers: int, logs) -> None:
        for commands in jobs.values():
            for argv in commands:
                assert importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:]) == 0, argv

    return run
