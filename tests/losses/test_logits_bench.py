"""`benchmarks/bench_logits.py` (`kvdistill bench --only logits`): every variant computes the same loss,
memory is measured in fresh processes, and the headline keys are there."""

import json
from pathlib import Path

import pytest
import torch

from kvdistill.commands import bench
from kvdistill.commands.bench import find_benchmarks_dir, load_benchmark

TINY = {"tokens": 24, "hidden": 8, "vocab": 64, "chunk": 8}


@pytest.fixture(scope="module")
def mod():
    return load_benchmark(find_benchmarks_dir() / "bench_logits.py")


def test_variants_compute_the_same_loss_gradients(mod):
    """ce plain = ce chunked, kd unchunked = kd chunked = kd from given teacher logits and cross-vocab unchunked
    = chunked: the comparison is of one computation."""
    grads = {}
    for v in mod.VARIANTS:
        x = mod.make_inputs(TINY, t_logits=v == "kd chunked, teacher logits")
        mod.step_fn(v, x, TINY["chunk"])()
        grads[v] = (x["hidden"].grad, x["weight"].grad)
    for a, b in (("ce plain", "ce chunked"), ("kd unchunked", "kd chunked"),
                 ("kd chunked", "kd chunked, teacher logits"), ("cross-vocab unchunked", "cross-vocab chunked")):
        for ga, gb in zip(grads[a], grads[b]):
            torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-5)
    for kd in ("kd chunked", "cross-vocab chunked"):
        assert not torch.allclose(grads["ce chunked"][1], grads[kd][1])


def test_measure_variant_sees_the_logits(mod):
    """Unchunked KD holds several N×V fp32 buffers: its measured peak is above their size."""
    shape = {"tokens": 256, "hidden": 16, "vocab": 4096, "chunk": 32}
    peak = mod.measure_variant("kd unchunked", shape)
    assert peak > 3 * 256 * 4096 * 4 / 2**20
    assert peak > 2 * mod.measure_variant("kd chunked", shape)


@pytest.mark.slow
@pytest.mark.extended
def test_bench_logits_quick_run(mod, tmp_path: Path):
    """End to end through `kvdistill bench`: a fresh process per variant, JSON + README with the headline."""
    out = tmp_path / "results"
    bench.main(["--only", "logits", "--quick", "--out", str(out)])
    rec = json.loads((out / "logits.json").read_text())
    assert "error" not in rec, rec.get("traceback")
    res = rec["result"]
    assert res["ratio"] == res["mem_over_ce"] > 1.0 and res["time_over_ce"] > 0
    chunked = [v for v in mod.VARIANTS if v not in mod.UNCHUNKED]
    assert [r["case"] for r in res["results"]] == chunked + list(mod.VARIANTS)  # the headline's vocab, the other's
    assert res["time_floor_over_ce"] == pytest.approx(4 / 3) and 1.0 < res["mem_floor_over_ce"] < 2.0
    assert res["cross_mem_over_ce"] > 1.0 and res["mem_over_ce_4096"] > 1.0
    assert res["mem_unchunked_over_chunked_4096"] > 1.0 and res["cross_mem_unchunked_over_chunked_4096"] > 1.0
    assert all(r["peak_mib"] > 0 and r["rss_peak_mib"] >= 0 for r in res["results"])
    assert "| logits | mem_over_ce |" in (out / "README.md").read_text()
