"""Statistics against known values (scipy / textbook constants, computed once and pinned here)."""

import math

import numpy as np
import pytest

from kvdistill.evaluate.stats import (
    betainc,
    mean_std,
    normal_ppf,
    paired_bootstrap,
    paired_permutation_test,
    paired_ttest,
    t_ppf,
    t_sf,
    wilson_interval,
)


def test_wilson_known_values():
    # 8/10: the textbook example (e.g. Newcombe 1998) gives [0.4902, 0.9433]
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.4901625, abs=1e-6)
    assert high == pytest.approx(0.9433178, abs=1e-6)
    # 0/20: upper bound z^2 / (n + z^2)
    z2 = 1.959963984540054**2
    assert wilson_interval(0, 20) == pytest.approx((0.0, z2 / (20 + z2)), abs=1e-12)
    assert wilson_interval(20, 20)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(11, 10)


def test_distribution_functions():
    assert normal_ppf(0.975) == pytest.approx(1.959963984540054, abs=1e-12)
    # scipy.stats.t.sf / t.ppf, pinned
    assert t_sf(2.1, 4) == pytest.approx(0.0518266431588011, abs=1e-12)
    assert t_sf(0.3, 1) == pytest.approx(0.4072264209222577, abs=1e-12)
    assert t_sf(-1.2, 7) == pytest.approx(0.8654140315863967, abs=1e-12)
    assert t_ppf(0.975, 4) == pytest.approx(2.7764451051977934, abs=1e-9)
    assert t_ppf(0.975, 30) == pytest.approx(2.0422724563012378, abs=1e-9)
    assert betainc(2.0, 3.0, 0.4) == pytest.approx(0.5248, abs=1e-12)  # closed form: 1-(0.6^4+4*.4*.6^3)
    assert t_sf(0.0, 5) == pytest.approx(0.5)


def test_paired_ttest_matches_scipy_constant():
    a = [0.31, 0.35, 0.28, 0.40, 0.33]
    b = [0.25, 0.30, 0.27, 0.31, 0.29]
    r = paired_ttest(a, b)
    # scipy.stats.ttest_rel(a, b): statistic 3.8348249442368525, pvalue 0.018541393276604364
    assert r.t == pytest.approx(3.8348249442368525, abs=1e-9)
    assert r.p_value == pytest.approx(0.018541393276604364, abs=1e-4)
    assert r.p_value == pytest.approx(0.018541393276604364, abs=1e-12)
    assert r.df == 4
    assert r.mean_diff == pytest.approx(0.05)
    assert r.ci_low < 0.05 < r.ci_high
    assert r.ci_low == pytest.approx(
        0.05 - 2.7764451051977934 * np.std(np.subtract(a, b), ddof=1) / math.sqrt(5)
    )
    # symmetric: swapping the arms flips the sign, keeps p
    r2 = paired_ttest(b, a)
    assert r2.t == pytest.approx(-r.t) and r2.p_value == pytest.approx(r.p_value)


def test_paired_ttest_degenerate_cases():
    same = [0.2, 0.3, 0.25]
    assert paired_ttest(same, same).p_value == 1.0
    assert paired_ttest([0.5, 0.6], [0.4, 0.5]).p_value == 0.0  # constant non-zero difference
    assert math.isnan(paired_ttest([0.5], [0.4]).p_value)
    with pytest.raises(ValueError):
        paired_ttest([1, 2], [1])


def test_paired_tests_separated_vs_identical():
    rng = np.random.default_rng(0)
    n = 300
    base = (rng.random(n) < 0.3).astype(float)
    better = np.maximum(base, (rng.random(n) < 0.4).astype(float))  # strictly more correct items
    # across items
    assert paired_permutation_test(better, base) < 0.05
    assert paired_bootstrap(better, base).p_value < 0.05
    assert paired_permutation_test(base, base) == 1.0
    assert paired_bootstrap(base, base).p_value == 1.0
    # across seeds
    acc_a = [0.60, 0.62, 0.58, 0.61, 0.63]
    acc_b = [0.30, 0.33, 0.29, 0.31, 0.28]
    assert paired_ttest(acc_a, acc_b).p_value < 0.05
    assert paired_ttest(acc_b, acc_b).p_value > 0.05
    # overlapping noise: no evidence
    noise = base.copy()
    flip = rng.choice(n, 6, replace=False)
    noise[flip[:3]] = 1 - noise[flip[:3]]
    assert paired_permutation_test(noise, base) > 0.05


def test_permutation_exact_small_case():
    # 5 discordant pairs, all in favour of A: exact two-sided p = 2 / 2^5
    a = [1, 1, 1, 1, 1, 0, 1]
    b = [0, 0, 0, 0, 0, 0, 1]
    assert paired_permutation_test(a, b) == pytest.approx(2 / 32)


def test_bootstrap_interval_covers_difference():
    a = [1, 0, 1, 1, 0, 1, 1, 0, 1, 1] * 10
    b = [1, 0, 0, 1, 0, 0, 1, 0, 1, 0] * 10
    r = paired_bootstrap(a, b, n_resamples=2000, seed=1)
    assert r.mean_diff == pytest.approx(0.3)
    assert r.ci_low < 0.3 < r.ci_high
    assert r.ci_low > 0
    assert paired_bootstrap(a, b, n_resamples=2000, seed=1) == r  # seeded: reproducible


def test_mean_std():
    assert mean_std([1.0, 2.0, 3.0]) == pytest.approx((2.0, 1.0, 3))
    assert mean_std([None, 4.0]) == (4.0, 0.0, 1)
    m, s, n = mean_std([None])
    assert n == 0 and math.isnan(m) and math.isnan(s)
