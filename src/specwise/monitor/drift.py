"""`specwise monitor`: does live traffic still look like the evaluation that justified speculation?

The baseline is an evaluation run (run.db); "now" is a window of the server's request log. Compared:

- revisions: the target's and the draft's identity in the log against the run's — if either changed, the
  evaluation no longer applies (verdict `invalid`);
- per-request acceptance rate and acceptance length (tokens per verification step): two-sample Kolmogorov–Smirnov
  tests, so a change of shape counts, not only of means;
- prompt and output length mix (KS as well);
- the share of requests whose load (running + waiting) lay beyond the highest concurrency the run measured;
- the realised speedup estimate: tokens per verification step × (1 − drafting share of step time). A fall counts
  when the traffic's per-token acceptance fell with it, or a per-request test shows it: adaptive k's draft lengths
  depend on what the engine has seen (a fresh server drafts shorter at first), so identical traffic can yield fewer
  tokens per step without anything having drifted.

A distribution is `drifted` when its test rejects at α / (number of tests) — Bonferroni, so a window drawn from the
baseline's own distribution raises a false alarm with probability at most α — and the change is large enough to
matter (`MIN_EFFECT`; for the speedup estimate, a fall of `SPEEDUP_DROP`). No torch here.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specwise.errors import SpecwiseError
from specwise.harness.background import Background
from specwise.harness.provenance import Target
from specwise.harness.results import read_run
from specwise.harness.statistics import ks_two_sample
from specwise.monitor.requestlog import LogEntry, RequestLog
from specwise.speccounts import SpecCounts
from specwise.specs import BUSY_SHARE

OK, DRIFTED, INVALID = "ok", "drifted", "invalid"
MIN_N = 5  # fewer requests than this in either sample: reported, not tested
# Smallest change that counts as drift once the test rejects: absolute for rates, relative for the rest.
MIN_EFFECT = {"acceptance rate": 0.10, "acceptance length": 0.10, "prompt tokens": 0.25, "output tokens": 0.25}
BEYOND_SHARE = 0.10  # share of requests above the highest evaluated load that counts as drift
SPEEDUP_DROP = 0.15  # relative fall of the speedup estimate that counts as drift
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_window(text: str) -> float | None:
    """'90s', '15m', '1h', '2d' → seconds; 'all' → None (the whole log)."""
    if text == "all":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhd])", text.strip())
    if not m or float(m.group(1)) <= 0:
        raise SpecwiseError(
            f"--window {text!r} does not parse: write a positive number with a unit s, m, h or d "
            "(e.g. 30m, 1h, 2d), or 'all'"
        )
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass
class Baseline:
    """What the evaluation measured for the speculative configuration the server runs."""

    path: str
    config: str
    target: Target
    draft: dict | None
    drafter: str | None
    acceptance_rate: list[float]
    acceptance_length: list[float]
    prompt_tokens: list[float]
    output_tokens: list[float]
    max_load: float | None
    speedup_estimate: float | None
    speedups: list[float] = field(default_factory=list)  # per request, for the test
    busy_phases: int = 0  # phases of the evaluation measured on a busy machine
    phases: int = 0  # phases with a background recorded


@dataclass
class Row:
    metric: str
    baseline: str
    now: str
    change: str
    verdict: str
    detail: str = ""


_BASELINES: dict[tuple, Baseline] = {}


def load_baseline(path: str, drafter: str | None = None) -> Baseline:
    """Read an evaluation run; take the speculative configuration whose drafter is `drafter`, else the first.

    Only the plan, provenance and records are read (no analysis), once per file version: `--watch` and the
    server's gauges call this again and again."""
    try:
        key = (str(Path(path).resolve()), Path(path).stat().st_mtime_ns, drafter)
    except OSError:
        key = None
    if key in _BASELINES:
        return _BASELINES[key]
    run = read_run(path)
    spec = run.plan.configs[1:]
    if not spec:
        raise SpecwiseError(f"{path}: the run has no speculative configuration to compare with")
    chosen = next((c for c in spec if drafter and c.drafter and _same_drafter(c.drafter, drafter)), spec[0])
    recs = [r for r in run.records if r.config == chosen.name and r.error is None]
    if not recs:
        raise SpecwiseError(f"{path}: the run holds no finished requests of {chosen.name!r}")
    prov = run.provenance
    loads = run.plan.concurrency_levels()
    samples = [_sample(r.spec or SpecCounts(), r.prompt_tokens, r.output_tokens) for r in recs]
    base = Baseline(
        path=path,
        config=chosen.name,
        target=prov.target,
        draft=prov.configs[chosen.name].draft_identity if chosen.name in prov.configs else None,
        drafter=chosen.drafter,
        acceptance_rate=[s["rate"] for s in samples if s["rate"] is not None],
        acceptance_length=[s["length"] for s in samples if s["length"] is not None],
        prompt_tokens=[s["prompt"] for s in samples],
        output_tokens=[s["output"] for s in samples],
        max_load=max(loads) if loads else None,
        speedup_estimate=SpecCounts.pooled(r.spec or SpecCounts() for r in recs).speedup_estimate,
        speedups=[s["speedup"] for s in samples if s["speedup"] is not None],
        busy_phases=sum(p.background.busy(run.busy_share) for p in run.backgrounds),
        phases=len(run.backgrounds),
    )
    if key is not None:
        _BASELINES[key] = base
    return base


