"""Helpers for training tests: a base config on the tiny fixtures, and `accelerate launch`."""

import os
import subprocess
import sys

import pytest


@pytest.fixture
def base_args(tiny_world, tmp_path):
    """CLI args for a fast CPU run on the tiny fixtures (override what a test needs)."""
    return _base_args(tiny_world, tmp_path / "run")


@pytest.fixture(scope="module")
def module_base_args(tiny_world, tmp_path_factory):
    """`base_args` for module-scoped fixtures (a reference run shared by a module's tests)."""
    return _base_args(tiny_world, tmp_path_factory.mktemp("run") / "run")


def _base_args(tiny_world, output_dir):
    m = tiny_world.models

    def make(**overrides):
        args = {
            "student": str(m["student"]),
            "teachers": f"[{{path: {m['qwen2_teacher']}}}]",
            "data": str(tiny_world.data_dir),
            "output_dir": str(output_dir),
            "max_length": 160,
            "max_steps": 6,
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 1,
            "learning_rate": 1e-3,
            "aligner_learning_rate": 1e-3,
            "kv_warmup_steps": 0,
            "logging_steps": 2,
            "save_steps": 1000,
            "use_cpu": True,
            "seed": 0,
            "dataloader_num_workers": 0,
            "disable_tqdm": True,
        }
        args.update(overrides)
        argv = []
        for k, v in args.items():
            argv += [f"--{k}", str(v)]
        return argv

    return make


@pytest.fixture(scope="session")
def launch():
    """`launch(launcher_args, target)`: run `accelerate launch <launcher_args> <target...>` on a free
    port (tests may launch side by side), one intra-op thread per process; returns the `CompletedProcess`."""

    def run(launcher_args: list[str], target: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0", *launcher_args, *target]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)

    return run
