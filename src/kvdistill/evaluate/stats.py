"""Statistics for comparing runs; the distributions and tests are scipy.stats'.

- `wilson_interval`: confidence interval of a binomial proportion (accuracy of one run).
- `paired_ttest` / `welch_ttest`: across seeds, a variant vs its reference, paired by seed or
  unpaired (Welch: unequal variances; the honest choice when per-seed pairing carries no
  correlation).
- `tost`: two one-sided tests of equivalence within ±margin (paired or Welch).
- `mann_whitney`: rank test of two samples (e.g. steps to a dev-accuracy threshold).
- `logrank`: steps to a threshold with runs that never reach it censored at the budget.
- `paired_permutation_test` / `paired_bootstrap`: across items, per-item correctness of
  two systems paired by item (pooled over seeds), a sign-flip randomisation test and a
  bootstrap confidence interval of the accuracy difference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


def _scipy_stats() -> Any:
    """`scipy.stats`, imported on first use: importing it takes ~1 s, which every `kvdistill` start
    that reaches this module (a training, a capture, a refused command) would pay without testing anything."""
    from scipy import stats

    return stats


# ---------------------------------------------------------------------------- one run


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion; `(0, 1)` when `n == 0`.

    Better than the normal (Wald) interval at small `n` and near 0 or 1, where accuracies
    of small students live.

    Example:
        >>> [round(v, 4) for v in wilson_interval(8, 10)]
        [0.4902, 0.9433]
    """
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    z = float(_scipy_stats().norm.ppf(0.5 + confidence / 2.0))
    phat = successes / n
    denom = 1.0 + z * z / n
    center = (phat + z * z / (2 * n)) / denom
    half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / denom
    low = 0.0 if successes == 0 else max(0.0, center - half)  # exact ends, not 1 - 1e-16
    high = 1.0 if successes == n else min(1.0, center + half)
    return low, high


def mean_std(values: Sequence[float | None]) -> tuple[float, float, int]:
    """Mean, sample std (ddof=1; 0 for one value) and count of the non-missing values.

    Returns `(nan, nan, 0)` when nothing is left.
    """
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not vals:
        return math.nan, math.nan, 0
    mean = sum(vals) / len(vals)
    if len(vals) == 1:
        return mean, 0.0, 1
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return mean, math.sqrt(var), len(vals)


# ---------------------------------------------------------------------------- t-tests over seeds


@dataclass
class TTestResult:
    """t-test of `mean(a) - mean(b)`: statistic, degrees of freedom (Welch's are fractional),
    two-sided p, CI of the difference."""

    mean_diff: float
    t: float
    df: float
    p_value: float
    ci_low: float
    ci_high: float
    n: int

    def to_dict(self) -> dict:
        return asdict(self)


def _arrays(a: Sequence[float], b: Sequence[float], paired: bool) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)  # [n_a], [n_b]
    if paired and x.shape != y.shape:
        raise ValueError(f"paired samples need equal lengths, got {len(x)} and {len(y)}")
    return x, y


def _no_spread(mean: float, se: float) -> bool:
    """The standard error vanishes (every difference equal): scipy's t is nan there."""
    return se == 0.0 or se < 1e-12 * max(1.0, abs(mean))


def _ttest(a: Sequence[float], b: Sequence[float], paired: bool, confidence: float) -> TTestResult:
    x, y = _arrays(a, b, paired)
    n = len(x) if paired else len(x) + len(y)
    if len(x) == 0 or len(y) == 0:
        return TTestResult(math.nan, math.nan, 0, math.nan, math.nan, math.nan, n)
    mean = float(x.mean() - y.mean())
    if min(len(x), len(y)) < 2:
        return TTestResult(mean, math.nan, 0, math.nan, math.nan, math.nan, n)
    se = float(np.std(x - y, ddof=1) / math.sqrt(len(x))) if paired else math.sqrt(
        x.var(ddof=1) / len(x) + y.var(ddof=1) / len(y))
    if _no_spread(mean, se):  # degenerate: p = 1 for identical runs, 0 for a constant non-zero shift
        df = len(x) - 1 if paired else len(x) + len(y) - 2
        if mean == 0.0:
            return TTestResult(0.0, 0.0, df, 1.0, 0.0, 0.0, n)
        return TTestResult(mean, math.copysign(math.inf, mean), df, 0.0, mean, mean, n)
    r = _scipy_stats().ttest_rel(x, y) if paired else _scipy_stats().ttest_ind(x, y, equal_var=False)
    ci = r.confidence_interval(confidence)
    return TTestResult(mean, float(r.statistic), float(r.df), float(r.pvalue), float(ci.low), float(ci.high), n)