def _same_drafter(spec: str, name: str) -> bool:
    """A run's drafter spec ('model:/path', 'ngram:2') against a server's drafter name ('model:name', 'ngram')."""
    return spec == name or spec.partition(":")[0] == name.partition(":")[0]


def _sample(c: SpecCounts, prompt_tokens: int, output_tokens: int) -> dict:
    """One request's figures; acceptance only for requests that drafted."""
    return {
        "rate": c.acceptance_rate,
        "length": c.mean_acceptance_length if c.drafted else None,
        "speedup": c.speedup_estimate,
        "prompt": float(prompt_tokens),
        "output": float(output_tokens),
    }


def compare(base: Baseline, entries: list[LogEntry], alpha: float = 0.01) -> list[Row]:
    """The monitor's table: one row per metric, each with its verdict."""
    if not entries:
        raise SpecwiseError("the window holds no requests: widen --window, or send traffic first")
    rows = _revision_rows(base, entries)
    samples = [_sample(e.spec, e.prompt_tokens, e.output_tokens) for e in entries]
    now = {
        "acceptance rate": [s["rate"] for s in samples if s["rate"] is not None],
        "acceptance length": [s["length"] for s in samples if s["length"] is not None],
        "prompt tokens": [s["prompt"] for s in samples],
        "output tokens": [s["output"] for s in samples],
    }
    then = {
        "acceptance rate": base.acceptance_rate,
        "acceptance length": base.acceptance_length,
        "prompt tokens": base.prompt_tokens,
        "output tokens": base.output_tokens,
    }
    level = alpha / (len(now) + 1)  # Bonferroni over the distribution tests and the speedup estimate's
    for metric in now:
        rows.append(_distribution_row(metric, then[metric], now[metric], level))
    if base.max_load is not None:
        beyond = sum(e.load > base.max_load for e in entries) / len(entries)
        rows.append(
            Row(
                f"load > {base.max_load:g} (beyond evaluated)",
                "0%",
                f"{beyond:.0%}",
                f"{beyond:+.0%}",
                DRIFTED if beyond > BEYOND_SHARE else OK,
                f"{sum(e.load > base.max_load for e in entries)} of {len(entries)} requests",
            )
        )
    est_now = SpecCounts.pooled(e.spec for e in entries).speedup_estimate
    if base.speedup_estimate is not None and est_now is not None:
        change = est_now / base.speedup_estimate - 1
        per_request = [s["speedup"] for s in samples if s["speedup"] is not None]
        metric = "speedup estimate (tokens/step × (1 − draft share))"
        rates = now["acceptance rate"]
        rate_fell = (  # fewer than MIN_N requests: reported, not judged (one bad request is not a trend)
            len(rates) >= MIN_N
            and bool(base.acceptance_rate)
            and np.mean(base.acceptance_rate) - np.mean(rates) >= MIN_EFFECT["acceptance rate"]
        )
        tested = len(base.speedups) >= MIN_N and len(per_request) >= MIN_N
        ks = ks_two_sample(base.speedups, per_request) if tested else None
        verdict = DRIFTED if change < -SPEEDUP_DROP and (rate_fell or (ks is not None and ks["p"] < level)) else OK
        detail = (
            (f"KS D={ks['d']:.2f} p={ks['p']:.2g}; " if ks else "")
            + f"drift if it falls ≥ {SPEEDUP_DROP:g} with acceptance down ≥ {MIN_EFFECT['acceptance rate']:g}"
            + (f" or p < {level:.2g}" if ks else "")
        )
        rows.append(Row(metric, f"{base.speedup_estimate:.2f}", f"{est_now:.2f}", f"{change:+.0%}", verdict, detail))
    elif base.speedup_estimate is not None:
        rows.append(
            Row("speedup estimate", f"{base.speedup_estimate:.2f}", "-", "-", OK, "no request in the window speculated")
        )
    return rows


