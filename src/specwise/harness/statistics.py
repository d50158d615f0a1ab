"""Statistics for paired comparisons: percentiles, summaries, and bootstrap confidence intervals of speedups.

A speedup is baseline time over speculative time (> 1 means faster). Baseline and speculative runs of the same task
are paired, so the bootstrap resamples tasks, keeping each task's pairs (one per repeat) together; the statistic is
the ratio of the mean times (total baseline time over total speculative time), which weighs long requests as users
feel them.

Requests measured in one phase (a chunk of tasks run together for one configuration) share whatever the machine did
during it and, above concurrency 1, their batches: their errors move together, which resampling tasks does not see.
`phase_noise` measures that shared shift from repeats of the same phase, and `clustered_share` says how much of it a
cell's estimate carries; the intervals are widened by it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation between order statistics; None for no values."""
    if not len(values):
        return None
    return percentiles(sorted(float(v) for v in values), (q,))[0]


@dataclass(frozen=True)
class Summary:
    """n, mean, p50, p90, p99 of some measurements (None where there are none)."""

    n: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


def summarize(values: Sequence[float | None]) -> Summary:
    """The summary of a list of measurements, Nones left out."""
    kept = [float(v) for v in values if v is not None]
    if not kept:
        return Summary()
    p50, p90, p99 = percentiles(sorted(kept), (50, 90, 99))
    return Summary(len(kept), float(np.mean(kept)), p50, p90, p99)


def percentiles(ordered: Sequence[float], qs: Sequence[float]) -> list[float]:
    """`np.percentile(values, qs)` (linear interpolation) of values already sorted, to the last bit, in plain Python:
    an analysis summarises hundreds of short lists, where numpy's call costs 20x the arithmetic."""
    n = len(ordered)
    out = []
    for q in qs:
        at = (n - 1) * (q / 100)
        i = min(math.floor(at), n - 1)
        j = min(i + 1, n - 1)
        t = at - i
        a, b = ordered[i], ordered[j]
        out.append(b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t)  # numpy's _lerp, both halves
    return out


@dataclass(frozen=True)
class Interval:
    """A point estimate and its confidence interval."""

    value: float
    lo: float
    hi: float
    n: int

    def to_dict(self) -> dict:
        return {"value": self.value, "lo": self.lo, "hi": self.hi, "n": self.n}

    def widened(self, relative_error: float, z: float = 1.96) -> Interval:
        """The interval with a further relative error (a standard deviation, in log terms) added in quadrature on
        each side: what a prediction's interval carries for the error of the model that made it."""
        if relative_error <= 0 or not (self.value > 0 and self.lo > 0 and self.hi > 0):
            return self
        extra = (z * relative_error) ** 2
        below = math.sqrt(math.log(self.value / self.lo) ** 2 + extra)
        above = math.sqrt(math.log(self.hi / self.value) ** 2 + extra)
        return Interval(self.value, self.value * math.exp(-below), self.value * math.exp(above), self.n)


def speedup_ci(
    baseline: Sequence[float],
    speculative: Sequence[float],
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
    tasks: Sequence[Hashable] | None = None,
) -> Interval | None:
    """Paired speedup sum(baseline)/sum(speculative) with a percentile-bootstrap interval over tasks. `tasks` names
    each pair's task where a task was measured more than once (repeats): its pairs are drawn together, as one unit,
    since repeats of one task share what makes that task fast or slow and are not independent samples (drawn one by
    one, two repeats made an interval up to √2 too narrow). Without `tasks` every pair is its own task."""
    base = np.asarray(baseline, dtype=float)
    spec = np.asarray(speculative, dtype=float)
    if len(base) != len(spec) or (tasks is not None and len(tasks) != len(base)):
        raise ValueError("paired samples (and their tasks) must have the same length")
    ok = np.isfinite(base) & np.isfinite(spec) & (spec > 0)
    base, spec = base[ok], spec[ok]
    if len(base) == 0:
        return None
    value = float(base.sum() / spec.sum())
    if len(base) == 1:
        return Interval(value, value, value, 1)
    kept = [t for t, keep in zip(tasks, ok, strict=True) if keep] if tasks is not None else []
    units = {t: i for i, t in enumerate(dict.fromkeys(kept))}
    if len(units) > 1:  # one unit per task, its pairs' sums (a single task's repeats are all there is to draw)
        at = np.array([units[t] for t in kept])
        base = np.bincount(at, weights=base, minlength=len(units))
        spec = np.bincount(at, weights=spec, minlength=len(units))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(base), size=(resamples, len(base)))  # (R, n): tasks drawn with replacement
    ratios = base[idx].sum(axis=1) / spec[idx].sum(axis=1)
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(ratios, [alpha, 1 - alpha])
    return Interval(value, float(lo), float(hi), int(ok.sum()))


