"""The number-layout instrument (`kvdistill.lab.probe.layout_scores`, `kvdistill layout`): its math, and the
command end to end on the tiny models."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvdistill.commands.layout import main
from kvdistill.config import ConfigError
from kvdistill.data import DataError
from kvdistill.lab.probe import cycle_order, layout_scores


def fourier_code(n: int, freqs: list[int], d: int = 6) -> torch.Tensor:
    """`[n, d]`: the numbers 0..n-1 on the circles of `freqs`, spread over `d` dims by a random rotation."""
    x = torch.arange(n, dtype=torch.float64)
    circles = torch.cat([torch.stack([torch.cos(2 * math.pi * k * x / n), torch.sin(2 * math.pi * k * x / n)], 1)
                         for k in freqs], 1)  # [n, 2 * len(freqs)]
    rot = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64)).Q[: circles.shape[1]]  # orthonormal rows
    return circles @ rot


@pytest.mark.parametrize("n", [16, 17])
def test_a_code_of_two_frequencies_has_all_its_power_there_and_a_circulant_gram(n):
    s = layout_scores(fourier_code(n, [3, 5]))
    assert s["share"] == pytest.approx(1.0) and sorted(s["frequencies"]) == [3, 5]
    assert s["circulant_r2"] == pytest.approx(1.0) and s["uniform"] == 2 / (n // 2)
    # the same code with its rows in another order is no longer on the cycle
    shuffled = layout_scores(fourier_code(n, [3, 5])[torch.randperm(n)])
    assert shuffled["share"] < 0.8 and shuffled["circulant_r2"] < 0.9


@pytest.mark.parametrize("n", [16, 17])
def test_the_shares_of_all_frequencies_sum_to_one_parseval(n):
    codes = torch.randn(n, 5, dtype=torch.float64)
    whole = layout_scores(codes, top=n // 2)  # every nonzero frequency
    assert whole["share"] == pytest.approx(1.0)
    # the Nyquist frequency n / 2 of an even n has no conjugate: a unit wave there and a unit circle at frequency 1
    # hold the same power (n^2 each), so neither is two thirds of it
    x = torch.arange(n, dtype=torch.float64)
    waves = torch.stack([torch.cos(math.pi * x), torch.cos(2 * math.pi * x / n), torch.sin(2 * math.pi * x / n)], 1)
    if n % 2 == 0:
        assert layout_scores(waves, top=1)["share"] == pytest.approx(0.5)


def test_cycle_order_is_the_numbers_or_the_powers_of_a_primitive_root():
    assert cycle_order(5) == [0, 1, 2, 3, 4]
    assert cycle_order(7, 3) == [1, 3, 2, 6, 4, 5]  # 3 generates the nonzero numbers mod 7
    with pytest.raises(ValueError, match="2 is not a primitive root mod 7"):
        cycle_order(7, 2)  # 2^3 = 1 mod 7


def test_command_scores_each_model_and_its_untrained_copy(tiny_world, tmp_path, capsys):
    out = tmp_path / "layout"
    model = str(tiny_world.models["llama_teacher"])
    assert main(["--model", model, "--numbers", "7", "--generator", "3", "--untrained", "--output_dir", str(out)]) == 0
    res = json.loads((out / "layout.json").read_text())
    assert res["format"] == "kvdistill-layout/1" and res["generator"] == 3 and res["numbers"] == 7
    assert [(r["model"], r["code"]) for r in res["rows"]] == [
        (m, c) for m in (model, f"{model} (untrained)") for c in ("embed", "k_pre", "v")]
    for r in res["rows"]:
        assert 0 < r["share"] <= 1 + 1e-9 and r["uniform"] == pytest.approx(2 / 3) and r["circulant_r2"] <= 1
    trained, untrained = res["rows"][2], res["rows"][5]  # the values of the model and of its random copy
    assert trained["share"] != untrained["share"] and trained["config_hash"] == untrained["config_hash"]
    assert "circulant R²" in capsys.readouterr().out


def test_bad_input_is_refused_in_one_line_before_anything_is_written(tiny_world, tmp_path):
    model = str(tiny_world.models["llama_teacher"])
    with pytest.raises(ConfigError, match="2 is not a primitive root mod 7"):
        main(["--model", model, "--numbers", "7", "--generator", "2", "--output_dir", str(tmp_path / "a")])
    with pytest.raises(DataError, match="the number 10 is 2 tokens of its tokenizer, not one"):
        main(["--model", model, "--numbers", "1001", "--output_dir", str(tmp_path / "b")])
    with pytest.raises(ConfigError, match="pass --model"):
        main(["--model", model, "--output_dir", str(tmp_path / "c")])
    assert not any((tmp_path / d).exists() for d in "abc")
