"""`keep_freed_memory`: a freed large tensor's pages are reused, not faulted in again; the CLI turns it on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings (Linux)")

# page faults per training-like round (allocate, fill and free a 32 MiB and a 16 MiB tensor), mean of rounds
# 11-20: glibc's heap takes a few rounds to settle (aligned blocks do not refit at first)
_PROBE = """
import json, resource, sys, torch
from kvdistill.malloc import allocator, keep_freed_memory
on = keep_freed_memory() if sys.argv[1] == "keep" else False
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
per_round = []
torch.set_num_threads(1)
for _ in range(20):
    before = faults()
    x, y = torch.empty(8 << 20), torch.empty(4 << 20)  # 32 + 16 MiB = 12288 pages of 4 KiB
    x.fill_(1.0), y.fill_(1.0)
    del x, y
    per_round.append(faults() - before)
print(json.dumps({"on": on, "allocator": allocator(), "faults": sum(per_round[10:]) / 10}))
"""


PROBES = {"default": ("default", {}), "keep": ("keep", {}), "off": ("keep", {"KVDISTILL_KEEP_FREED_MEMORY": "0"})}


@pytest.fixture(scope="module")
def probes() -> dict[str, dict]:
    """`PROBES` (name -> probe mode, extra env), each in its own process, all started at once: each spends
    seconds importing torch, so side by side they take the time of one per core (faults are counted per
    process, RUSAGE_SELF)."""
    procs = {name: subprocess.Popen([sys.executable, "-c", _PROBE, mode], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
             for name, (mode, env) in PROBES.items()}
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate()
        assert proc.returncode == 0, err[-3000:]
        results[name] = json.loads(out)
    return results


def test_freed_pages_are_reused_instead_of_faulted_in_again(probes):
    default, keep = probes["default"], probes["keep"]
    assert default == {"on": False, "allocator": "default", "faults": default["faults"]}
    assert default["faults"] > 4000  # glibc unmaps the blocks on free: their pages fault in again
    assert keep["on"] is True and keep["allocator"] == "keep_freed"
    assert keep["faults"] < default["faults"] / 4  # mostly the same pages, kept by the heap


def test_env_switch_leaves_glibc_defaults(probes):
    off = probes["off"]
    assert off["on"] is False and off["allocator"] == "default" and off["faults"] > 4000


def test_cli_turns_it_on_and_reports_record_it(tmp_path):
    """`kvdistill ...` sets it before any command runs, and `environment()` (every run summary) records it."""
    code = ("import json, sys; from kvdistill import cli; from kvdistill.report import environment; "
            "cli.main(['gen-data', '--output_dir', sys.argv[1], '--n_train', '4', '--n_test', '2']); "
            "print(json.dumps(environment()['allocator']))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "data")], capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == "keep_freed"