def paired_ttest(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> TTestResult:
    """Two-sided paired t-test of the mean of `a - b` (e.g. accuracies paired by seed).

    `scipy.stats.ttest_rel`. When every difference is equal the test is degenerate: p = 1 if
    they are all zero (identical runs), else p = 0. With fewer than two pairs the p-value is `nan`.

    Args:
        a: `[n]` values of the variant.
        b: `[n]` values of the reference, paired with `a` by position.
    """
    return _ttest(a, b, True, confidence)


def welch_ttest(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> TTestResult:
    """Two-sided unpaired t-test of `mean(a) - mean(b)` with unequal variances (Welch).

    `scipy.stats.ttest_ind(equal_var=False)`; `n` is `len(a) + len(b)`, `df` the
    Welch–Satterthwaite degrees of freedom. Pairing by seed only helps when paired runs are
    correlated; when they are not (per-seed correlation ≈ 0), the paired test throws away
    degrees of freedom and Welch is the better test. Same degenerate cases as `paired_ttest`.
    """
    return _ttest(a, b, False, confidence)


@dataclass
class TostResult:
    """Two one-sided tests (TOST) of `|mean(a) - mean(b)| < margin`.

    `p_lower` tests H0: Δ ≤ -margin, `p_upper` H0: Δ ≥ +margin; `p_value` is the larger.
    Equivalent at `alpha` iff both are below it, i.e. iff the (1 - 2·alpha) CI lies inside
    (-margin, +margin).
    """

    mean_diff: float
    margin: float
    alpha: float
    paired: bool
    p_lower: float
    p_upper: float
    p_value: float
    ci_low: float
    ci_high: float
    confidence: float
    n: int
    equivalent: bool
    verdict: str

    def to_dict(self) -> dict:
        return asdict(self)


def tost(a: Sequence[float], b: Sequence[float], margin: float, *, paired: bool = False,
         alpha: float = 0.05) -> TostResult:
    """TOST equivalence test of `a` and `b` within ±`margin` (paired t or Welch).

    Absence of a significant difference is not evidence of no difference; TOST is: it says
    "equivalent within ±margin" only when an effect as large as the margin is rejected on
    both sides. With a vanishing standard error the one-sided p values are 0 or 1.

    Args:
        a, b: per-seed values (paired by position when `paired`).
        margin: the equivalence margin (> 0), in the units of the values.
        alpha: level of each one-sided test; the CI reported is the (1 - 2·alpha) one.
    """
    if not margin > 0 or not 0 < alpha < 0.5:
        raise ValueError(f"TOST needs margin > 0 and 0 < alpha < 0.5, got margin {margin}, alpha {alpha}")
    x, y = _arrays(a, b, paired)
    r = _ttest(x, y, paired, 1.0 - 2.0 * alpha)  # its CI is the TOST CI
    if math.isnan(r.t):
        p_lower = p_upper = math.nan
    elif r.ci_low == r.ci_high:  # a zero-width CI: no spread, the shift is known exactly
        p_lower, p_upper = float(r.mean_diff <= -margin), float(r.mean_diff >= margin)
    elif paired:
        d = x - y
        p_lower = float(_scipy_stats().ttest_1samp(d, -margin, alternative="greater").pvalue)
        p_upper = float(_scipy_stats().ttest_1samp(d, margin, alternative="less").pvalue)
    else:  # shift b by the margin: Δ > -m  <=>  mean(a) > mean(b - m)
        p_lower = float(_scipy_stats().ttest_ind(x, y - margin, equal_var=False, alternative="greater").pvalue)
        p_upper = float(_scipy_stats().ttest_ind(x, y + margin, equal_var=False, alternative="less").pvalue)
    p = max(p_lower, p_upper)
    equivalent = bool(p < alpha)
    verdict = f"equivalent within ±{margin:g}" if equivalent else f"not shown equivalent within ±{margin:g}"
    return TostResult(r.mean_diff, margin, alpha, paired, p_lower, p_upper, p, r.ci_low, r.ci_high,
                      1.0 - 2.0 * alpha, r.n, equivalent, verdict)


# ---------------------------------------------------------------------------- rank and survival tests


@dataclass
class RankTestResult:
    """Mann–Whitney U of `a` vs `b`: U of `a`, two-sided p, and P(a > b) + P(a = b)/2 (U / (n_a n_b))."""

    u: float
    p_value: float
    prob_a_greater: float
    n_a: int
    n_b: int

    def to_dict(self) -> dict:
        return asdict(self)


def mann_whitney(a: Sequence[float], b: Sequence[float]) -> RankTestResult:
    """Two-sided Mann–Whitney U test (`scipy.stats.mannwhitneyu`); `nan` when a sample is empty."""
    x, y = _arrays(a, b, False)
    if len(x) == 0 or len(y) == 0:
        return RankTestResult(math.nan, math.nan, math.nan, len(x), len(y))
    r = _scipy_stats().mannwhitneyu(x, y, alternative="two-sided")
    u = float(r.statistic)
    return RankTestResult(u, float(r.pvalue), u / (len(x) * len(y)), len(x), len(y))


@dataclass
class LogRankResult:
    """Log-rank test of two samples of times with right censoring: `statistic` is (O - E) / √V of
    sample a's events (> 0: a reaches the event sooner; its square is the chi-square), p two-sided."""

    statistic: float
    p_value: float
    n_a: int
    n_b: int
    events_a: int
    events_b: int

    def to_dict(self) -> dict:
        return asdict(self)


def _censored(steps: Sequence[float], reached: Sequence[bool]) -> tuple[Any, int, int]:
    """`(scipy CensoredData, n runs, n events)` of times `steps` censored where `reached` is False."""
    t, e = np.asarray(steps, dtype=np.float64), np.asarray(reached, dtype=bool)  # [n], [n]
    if t.shape != e.shape:
        raise ValueError(f"steps and reached need equal lengths, got {len(t)} and {len(e)}")
    return _scipy_stats().CensoredData(uncensored=t[e], right=t[~e]), len(t), int(e.sum())


def survival_curve(steps: Sequence[float], reached: Sequence[bool]) -> tuple[list[float], list[float]]:
    """Kaplan–Meier estimate of the share of runs not yet at the event (`scipy.stats.ecdf`).

    Args: as `logrank`'s `steps_a` and `reached_a`.

    Returns:
        `(times [k + 1], share [k + 1])`: 1.0 at time 0, then the estimate after each distinct time, a
        step function (`where="post"`). A run censored at its budget counts as at risk until then.
    """
    data, n, _ = _censored(steps, reached)
    if n == 0:
        return [0.0], [1.0]
    sf = _scipy_stats().ecdf(data).sf
    return [0.0, *map(float, sf.quantiles)], [1.0, *map(float, sf.probabilities)]


def logrank(steps_a: Sequence[float], reached_a: Sequence[bool], steps_b: Sequence[float],
            reached_b: Sequence[bool]) -> LogRankResult:
    """Two-sided log-rank test of time-to-event (`scipy.stats.logrank`).

    Args:
        steps_a: `[n_a]` the step a run reached the event, or its budget when it never did.
        reached_a: `[n_a]` True where the event happened; False: censored at `steps_a`.
        steps_b, reached_b: the same for the other sample.

    With no event in either sample both are the same (all censored): p = 1.
    """
    (xa, na, ea), (xb, nb, eb) = _censored(steps_a, reached_a), _censored(steps_b, reached_b)
    if na == 0 or nb == 0:
        return LogRankResult(math.nan, math.nan, na, nb, ea, eb)
    if ea + eb == 0:
        return LogRankResult(0.0, 1.0, na, nb, ea, eb)
    r = _scipy_stats().logrank(xa, xb)
    return LogRankResult(float(r.statistic), float(r.pvalue), na, nb, ea, eb)


# ---------------------------------------------------------------------------- paired tests over items


def paired_permutation_test(
    a: Sequence[float], b: Sequence[float], n_resamples: int = 10_000, seed: int = 0
) -> float:
    """Two-sided sign-flip permutation test of `mean(a - b) == 0` over paired items.

    Under the null the labels of each pair are exchangeable, so each difference's sign is
    flipped at random. Exact enumeration when there are at most 16 non-zero differences,
    otherwise Monte Carlo with the `(count + 1) / (n + 1)` correction. For 0/1 correctness
    vectors this is a randomised McNemar test. Identical inputs give p = 1.

    Args:
        a: `[n]` per-item scores of system A (e.g. 0/1 correctness).
        b: `[n]` per-item scores of system B, same items in the same order.
    """
    if len(a) != len(b):
        raise ValueError(f"paired samples need equal lengths, got {len(a)} and {len(b)}")
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    d = d[d != 0]  # zero differences contribute nothing under any sign pattern
    if d.size == 0:
        return 1.0
    observed = abs(d.sum())
    tol = 1e-9 * max(1.0, observed)
    if d.size <= 16:  # exact: all 2^k sign patterns
        k = d.size
        signs = ((np.arange(2**k)[:, None] >> np.arange(k)[None, :]) & 1) * 2 - 1  # [2^k, k]
        stats = np.abs(signs @ d)
        return float(np.mean(stats >= observed - tol))
    rng = np.random.default_rng(seed)
    count, done, chunk = 0, 0, max(1, min(n_resamples, 2_000_000 // d.size))
    while done < n_resamples:
        m = min(chunk, n_resamples - done)
        signs = rng.integers(0, 2, size=(m, d.size)) * 2 - 1  # [m, k]
        count += int(np.sum(np.abs(signs @ d) >= observed - tol))
        done += m
    return (count + 1) / (n_resamples + 1)


@dataclass
class BootstrapResult:
    """Paired bootstrap of `mean(a) - mean(b)`: estimate, percentile CI, two-sided p."""

    mean_diff: float
    ci_low: float
    ci_high: float
    p_value: float
    n: int

    def to_dict(self) -> dict:
        return asdict(self)


def paired_bootstrap(
    a: Sequence[float],
    b: Sequence[float],
    n_resamples: int = 10_000,
    seed: int = 0,
    confidence: float = 0.95,
) -> BootstrapResult:
    """Paired bootstrap over items of the difference in means.

    Items are resampled with replacement (keeping each pair together). The p-value is the
    two-sided percentile p, `2 · min(P*(Δ ≤ 0), P*(Δ ≥ 0))`, capped at 1; identical inputs
    give p = 1 and a `[0, 0]` interval.
    """
    if len(a) != len(b):
        raise ValueError(f"paired samples need equal lengths, got {len(a)} and {len(b)}")
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)  # [n]
    n = d.size
    if n == 0:
        return BootstrapResult(math.nan, math.nan, math.nan, math.nan, 0)
    observed = float(d.mean())
    if np.all(d == d[0]):
        return BootstrapResult(observed, observed, observed, 1.0 if observed == 0 else 0.0, n)
    rng = np.random.default_rng(seed)
    means = np.empty(n_resamples)
    chunk = max(1, min(n_resamples, 2_000_000 // n))
    for start in range(0, n_resamples, chunk):
        m = min(chunk, n_resamples - start)
        idx = rng.integers(0, n, size=(m, n))  # [m, n]
        means[start : start + m] = d[idx].mean(axis=1)
    alpha = 1.0 - confidence
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    p = 2.0 * min(np.mean(means <= 0.0), np.mean(means >= 0.0))
    return BootstrapResult(observed, float(low), float(high), float(min(1.0, p)), n)
