"""The adoption verdict: adopt, adopt only below a load threshold, reject, or inconclusive (too little evidence
either way) — with the evidence for each clause.

Input is one `Cell` per workload group × load level: the E2E speedup with its confidence interval, validation pass
rates, error rates and greedy mismatches of baseline and speculative runs. The rule (background article, "A sensible
adoption rule"):

- reject if speculation loses validated outputs, raises errors, changes greedy output, or (sampling) shifts the
  distribution of output lengths;
- adopt if the speedup's lower bound exceeds 1 in every group at every load level measured (a cell with fewer
  than `min_n` paired tasks never counts as a win: its interval means little);
- conditional if, for some groups, it wins at every load up to a threshold and not above it: speculation on at or
  below the threshold (for those groups), off above it;
- inconclusive if nothing is lost, no group wins, and some cell has too few paired tasks to count while none with
  enough of them loses: more tasks or repeats would decide, and the verdict names them;
- reject otherwise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

ADOPT, CONDITIONAL, REJECT, INCONCLUSIVE = "adopt", "conditional", "reject", "inconclusive"
BURSTY = 1.5  # a longest stall this many times the baseline's (CI lower bound) is reported as burstier streaming…
NOTICEABLE_STALL = 0.05  # … when it is long enough to see: 50 ms, three frames at 60 Hz (a 10 ms hiccup is not)


@dataclass(frozen=True)
class Cell:
    """Evidence for one workload group at one load level."""

    group: str
    load: float  # concurrency, or arrival rate in requests/s
    speedup: float
    lo: float
    hi: float
    n: int
    validated_base: float  # share of outputs passing every validator
    validated_spec: float
    errors_base: float  # share of requests that failed
    errors_spec: float
    mismatches: int = 0  # greedy outputs that differ from every baseline output of their task here
    baseline_changed: int = 0  # greedy outputs the baseline itself changed here (batching, repeats)
    length_p: float | None = None  # sampled runs: KS p-value that output lengths share one distribution
    outputs: str = "greedy"  # which outputs `mismatches` counts: "greedy", or "seeded" (coupled verification)
    stall_ratio: tuple[float, float, float] | None = None  # speculative / baseline longest stall: (value, lo, hi)
    stall_spec: float | None = None  # the speculative streams' median longest stall, seconds
    background: float | None = None  # the largest background share of the cores over the phases behind the cell
    busy: bool = False  # … above the run's threshold: the cell was measured on a busy machine


@dataclass(frozen=True)
class Clause:
    ok: bool
    text: str
    neutral: bool = False  # neither evidence for nor against (no clear difference): not shown as a failure


@dataclass
class Verdict:
    decision: str
    threshold: float | None = None
    groups: list[str] = field(default_factory=list)
    clauses: list[Clause] = field(default_factory=list)
    everywhere: bool = False  # conditional on groups only: those groups win at every load measured
    thresholds: dict[str, float] = field(default_factory=dict)  # each winning group's own threshold
    top_load: float | None = None  # the highest load measured
    busy: list[str] = field(default_factory=list)  # the cells ("group @ load") measured on a busy machine
    cells: int = 0  # cells judged
    busy_max: float | None = None  # the largest background share behind a busy cell

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Verdict:
        return cls(
            d["decision"],
            d.get("threshold"),
            list(d.get("groups") or []),
            [Clause(c["ok"], c["text"], bool(c.get("neutral"))) for c in d.get("clauses") or []],
            bool(d.get("everywhere")),
            {str(g): float(t) for g, t in (d.get("thresholds") or {}).items()},
            d.get("top_load"),
            list(d.get("busy") or []),
            int(d.get("cells") or 0),
            d.get("busy_max"),
        )

    def headline(self, load_name: str = "load") -> str:
        """One line saying what to do (and, when it rests on contended cells, that the machine was busy)."""
        return self._decision_line(load_name) + self._busy_line()

    def _decision_line(self, load_name: str) -> str:
        if self.decision == ADOPT:
            return "ADOPT — speculation pays off in every group at every load measured"
        if self.decision == CONDITIONAL:
            groups = ", ".join(self.groups)
            if self.everywhere:
                return (
                    f"CONDITIONAL — adopt for {groups} (wins at every load measured, up to {load_name} "
                    f"{self.threshold:g}); no reliable gain shown for the other groups"
                )
            levels = sorted(set(self.thresholds.values()))
            if len(levels) > 1:  # each group its own threshold; a server that cannot tell them apart: the lowest
                parts = []
                for t in levels:
                    named = ", ".join(g for g in self.groups if self.thresholds.get(g) == t)
                    at_top = self.top_load is not None and t >= self.top_load
                    parts.append(f"{named} at every load measured (up to {t:g})" if at_top else f"{named} at ≤ {t:g}")
                return (
                    f"CONDITIONAL — adopt by {load_name}: {'; '.join(parts)}; turn speculation off above each "
                    f"group's threshold (one setting for all: ≤ {self.threshold:g})"
                )
            return (
                f"CONDITIONAL — adopt for {groups} at {load_name} ≤ {self.threshold:g}; turn speculation off above it"
            )
        if self.decision == INCONCLUSIVE:
            return "INCONCLUSIVE — too few paired tasks to tell; nothing lost, no win shown (see the last clause)"
        return "REJECT — speculation does not pay off reliably here"

    def _busy_line(self) -> str:
        if not self.busy:
            return ""
        top = f", background up to {self.busy_max:.0%} of the cores" if self.busy_max is not None else ""
        return f" [measured on a busy machine: {len(self.busy)} of {self.cells} cells contended{top}]"


def load_name(kind: str) -> str:
    """How a verdict over loads of `kind` names its load: concurrency, or arrival rate."""
    return "concurrency" if kind == "concurrent" else "rate"


def decide(
    cells: list[Cell],
    validation_tolerance: float = 0.0,
    error_tolerance: float = 0.0,
    load_name: str = "load",
    min_n: int = 4,
) -> Verdict:
    """Apply the adoption rule to the cells; every clause carries the numbers behind it."""
    if not cells:
        return Verdict(REJECT, clauses=[Clause(False, "no measurements to judge")])
    clauses: list[Clause] = []
    safe = True
    for c in sorted(cells, key=lambda c: (c.group, c.load)):
        where = f"{c.group} @ {load_name} {c.load:g}"
        if c.validated_spec < c.validated_base - validation_tolerance:
            clauses.append(
                Clause(False, f"{where}: validation fell from {c.validated_base:.0%} to {c.validated_spec:.0%}")
            )
            safe = False
        if c.errors_spec > c.errors_base + error_tolerance:
            clauses.append(Clause(False, f"{where}: errors rose from {c.errors_base:.1%} to {c.errors_spec:.1%}"))
            safe = False
        if c.mismatches > c.baseline_changed:
            detail = f" (the baseline itself changed {c.baseline_changed} here)" if c.baseline_changed else ""
            clauses.append(
                Clause(False, f"{where}: {c.mismatches} {c.outputs} output(s) differ from the baseline{detail}")
            )
            safe = False
        elif c.mismatches:
            clauses.append(
                Clause(
                    True,
                    f"{where}: {c.mismatches} {c.outputs} output(s) differ from the baseline, no more "
                    f"than the baseline changes its own outputs here ({c.baseline_changed}), so batching could "
                    "explain them: not counted as evidence against speculation",
                )
            )
        if c.length_p is not None and c.length_p < 0.01:
            clauses.append(Clause(False, f"{where}: output lengths differ in distribution (KS p={c.length_p:.3g})"))
            safe = False
    if safe:
        outputs = "greedy outputs" if all(c.outputs == "greedy" for c in cells) else "outputs"
        clauses.append(Clause(True, f"validation, errors and {outputs}: no loss in any group at any load"))
    for c in sorted(cells, key=lambda c: (c.group, c.load)):
        noticeable = c.stall_spec is not None and c.stall_spec >= NOTICEABLE_STALL
        if c.stall_ratio is not None and c.stall_ratio[1] > BURSTY and noticeable:
            value, lo, hi = c.stall_ratio  # told, not judged: whether it matters is the user's call
            clauses.append(
                Clause(
                    False,
                    f"{c.group} @ {load_name} {c.load:g}: streams are burstier — the longest stall between chunks is "
                    f"{value:.2f}x the baseline's [95% CI {lo:.2f}–{hi:.2f}], {c.stall_spec:.2f} s at the median, "
                    "whatever E2E does",
                    neutral=True,
                )
            )
    loads = sorted({c.load for c in cells})
    groups = sorted({c.group for c in cells})
    wins = {(c.group, c.load): c.lo > 1.0 and c.n >= min_n for c in cells}
    for c in sorted(cells, key=lambda c: (c.group, c.load)):
        verb = "wins" if c.lo > 1 else ("loses" if c.hi < 1 else "no clear difference")
        if c.n < min_n:
            verb += f", but too few paired tasks to count (n={c.n} < {min_n})"
        if c.busy:
            verb += f" — measured on a busy machine (background {c.background:.0%} of the cores)"
        clauses.append(
            Clause(
                wins[(c.group, c.load)],
                f"{c.group} @ {load_name} {c.load:g}: E2E speedup "
                f"{c.speedup:.2f}x [95% CI {c.lo:.2f}–{c.hi:.2f}, n={c.n}] — "
                f"{verb}",
                neutral=not wins[(c.group, c.load)] and c.hi >= 1,  # not shown to win, not shown to lose
            )
        )
    busy = [c for c in cells if c.busy]
    extra: dict = {"top_load": loads[-1], "cells": len(cells)}
    if busy:
        extra["busy"] = [f"{c.group} @ {load_name} {c.load:g}" for c in sorted(busy, key=lambda c: (c.group, c.load))]
        extra["busy_max"] = max(c.background or 0.0 for c in busy)
        clauses.append(
            Clause(
                False,
                f"busy machine: {len(busy)} of {len(cells)} cells were measured while other processes took more of "
                f"the cores than the threshold (up to {extra['busy_max']:.0%}); speculation's extra compute costs "
                "more on contended cores, so their speedups may not hold on a quiet one — re-measure them with "
                "`specwise evaluate --resume --remeasure-contended`",
                neutral=True,
            )
        )
    if not safe:
        return Verdict(REJECT, clauses=clauses, **extra)
    if all(wins.values()):
        return Verdict(ADOPT, clauses=clauses, **extra)
    # Conditional: the largest load up to which a group wins at every level, if it stops winning above it.
    thresholds = {}
    for g in groups:
        upto = None
        for load in loads:
            if wins.get((g, load), False):
                upto = load
            else:
                break
        if upto is not None and upto < loads[-1]:
            thresholds[g] = upto
        elif upto == loads[-1]:
            thresholds[g] = upto  # wins everywhere in this group
    winners = sorted(thresholds)
    if winners and any(thresholds[g] < loads[-1] for g in winners):
        threshold = min(thresholds[g] for g in winners)
        thresholds = {g: thresholds[g] for g in winners}
        if len(set(thresholds.values())) > 1:
            each = "; ".join(
                f"{g} up to {load_name} {t:g}" + (" (every load measured)" if t == loads[-1] else "")
                for g, t in thresholds.items()
            )
            text = f"threshold per group: {each}; one setting for every group: {load_name} ≤ {threshold:g}"
        else:
            text = (
                f"threshold: speculation wins for {', '.join(winners)} up to {load_name} {threshold:g} and not at "
                "every level above"
            )
        clauses.append(Clause(True, text))
        return Verdict(CONDITIONAL, threshold, winners, clauses, thresholds=thresholds, **extra)
    if winners:  # some groups win everywhere, others never: adopt for those groups only
        clauses.append(Clause(True, f"speculation wins at every load for {', '.join(winners)} only"))
        return Verdict(CONDITIONAL, loads[-1], winners, clauses, everywhere=True, thresholds=thresholds, **extra)
    thin = [c for c in cells if c.n < min_n]
    if thin and not any(c.hi < 1 for c in cells if c.n >= min_n):
        fewest = min(c.n for c in thin)
        clauses.append(
            Clause(
                False,
                f"too few paired tasks to decide: {len(thin)} of {len(cells)} cells have fewer than {min_n} (the "
                f"fewest n={fewest}) — evaluate with more tasks (--tasks {min_n * len(groups)} or more: {min_n} per "
                f"group for {len(groups)} group(s)) or --repeats {-(-min_n // fewest)} (each repeat is a pair)",
            )
        )
        return Verdict(INCONCLUSIVE, clauses=clauses, **extra)
    return Verdict(REJECT, clauses=clauses, **extra)


def policy_from_verdict(v: Verdict, loads: list[float]) -> tuple[str, int | None]:
    """The load policy a concurrency verdict justifies: adopt → drafting on up to the highest concurrency measured
    (nothing is known above it); conditional → on up to its threshold; reject or inconclusive → never."""
    if v.decision in (REJECT, INCONCLUSIVE):
        return "never", None
    high = v.threshold if v.decision == CONDITIONAL and not v.everywhere and v.threshold is not None else max(loads)
    return "auto", max(int(high), 1)
