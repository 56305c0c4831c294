"""Statistics against known values: scipy's own functions, hand-computed formulas, textbook constants."""

import math

import numpy as np
import pytest
from scipy import stats

from kvdistill.evaluate.stats import (
    logrank,
    mann_whitney,
    mean_std,
    paired_bootstrap,
    paired_permutation_test,
    paired_ttest,
    survival_curve,
    tost,
    welch_ttest,
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


# ----------------------------------------------------------------------------- Welch, TOST, ranks, log-rank

A = [0.31, 0.35, 0.28, 0.40, 0.33]
B = [0.25, 0.30, 0.27, 0.31, 0.29, 0.22]


def test_welch_matches_scipy_and_the_satterthwaite_formula():
    r = welch_ttest(A, B)
    ref = stats.ttest_ind(A, B, equal_var=False)
    va, vb = np.var(A, ddof=1) / len(A), np.var(B, ddof=1) / len(B)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(A) - 1) + vb**2 / (len(B) - 1))  # Welch–Satterthwaite
    assert r.mean_diff == pytest.approx(np.mean(A) - np.mean(B), abs=1e-15)
    assert r.t == pytest.approx(r.mean_diff / se, rel=1e-12) and r.t == pytest.approx(ref.statistic, rel=1e-12)
    assert r.df == pytest.approx(df, rel=1e-12)
    assert r.p_value == pytest.approx(2 * stats.t.sf(abs(r.t), df), rel=1e-10)
    half = stats.t.ppf(0.975, df) * se
    assert (r.ci_low, r.ci_high) == pytest.approx((r.mean_diff - half, r.mean_diff + half), rel=1e-10)
    assert r.n == len(A) + len(B)
    # no pairing: a permutation of B changes nothing; the paired test refuses unequal lengths
    assert welch_ttest(A, B[::-1]).p_value == pytest.approx(r.p_value, rel=1e-12)
    with pytest.raises(ValueError, match="equal lengths"):
        paired_ttest(A, B)
    assert welch_ttest([0.2, 0.2], [0.2, 0.2]).p_value == 1.0
    assert math.isnan(welch_ttest([0.2], B).p_value)


def test_paired_ttest_equals_scipy_on_random_samples():
    rng = np.random.default_rng(3)
    for n in (2, 5, 15):
        a, b = rng.random(n), rng.random(n)
        r, ref = paired_ttest(a, b), stats.ttest_rel(a, b)
        assert (r.t, r.p_value) == pytest.approx((ref.statistic, ref.pvalue), rel=1e-12)
        ci = ref.confidence_interval(0.95)
        assert (r.ci_low, r.ci_high) == pytest.approx((ci.low, ci.high), rel=1e-12)


@pytest.mark.parametrize("paired", [True, False])
def test_tost_one_sided_p_values_by_hand(paired):
    b = B[:5]
    m, alpha = 0.08, 0.05
    r = tost(A, b, m, paired=paired, alpha=alpha)
    if paired:
        d = np.subtract(A, b)
        se, df = np.std(d, ddof=1) / math.sqrt(len(d)), len(d) - 1
    else:
        va, vb = np.var(A, ddof=1) / len(A), np.var(b, ddof=1) / len(b)
        se, df = math.sqrt(va + vb), (va + vb) ** 2 / (va**2 / (len(A) - 1) + vb**2 / (len(b) - 1))
    delta = np.mean(A) - np.mean(b)
    assert r.p_lower == pytest.approx(stats.t.sf((delta + m) / se, df), rel=1e-9)  # H0: Δ <= -m
    assert r.p_upper == pytest.approx(stats.t.cdf((delta - m) / se, df), rel=1e-9)  # H0: Δ >= +m
    assert r.p_value == max(r.p_lower, r.p_upper)
    half = stats.t.ppf(1 - alpha, df) * se  # the 90 % CI
    assert (r.ci_low, r.ci_high) == pytest.approx((delta - half, delta + half), rel=1e-9)
    assert r.confidence == pytest.approx(0.90) and r.paired is paired


def test_tost_verdicts():
    same = [0.40, 0.55, 0.47, 0.61, 0.52]
    wide, tiny = tost(same, same, 0.2), tost(same, same, 0.001)
    assert wide.equivalent and wide.verdict == "equivalent within ±0.2"
    assert not tiny.equivalent and tiny.verdict.startswith("not shown equivalent")
    # equivalence at alpha <=> the (1 - 2 alpha) CI inside (-m, m), over a sweep of margins
    for m in np.linspace(0.005, 0.2, 40):
        r = tost(A, B, float(m))
        assert r.equivalent == (-m < r.ci_low and r.ci_high < m)
    # a real difference is not equivalent within a margin smaller than it
    assert not tost([0.8, 0.82, 0.79, 0.81], [0.3, 0.31, 0.29, 0.32], 0.1).equivalent
    # paired, no spread: the shift is known exactly
    assert tost(same, same, 0.01, paired=True).equivalent
    assert not tost([0.5, 0.6], [0.3, 0.4], 0.1, paired=True).equivalent
    with pytest.raises(ValueError, match="margin > 0"):
        tost(A, B, 0.0)


