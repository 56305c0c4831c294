"""Statistics for accuracy comparisons, with no dependency beyond `math` and numpy.

- `wilson_interval`: confidence interval of a binomial proportion (accuracy of one run).
- `paired_ttest`: across seeds, variant vs baseline accuracy paired by seed.
- `paired_permutation_test` / `paired_bootstrap`: across items, per-item correctness of
  two systems paired by item (pooled over seeds), a sign-flip randomisation test and a
  bootstrap confidence interval of the accuracy difference.

The Student t distribution is computed from the regularised incomplete beta function
(Lentz continued fraction, Numerical Recipes §6.4), so p-values match scipy to ~1e-12.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

# ---------------------------------------------------------------------------- distributions


def normal_ppf(p: float) -> float:
    """Inverse standard-normal CDF (bisection on `erfc`; exact to ~1e-15)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if 0.5 * math.erfc(-mid / math.sqrt(2.0)) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta function I_x(a, b)."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    # the continued fraction converges fast for x < (a+1)/(a+b+2); use the symmetry otherwise
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: float) -> float:
    """Survival function P(T > t) of Student's t with `df` degrees of freedom."""
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return tail if t >= 0 else 1.0 - tail


def t_ppf(p: float, df: float) -> float:
    """Inverse CDF of Student's t (bisection on `t_sf`)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    lo, hi = -1e6, 1e6
    for _ in range(300):
        mid = 0.5 * (lo + hi)
        if 1.0 - t_sf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


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
    z = normal_ppf(0.5 + confidence / 2.0)
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


# ---------------------------------------------------------------------------- paired tests


@dataclass
class TTestResult:
    """Paired t-test of `a - b`: statistic, degrees of freedom, two-sided p, CI of the mean."""

    mean_diff: float
    t: float
    df: int
    p_value: float
    ci_low: float
    ci_high: float
    n: int

    def to_dict(self) -> dict:
        return asdict(self)


def paired_ttest(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> TTestResult:
    """Two-sided paired t-test of the mean of `a - b` (e.g. accuracies paired by seed).

    Same statistic as `scipy.stats.ttest_rel`. When every difference is equal the test is
    degenerate: p = 1 if they are all zero (identical runs), else p = 0. With fewer than two
    pairs the p-value is `nan`.

    Args:
        a: `[n]` values of the variant.
        b: `[n]` values of the reference, paired with `a` by position.
    """
    if len(a) != len(b):
        raise ValueError(f"paired samples need equal lengths, got {len(a)} and {len(b)}")
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)  # [n]
    n = len(d)
    if n == 0:
        return TTestResult(math.nan, math.nan, 0, math.nan, math.nan, math.nan, 0)
    mean = float(d.mean())
    if n < 2:
        return TTestResult(mean, math.nan, 0, math.nan, math.nan, math.nan, n)
    df = n - 1
    sd = float(d.std(ddof=1))
    if sd == 0.0 or sd < 1e-12 * max(1.0, abs(mean)):
        if mean == 0.0:
            return TTestResult(0.0, 0.0, df, 1.0, 0.0, 0.0, n)
        return TTestResult(mean, math.copysign(math.inf, mean), df, 0.0, mean, mean, n)
    se = sd / math.sqrt(n)
    t = mean / se
    p = min(1.0, 2.0 * t_sf(abs(t), df))
    half = t_ppf(0.5 + confidence / 2.0, df) * se
    return TTestResult(mean, t, df, p, mean - half, mean + half, n)


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