@dataclass(frozen=True)
class PhaseNoise:
    """How far one phase shifts its requests' log times together, beyond each request's own noise: a variance (log
    terms) and the degrees of freedom it was estimated from (0: not measured — one repeat cannot show it)."""

    variance: float = 0.0
    df: int = 0

    @property
    def sd(self) -> float:
        return math.sqrt(self.variance)


def phase_noise(phases: Mapping[Hashable, Mapping[int, Mapping[Hashable, float]]]) -> PhaseNoise:
    """The variance of a phase's shared shift, from phases repeated on the same tasks: `phases` maps a phase (the same
    tasks run together, once per repeat) → repeat → task → log time. Per phase, each task's mean over the repeats is
    taken out (the task's own speed); what is left, averaged over the phase's tasks, varies from repeat to repeat by
    the phase's shift plus the tasks' own noise over their number, and the latter is estimated from the spread of the
    tasks within the phase and taken back out (a one-way random-effects estimate). Pooled over phases by their
    degrees of freedom (repeats − 1 each); never below 0. Only tasks measured in every repeat of their phase count."""
    total, df = 0.0, 0
    for by_repeat in phases.values():
        repeats = sorted(by_repeat)
        common = set.intersection(*(set(by_repeat[r]) for r in repeats)) if repeats else set()
        n, R = len(common), len(repeats)
        if R < 2 or n < 2:
            continue
        tasks = sorted(common, key=repr)
        y = np.array([[by_repeat[r][t] for t in tasks] for r in repeats])  # (R, n)
        z = y - y.mean(axis=0)  # each task's own speed taken out
        shifts = z.mean(axis=1)  # (R,): the phase's shift per repeat, plus noise
        within = ((z - shifts[:, None]) ** 2).sum() / ((n - 1) * (R - 1))  # a request's own noise, variance
        total += (shifts**2).sum() - (R - 1) * within / n
        df += R - 1
    return PhaseNoise(max(0.0, float(total) / df), df) if df else PhaseNoise()


def clustered_share(weights: Sequence[float], units: Sequence[Hashable]) -> float:
    """For a weighted mean of log times whose members share a shift per unit (a phase): the variance that shift adds,
    per unit of its variance, beyond what each member contributes on its own (which a bootstrap over the members
    already sees) — Σ over units of (the unit's weight² − its members' squared weights), weights normalised."""
    w = np.asarray(weights, dtype=float)
    if len(w) != len(units):
        raise ValueError("every weight needs its unit")
    if len(w) == 0 or not np.isfinite(w).all() or w.sum() <= 0:
        return 0.0
    w = w / w.sum()
    at = {u: i for i, u in enumerate(dict.fromkeys(units))}
    per_unit = np.bincount([at[u] for u in units], weights=w, minlength=len(at))
    return float((per_unit**2).sum() - (w**2).sum())


def ks_two_sample(a: Sequence[float], b: Sequence[float]) -> dict | None:
    """Two-sample Kolmogorov–Smirnov (are two sets of, say, output lengths drawn from one distribution?): the largest
    gap D between the empirical CDFs and its p-value — exact for small samples (scipy's `method="auto"`: exact
    below 10,000 pairs), where the asymptotic formula is wrong (groups of 6 are common here)."""
    from scipy.stats import ks_2samp  # lazy: importing scipy.stats takes ~0.8 s, which `specwise --help` should not pay

    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if not len(x) or not len(y):
        return None
    res = ks_2samp(x, y, alternative="two-sided", method="auto")
    return {"d": float(res.statistic), "p": float(res.pvalue), "n": [len(x), len(y)]}