def test_mann_whitney_u_by_counting_pairs():
    a, b = [3.0, 5.0, 5.0, 9.0], [1.0, 5.0, 2.0]
    r = mann_whitney(a, b)
    u = sum((x > y) + 0.5 * (x == y) for x in a for y in b)
    assert r.u == u == 10.0 and r.prob_a_greater == pytest.approx(u / 12)
    assert r.p_value == pytest.approx(stats.mannwhitneyu(a, b, alternative="two-sided").pvalue, rel=1e-12)
    assert mann_whitney([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]).p_value == pytest.approx(2 / math.comb(10, 5))  # exact
    assert math.isnan(mann_whitney([], b).p_value)


def _logrank_by_hand(ta, ea, tb, eb):
    """(O - E)^2 / V for group a, summed over the distinct event times."""
    t = np.r_[ta, tb]
    e = np.r_[ea, eb].astype(bool)
    g = np.r_[np.ones(len(ta)), np.zeros(len(tb))].astype(bool)
    o_minus_e, var = 0.0, 0.0
    for s in np.unique(t[e]):
        at_risk, at_risk_a = (t >= s).sum(), ((t >= s) & g).sum()
        d, d_a = ((t == s) & e).sum(), ((t == s) & e & g).sum()
        o_minus_e += d_a - d * at_risk_a / at_risk
        if at_risk > 1:
            var += d * (at_risk_a / at_risk) * (1 - at_risk_a / at_risk) * (at_risk - d) / (at_risk - 1)
    return o_minus_e**2 / var


def test_logrank_with_censoring_by_hand():
    # steps to a dev-accuracy threshold; runs that never reach it are censored at the budget 3000
    ta, ea = [500, 1000, 1000, 1500, 3000], [1, 1, 1, 1, 0]
    tb, eb = [1500, 2500, 3000, 3000, 3000], [1, 1, 0, 0, 0]
    r = logrank(ta, ea, tb, eb)
    chi2 = _logrank_by_hand(ta, ea, tb, eb)
    assert r.statistic == pytest.approx(math.sqrt(chi2), rel=1e-10)  # (O - E) / sqrt(V): a reached sooner
    assert r.p_value == pytest.approx(stats.chi2.sf(chi2, 1), rel=1e-9)
    assert (r.events_a, r.events_b, r.n_a, r.n_b) == (4, 2, 5, 5)
    # a run censored before the end (a shorter budget) leaves the risk set there, not as an event
    tc, ec = [500, 800, 1000, 1500, 3000], [1, 0, 1, 1, 0]
    assert logrank(tc, ec, tb, eb).statistic == pytest.approx(math.sqrt(_logrank_by_hand(tc, ec, tb, eb)), rel=1e-10)
    assert logrank(tc, ec, tb, eb).p_value != pytest.approx(logrank(tc, [1] * 5, tb, eb).p_value)
    # nobody reached the threshold: the samples are the same
    assert logrank([3000] * 3, [0] * 3, [3000] * 2, [0] * 2).p_value == 1.0
    with pytest.raises(ValueError, match="equal lengths"):
        logrank([1, 2], [1], [1], [1])


def test_survival_curve_is_kaplan_meier_by_hand():
    """6 runs: events at 250, 500, 500, 750; two censored at the budget 1000. KM: S = prod(1 - d_i / n_i) over
    event times: 5/6 at 250, 5/6 * 3/5 at 500 (5 at risk, 2 events), 1/2 * 2/3 at 750; flat to the budget."""
    times, share = survival_curve([500, 1000, 250, 750, 500, 1000], [1, 0, 1, 1, 1, 0])
    assert times == [0.0, 250.0, 500.0, 750.0, 1000.0]
    assert share == pytest.approx([1.0, 5 / 6, 1 / 2, 1 / 3, 1 / 3])
    # a run censored early stays at risk only until then: 2 of the 3 left reach the event at 300
    assert survival_curve([100, 300, 300, 300], [0, 1, 1, 0])[1] == pytest.approx([1.0, 1.0, 1 / 3])
    assert survival_curve([1000, 1000], [0, 0]) == ([0.0, 1000.0], [1.0, 1.0])  # nobody reached it
    assert survival_curve([], []) == ([0.0], [1.0])