def _revision_rows(base: Baseline, entries: list[LogEntry]) -> list[Row]:
    rows = []
    sha_then = base.target.sha256
    shas = {e.target.get("sha256") for e in entries}
    changed = sorted((s for s in shas if s != sha_then), key=str)
    rows.append(
        Row(
            "target revision",
            _short(sha_then),
            ", ".join(_short(s) for s in sorted(shas, key=str)),
            "changed" if changed else "same",
            INVALID if changed else OK,
            f"target {base.target.name} changed: the evaluation no longer applies" if changed else "",
        )
    )
    drafts = {_draft_key(e.draft) for e in entries if e.speculative and e.draft}
    if base.draft is None:
        rows.append(
            Row(
                "draft revision",
                "-",
                ", ".join(sorted(drafts)) or "-",
                "-",
                OK,
                "the run did not record its draft's identity",
            )
        )
    else:
        then = _draft_key(base.draft)
        other = sorted(d for d in drafts if d != then)
        rows.append(
            Row(
                "draft revision",
                then,
                ", ".join(sorted(drafts)) or "-",
                "changed" if other else "same",
                INVALID if other else OK,
                f"draft {', '.join(other)} is not the evaluated {then}: the evaluation no longer applies"
                if other
                else "",
            )
        )
    return rows


def _draft_key(d: dict) -> str:
    rev = d.get("sha256") or d.get("derived_from")
    return f"{d.get('name')}@{_short(rev)}" if rev else str(d.get("name"))


def _short(sha) -> str:
    return str(sha)[:12] if sha else "-"


def _distribution_row(metric: str, then: list[float], now: list[float], level: float) -> Row:
    if len(then) < MIN_N or len(now) < MIN_N:
        return Row(metric, _mean(then), _mean(now), "-", OK, f"n={len(then)}/{len(now)}: too few to test")
    ks = ks_two_sample(then, now)
    assert ks is not None  # both samples have MIN_N values or more
    m0, m1 = float(np.mean(then)), float(np.mean(now))
    if metric == "acceptance rate":
        effect, change = abs(m1 - m0), f"{m1 - m0:+.2f}"
    else:
        effect = abs(m1 / m0 - 1) if m0 else float("inf")
        change = f"{m1 / m0 - 1:+.0%}" if m0 else "-"
    drifted = ks["p"] < level and effect >= MIN_EFFECT[metric]
    return Row(
        metric,
        f"{m0:.2f}",
        f"{m1:.2f}",
        change,
        DRIFTED if drifted else OK,
        f"KS D={ks['d']:.2f} p={ks['p']:.2g} (drift if p < {level:.2g} and change ≥ {MIN_EFFECT[metric]:g})",
    )


def _mean(x: list[float]) -> str:
    return f"{np.mean(x):.2f}" if x else "-"


ACCEPTANCE_METRICS = ("acceptance rate", "acceptance length", "speedup estimate")


def retrain_hint(rows: list[Row], log: str, has_text: bool) -> str | None:
    """When acceptance drifted: the command that trains a draft head on the logged traffic (issue 23's loop), or
    what the log lacks for it; None otherwise."""
    if not any(r.verdict == DRIFTED and r.metric.startswith(ACCEPTANCE_METRICS) for r in rows):
        return None
    command = f"specwise train-draft --from {log} --out head-$(date +%Y%m%d)"
    if not has_text:
        return (
            "acceptance drifted: a draft head trained on recent traffic may recover it, but this log holds no prompt "
            f"text — serve with --log-text, then run `{command}`"
        )
    return (
        f"acceptance drifted: a draft head trained on recent traffic may recover it — `{command}`, then evaluate "
        "it against the current drafter (`--launch 'specwise serve --drafter eagle:DIR'`)"
    )


def background_lines(samples: list[tuple[float, dict]], base: Baseline, threshold: float = BUSY_SHARE) -> list[str]:
    """What the machine's background was in the window (the server's samples) and during the evaluation."""
    lines = []
    figures = [Background.read(f) for _, f in samples]
    if figures:
        busy = [b for b in figures if b.busy(threshold)]
        worst = max(figures, key=lambda b: b.share)
        mean = sum(b.share for b in figures) / len(figures)
        named = worst.text()
        if "busiest: " not in named:  # the worst sample caught only short-lived processes: name the busy samples'
            most: dict[str, float] = {}
            for b in busy:
                for cmd, cores in b.top:
                    most[cmd] = max(most.get(cmd, 0.0), cores)
            top = sorted(((c, n) for c, n in most.items() if n >= 0.01), key=lambda x: -x[1])[:3]
            if top:
                named += "; busiest: " + ", ".join(f"{c} {n:.2f}" for c, n in top) + " (in the busy samples)"
        lines.append(
            f"background in the window: busy in {len(busy)} of {len(figures)} samples (above {threshold:.0%} of the "
            f"cores), mean {mean:.0%}; worst: {named}"
            if busy
            else f"background in the window: quiet (at most {worst.share:.0%} of the cores over {len(figures)} samples)"
        )
    if base.busy_phases:
        lines.append(
            f"the evaluation itself was measured on a busy machine: {base.busy_phases} of {base.phases} phases "
            "contended (its latencies may not be the quiet machine's)"
        )
    return lines


def format_table(
    rows: list[Row],
    base: Baseline,
    entries: list[LogEntry],
    window: str,
    log: str | None = None,
    background: list[tuple[float, dict]] | None = None,
    notes: list[str] | None = None,
) -> str:
    """The table over the window's `entries`, its notes (`monitor --predict`'s lines), the overall verdict and what
    to do about it."""
    head = f"baseline {base.path} ({base.config}) vs {len(entries)} logged requests, window {window}"
    w = max(len(r.metric) for r in rows)
    lines = [head, f"{'metric':<{w}}  {'baseline':>14}  {'now':>14}  {'change':>8}  verdict"]
    for r in rows:
        lines.append(f"{r.metric:<{w}}  {r.baseline:>14}  {r.now:>14}  {r.change:>8}  {r.verdict:<8} {r.detail}")
    lines += notes or []
    worst = (
        INVALID
        if any(r.verdict == INVALID for r in rows)
        else (DRIFTED if any(r.verdict == DRIFTED for r in rows) else OK)
    )
    lines.append("")
    lines.append(
        {
            OK: "OK — traffic still matches the evaluation",
            DRIFTED: "DRIFTED — traffic no longer matches the evaluation: re-run `specwise evaluate` on it",
            INVALID: "INVALID — a revision changed: the evaluation no longer applies; re-run it",
        }[worst]
    )
    context = background_lines(background or [], base)
    busy_window = any(Background.read(f).busy() for _, f in background or [])
    if worst != OK and busy_window:
        lines[-1] += " (the alarm fell in a busy period on this machine: latency and load figures may reflect it)"
    lines += context
    hint = retrain_hint(rows, log, any(e.prompt for e in entries)) if log else None
    if hint:
        lines.append(hint)
    return "\n".join(lines)


def status(rows: list[Row]) -> int:
    """Exit code: 0 all ok, 1 drifted or invalid."""
    return 1 if any(r.verdict != OK for r in rows) else 0


# The window's entries with replayed acceptance where the server decoded plainly, rows to add to the table and lines
# to print under it (`cli.monitor_predict`: it loads the model, which this layer does not).
Replayed = tuple[list[LogEntry], list[Row], list[str]]


def check(
    baseline: str,
    log: str,
    window: str = "1h",
    alpha: float = 0.01,
    until: float | None = None,
    replay: Callable[[Baseline, str, list[LogEntry]], Replayed] | None = None,
) -> tuple[list[Row], str]:
    """One comparison of the log's window with the baseline: rows and the printed table; `replay` (monitor
    --predict) puts replayed acceptance in the tests and predicted speedups in the table."""
    seconds = parse_window(window)
    if not 0 < alpha < 1:
        raise SpecwiseError(f"--alpha {alpha} is not allowed: give a level between 0 and 1 (e.g. 0.01)")
    rlog = RequestLog(log, mode="r")
    try:
        if rlog.count() == 0:
            raise SpecwiseError(f"{log}: the request log is empty (no request has finished since it was started)")
        end = until or time.time()
        entries = rlog.entries(since=None if seconds is None else end - seconds, until=end)
        background = rlog.backgrounds(since=None if seconds is None else end - seconds, until=end)
    finally:
        rlog.close()
    drafter = next((e.drafter for e in entries if e.drafter), None)
    base = load_baseline(baseline, drafter)
    if not entries:
        raise SpecwiseError(f"the window (last {window}) holds no requests: widen --window, or send traffic first")
    extra: list[Row] = []
    lines: list[str] = []
    if replay is not None:
        entries, extra, lines = replay(base, log, entries)
    rows = compare(base, entries, alpha) + extra
    return rows, format_table(rows, base, entries, window, log, background, lines)
