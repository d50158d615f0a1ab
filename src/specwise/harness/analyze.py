"""From records to the numbers a decision needs: per configuration × load × group statistics, paired speedups with
bootstrap intervals, greedy equality, and the verdict for each speculative configuration (typed: results.py).

Groups are reported apart and never averaged together; a task counts in each of its groups.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from specwise.errors import SpecwiseError
from specwise.harness.background import per_record
from specwise.harness.load import Load
from specwise.harness.results import (
    Analysis,
    BestK,
    Comparison,
    Determinism,
    KChoice,
    Row,
    Run,
    StoredPlan,
    StreamStats,
    read_run,
)
from specwise.harness.statistics import (
    Interval,
    PhaseNoise,
    clustered_share,
    ks_two_sample,
    phase_noise,
    speedup_ci,
    summarize,
)
from specwise.harness.store import Record, Store
from specwise.harness.verdict import Cell, Verdict, decide, load_name, policy_from_verdict
from specwise.speccounts import SpecCounts


def _tpot(r: Record) -> float | None:
    if r.e2e is None or r.ttft is None or r.output_tokens < 2:
        return None
    return (r.e2e - r.ttft) / (r.output_tokens - 1)


def _stream(r: Record) -> tuple[float, float | None, float | None, list[float]] | None:
    """(first line complete, chars/s, longest stall, gaps) of one request's rendered chunks; None without chunks."""
    if not r.chunks:
        return None
    times = [t for t, _ in r.chunks]
    ends = list(itertools.accumulate(int(n) for _, n in r.chunks))
    newline = r.output.find("\n")
    first_line = times[-1] if newline < 0 else times[min(bisect.bisect_right(ends, newline), len(times) - 1)]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    span = times[-1] - times[0]
    return first_line, ends[-1] / span if span > 0 else None, max(gaps) if gaps else None, gaps


def stream_stats(records: list[Record]) -> StreamStats | None:
    per = [s for r in records if r.error is None and (s := _stream(r)) is not None]
    if not per:
        return None
    gaps = [g for s in per for g in s[3]]
    return StreamStats(
        summarize([s[0] for s in per]),
        summarize([s[1] for s in per]),
        summarize([s[2] for s in per]),
        summarize(gaps).p99,
    )


def row_stats(config: str, load: str, group: str, records: list[Record], phase_seconds: float | None) -> Row:
    """Latency percentiles, errors, validation, goodput and speculation figures for one set of records."""
    ok = [r for r in records if r.error is None]
    spec = [r.spec for r in ok if r.spec is not None]
    pooled = SpecCounts.pooled(spec)
    decode = sum(r.decode or 0.0 for r in ok)
    passed = sum(1 for r in ok if r.passed)
    n = len(records)
    return Row(
        config,
        load,
        group,
        requests=n,
        errors=n - len(ok),
        error_rate=(n - len(ok)) / n if n else 0.0,
        validated=passed,
        validation_rate=passed / n if n else 0.0,
        goodput=passed / phase_seconds if phase_seconds else None,
        ttft=summarize([r.ttft for r in ok]),
        tpot=summarize([_tpot(r) for r in ok]),
        itl=summarize([x for r in ok for x in r.itl]),
        e2e=summarize([r.e2e for r in ok]),
        prefill=summarize([r.prefill for r in ok]),
        decode=summarize([r.decode for r in ok]),
        output_tokens=summarize([r.output_tokens for r in ok]),
        acceptance_rate=pooled.acceptance_rate,
        mean_acceptance_length=pooled.mean_acceptance_length if pooled.drafted else None,
        acceptance_by_position=pooled.acceptance_by_position,
        # drafting time as a share of the decode phase (the client's clock), as the report's draft% column says
        drafting_share=pooled.drafting_time / decode if decode and pooled.drafting_time > 0 else None,  # unreported
        per_request_acceptance=[r for c in spec if (r := c.acceptance_rate) is not None],
        stream=stream_stats(records),
    )


def analyze(
    run: Run,
    model_error: Callable[[float, int], float] | None = None,
    measurement_noise: Callable[[float, int], float] | None = None,
    phase_shifts: Mapping[str, PhaseNoise] | None = None,
) -> Analysis:
    """Every table the report shows, and a verdict per speculative configuration. For a predicted run, per cell (its
    load's value, its n requests): `measurement_noise`, the relative timing noise an evaluation's own interval would
    carry — the verdict judges the interval the evaluation is expected to report, widened by it — and
    `model_error`, the time model's relative error, which the shown speedup intervals carry beside that noise:
    a prediction interval for the point the evaluation will measure. `phase_shifts`: each load's phase noise where
    the run cannot measure its own (a predicted run: its baseline's), else measured from the run's repeated phases."""
    plan = run.plan
    configs = [c.name for c in plan.configs]
    baseline, specs = configs[0], configs[1:]
    greedy = plan.temperature == 0.0
    by: dict[tuple[str, str, str], list[Record]] = defaultdict(list)
    groups: set[str] = set()
    for r in run.records:
        for g in r.groups:
            by[(r.config, r.load, g)].append(r)
            groups.add(g)
    table = []
    for c in configs:
        for ld in plan.loads:
            phase = run.phase_seconds.get(f"{c}|{ld.name}")  # goodput is per phase (its groups share the wall time)
            table += [
                row_stats(c, ld.name, g, by[(c, ld.name, g)], phase) for g in sorted(groups) if by.get((c, ld.name, g))
            ]
    ref = reference_load(plan.loads)
    base_recs = [r for r in run.records if r.config == baseline]
    exact = greedy or coupled(base_recs)  # token-exact evidence for the baseline's own outputs
    determinism = (
        baseline_determinism(run.records, baseline, [ld.name for ld in plan.loads], ref, repeats=greedy)
        if exact
        else []
    )
    backgrounds = per_record(run.backgrounds)
    units = phase_units(run)
    shifts = dict(phase_shifts) if phase_shifts is not None else measured_phase_noise(run, units)

    def behind(records: list[Record]) -> float | None:
        """The largest background share of the cores over the phases that measured `records`, where recorded."""
        found = [b for r in records if (b := backgrounds.get(r.key)) is not None]
        local = [b.share for b in found if b.observed == "local"]
        return max(local) if local else None

    comparisons, verdicts = [], {}
    for s in specs:
        cells_by_kind: dict[str, list[Cell]] = defaultdict(list)
        for load in plan.loads:
            for g in sorted(groups):
                comp = _compare(
                    CellRecords(
                        s,
                        load.name,
                        g,
                        by.get((baseline, load.name, g), []),
                        by.get((s, load.name, g), []),
                        ref,
                        by.get((baseline, ref, g), []) if ref else [],
                        units,
                        shifts.get(load.name, PhaseNoise()),
                    ),
                    greedy,
                )
                if comp is None:
                    continue
                judged = comp.e2e_speedup
                if model_error is not None or measurement_noise is not None:
                    noise = measurement_noise(load.value, comp.e2e_speedup.n) if measurement_noise else 0.0
                    model = model_error(load.value, comp.e2e_speedup.n) if model_error else 0.0
                    judged = comp.expected_e2e = comp.e2e_speedup.widened(noise)
                    both = math.hypot(model, noise)
                    comp.e2e_speedup = comp.e2e_speedup.widened(both)
                    if comp.decode_speedup is not None:
                        comp.decode_speedup = comp.decode_speedup.widened(both)
                comp.background = behind(by.get((baseline, load.name, g), []) + by.get((s, load.name, g), []))
                comp.busy = comp.background is not None and comp.background > run.busy_share
                comparisons.append(comp)
                e = judged
                cells_by_kind[load.kind].append(
                    Cell(
                        g,
                        load.value,
                        e.value,
                        e.lo,
                        e.hi,
                        e.n,
                        validated_base=comp.validation_base,
                        validated_spec=comp.validation_spec,
                        errors_base=comp.errors_base,
                        errors_spec=comp.errors_spec,
                        mismatches=len(comp.mismatches),
                        baseline_changed=comp.baseline_changed,
                        length_p=comp.output_length_ks["p"] if comp.output_length_ks else None,
                        stall_ratio=(sr.value, sr.lo, sr.hi) if (sr := comp.stall_ratio) else None,
                        stall_spec=comp.stall_spec,
                        outputs="greedy" if comp.evidence == GREEDY_EVIDENCE else "seeded",
                        background=comp.background,
                        busy=comp.busy,
                    )
                )
        verdicts[s] = {kind: decide(cells, load_name=load_name(kind)) for kind, cells in cells_by_kind.items()}
    return Analysis(
        baseline,
        configs,
        [ld.name for ld in plan.loads],
        sorted(groups),
        table,
        comparisons,
        verdicts,
        greedy,
        determinism,
        *k_sweep(plan, comparisons),
        phase_noise={ld.name: shifts.get(ld.name, PhaseNoise()) for ld in plan.loads},
    )


def k_sweep(plan: StoredPlan, comparisons: list[Comparison]) -> tuple[list[BestK], list[KChoice]]:
    """Best k per drafter, load and group, and one k per drafter and closed-loop load, for every drafter the plan
    ran with two or more numeric draft lengths."""
    sweeps: dict[str, dict[str, int]] = defaultdict(dict)  # drafter → config name → k
    for c in plan.configs[1:]:
        if c.drafter and isinstance(c.k, int):
            sweeps[c.drafter][c.name] = c.k
    best, choices = [], []
    for drafter, ks in sweeps.items():
        if len(ks) < 2:
            continue
        for load in plan.loads:
            cells = [c for c in comparisons if c.config in ks and c.load == load.name]
            groups = sorted({c.group for c in cells})
            won: dict[int, int] = defaultdict(int)
            lost: dict[int, int] = defaultdict(int)
            total: dict[int, float] = defaultdict(float)
            for g in groups:
                by_k = {ks[c.config]: c.e2e_speedup for c in cells if c.group == g}
                k = max(by_k, key=lambda kk: (by_k[kk].value, -kk))
                iv = by_k[k]
                others = [v.hi for kk, v in by_k.items() if kk != k]
                best.append(
                    BestK(drafter, load.name, g, k, iv, iv.lo > 1, all(iv.lo > h for h in others), sorted(by_k))
                )
                for kk, v in by_k.items():
                    won[kk] += v.lo > 1
                    lost[kk] += v.hi < 1
                    total[kk] += v.value
            if load.kind == "concurrent" and groups:
                safe = [kk for kk in won if lost[kk] == 0]  # a k that loses in some group is not a server setting
                top = max(safe, key=lambda kk: (won[kk], total[kk])) if safe else None
                k = top if top is not None and won[top] > 0 else 0
                choices.append(KChoice(drafter, load.name, load.value, k, won[k] if k else 0, len(groups)))
    return best, choices


def reference_load(loads: list[Load]) -> str | None:
    """The load whose baseline outputs the others are held against: the lowest concurrency (least batching), else the
    lowest arrival rate."""
    if not loads:
        return None
    closed = [ld for ld in loads if ld.kind == "concurrent"]
    return min(closed or loads, key=lambda ld: ld.value).name


def _outputs(records: list[Record]) -> dict[tuple[str, int], str | None]:
    return {(r.task_id, r.repeat): r.output for r in records if r.error is None}


def _repeat_changes(outputs: dict[tuple[str, int], str | None]) -> tuple[int, list[str]]:
    """Pairs (task, repeat ≥ 1) compared with the task's repeat 0, and the tasks whose output changed."""
    pairs = [(t, out) for (t, rep), out in outputs.items() if rep > 0 and (t, 0) in outputs]
    return len(pairs), [t for t, out in pairs if out != outputs[(t, 0)]]


def coupled(records: list[Record]) -> bool:
    """Whether these sampled outputs are reproducible token for token: every one came from a server that reports
    coupled verification (specwise: a seeded output is plain decoding's, whatever was drafted), with a seed."""
    return bool(records) and all(r.seed is not None and r.verify == "coupled" for r in records if r.error is None)


GREEDY_EVIDENCE = "greedy outputs, token for token"
COUPLED_EVIDENCE = "seeded sampled outputs, token for token (coupled verification)"
DISTRIBUTION_EVIDENCE = "output-length distributions (KS test): sampled outputs cannot be paired token for token"


def baseline_determinism(
    records: list[Record], baseline: str, loads: list[str], ref: str | None, repeats: bool = True
) -> list[Determinism]:
    """The baseline's outputs at each load against the reference load, and (greedy: a repeat asks the same) across
    repeats at each load; a sampled run's repeats have seeds of their own, so only loads are compared."""
    if ref is None:
        return []
    at = {ld: _outputs([r for r in records if r.config == baseline and r.load == ld]) for ld in loads}
    out = []
    for ld in loads:
        common = sorted(at[ld].keys() & at[ref].keys())
        n_rep, rep_changed = _repeat_changes(at[ld]) if repeats else (0, [])
        changed = [t for t, rep in common if at[ld][(t, rep)] != at[ref][(t, rep)]]
        out.append(Determinism(ld, ref, len(common), changed, n_rep, rep_changed))
    return out


@dataclass(frozen=True)
class CellRecords:
    """One cell's records: the baseline's and a configuration's at a load in a group, and the baseline's at the
    reference load (the fair audit's other side); each record's phase and the load's phase noise, which widen the
    speedup intervals (none recorded: the task bootstrap alone)."""

    config: str
    load: str
    group: str
    base: list[Record]
    spec: list[Record]
    ref: str | None = None
    ref_recs: list[Record] = field(default_factory=list)
    units: Mapping[tuple[str, str, str, int], Hashable] = field(default_factory=dict)
    phase: PhaseNoise = field(default_factory=PhaseNoise)


Unit = tuple[str, int, tuple[str, ...]]


def phase_units(run: Run) -> dict[tuple[str, str, str, int], Unit]:
    """Each record's phase as (load, repeat, the phase's tasks): the same for every configuration's phase of one
    chunk, so a configuration without phases of its own (a predicted one) takes the baseline's."""
    units = {key: (p.load, p.repeat, tuple(p.tasks)) for p in run.backgrounds for key in p.record_keys()}
    base = run.plan.baseline.name
    for r in run.records:
        if r.key not in units and (base, r.load, r.task_id, r.repeat) in units:
            units[r.key] = units[(base, r.load, r.task_id, r.repeat)]
    return units


def measured_phase_noise(run: Run, units: Mapping[tuple[str, str, str, int], Unit]) -> dict[str, PhaseNoise]:
    """Per load, how far a phase pair (a configuration's phase and the baseline's of the same chunk, run one after
    the other) shifts its tasks' paired log speedups together (`statistics.phase_noise`), pooled over the
    configurations, and never below the estimate pooled over the loads too: a chunk repeated shows it; a run of one
    repeat cannot (df 0). Drift that slows both phases of a pair alike (a VM that speeds up between repeats) moves
    no speedup and is not counted."""
    baseline = run.plan.baseline.name
    base = {r.key: r for r in run.records if r.config == baseline and r.error is None and r.e2e}
    phases: dict[str, dict[Hashable, dict[int, dict[Hashable, float]]]] = defaultdict(lambda: defaultdict(dict))
    for r in run.records:
        b = base.get((baseline, r.load, r.task_id, r.repeat)) if r.config != baseline else None
        unit = units.get(r.key)
        if b is None or unit is None or r.error is not None or not r.e2e or not b.e2e:
            continue
        load, repeat, tasks = unit
        phases[load][(r.config, tasks)].setdefault(repeat, {})[r.task_id] = math.log(b.e2e / r.e2e)
    per_load = {load: phase_noise(by_phase) for load, by_phase in phases.items()}
    # A load has few chunks (2-3 df with 12 tasks and two repeats), and a variance from 2 df reads near 0 one time in
    # five where the truth is not: the machine's part of the shift is common to the loads, so none is taken below
    # the estimate pooled over them (on six fresh identical evaluations, the question cell at concurrency 4 spread
    # 2.9x its intervals per load, 1.9x with this floor; no cell's intervals narrowed)
    pooled = phase_noise({(load, key): v for load, by_phase in phases.items() for key, v in by_phase.items()})
    return {load: p if p.variance >= pooled.variance else pooled for load, p in per_load.items()}


def _phase_widened(iv: Interval, pairs: list, cell: CellRecords, time: Callable[[Record], float | None]) -> Interval:
    """`iv` widened by what the phase pairs' shared shifts add to its estimate beyond the task bootstrap's share
    (a pair's weight in the ratio of sums is its baseline time's); unchanged where no noise was measured."""
    if cell.phase.variance <= 0:
        return iv
    kept = [b for b, x in pairs if time(b) and time(x)]
    share = clustered_share([time(b) or 0.0 for b in kept], [cell.units.get(b.key, b.key) for b in kept])
    return iv.widened(math.sqrt(cell.phase.variance * share))


def _compare(cell: CellRecords, greedy: bool) -> Comparison | None:
    config, load, group, base_recs, spec_recs = cell.config, cell.load, cell.group, cell.base, cell.spec
    ref, ref_recs = cell.ref, cell.ref_recs
    base = {(r.task_id, r.repeat): r for r in base_recs}
    spec = {(r.task_id, r.repeat): r for r in spec_recs}
    pairs = [
        (base[k], spec[k]) for k in sorted(base.keys() & spec.keys()) if base[k].error is None and spec[k].error is None
    ]
    if not pairs:
        return None
    tasks = [b.task_id for b, _ in pairs]  # a task's repeats are resampled together
    e2e = speedup_ci([b.e2e or math.nan for b, _ in pairs], [x.e2e or math.nan for _, x in pairs], tasks=tasks)
    if e2e is None:
        return None
    dec = speedup_ci([b.decode or math.nan for b, _ in pairs], [x.decode or math.nan for _, x in pairs], tasks=tasks)
    # a phase's requests move together: the intervals carry that beyond the tasks' own spread (the E2E estimate's
    # phase noise stands for the decode's too — one phase, one state of the machine)
    e2e = _phase_widened(e2e, pairs, cell, lambda r: r.e2e)
    dec = _phase_widened(dec, pairs, cell, lambda r: r.decode) if dec is not None else None
    same, vs_ref, both, changed = [], [], [], 0
    exact = greedy or (coupled(base_recs) and coupled(spec_recs) and coupled(ref_recs or base_recs))
    evidence = GREEDY_EVIDENCE if greedy else COUPLED_EVIDENCE if exact else DISTRIBUTION_EVIDENCE
    if exact:
        # Fair losslessness: the speculative output is paired with the baseline at this load and at the reference
        # load; only an output that differs from both is unexplained by what batching does to the baseline itself.
        reference = _outputs(ref_recs or []) if ref and ref != load else _outputs(base_recs)
        for b, x in pairs:
            key = (b.task_id, b.repeat)
            r = reference.get(key, b.output)
            same += [b.task_id] if x.output != b.output else []
            vs_ref += [b.task_id] if x.output != r else []
            both += [b.task_id] if x.output != b.output and x.output != r else []
            changed += b.output != r
        if greedy:  # a sampled run's repeats have their own seeds: they are not expected to repeat an output
            changed += len(_repeat_changes(_outputs(base_recs))[1])
    # Sampled outputs without coupled verification cannot match token for token: compare distributions instead.
    lengths = None if exact else ks_two_sample([b.output_tokens for b, _ in pairs], [x.output_tokens for _, x in pairs])
    stalls = [
        (b, x, t) for b, x, t in ((_stream(b), _stream(x), b.task_id) for b, x in pairs) if b and x and b[2] and x[2]
    ]
    stall_ratio = (
        speedup_ci(
            [float(x[2] or 0) for _, x, _ in stalls],
            [float(b[2] or 0) for b, _, _ in stalls],
            tasks=[t for *_, t in stalls],
        )
        if len(stalls) >= 2
        else None
    )
    bstats = row_stats("", load, group, list(base.values()), None)
    sstats = row_stats(config, load, group, list(spec.values()), None)
    return Comparison(
        config,
        load,
        group,
        len(pairs),
        e2e,
        dec,
        both,
        lengths,
        bstats.validation_rate,
        sstats.validation_rate,
        bstats.error_rate,
        sstats.error_rate,
        bstats.ttft.p50,
        sstats.ttft.p50,
        same,
        vs_ref,
        ref,
        changed,
        stall_ratio,
        sstats.stream.longest_stall.p50 if sstats.stream else None,
        evidence,
    )


def load_run(path: str | Path) -> Run:
    """Read a results file and analyse it."""
    run = read_run(path)
    run.analysis = analyze(run)
    return run


def store_verdicts(path: str | Path, analysis: Analysis) -> None:
    """Keep the verdicts in the run file, so `serve --policy-from` reads them without re-running the analysis."""
    store = Store(path)
    try:
        store.set_meta(
            "verdicts", {c: {k: v.to_dict() for k, v in by_kind.items()} for c, by_kind in analysis.verdicts.items()}
        )
    finally:
        store.close()


def policy_from_run(path: str) -> tuple[str, int | None, str]:
    """(mode, high threshold, why) from an evaluation run: its first speculative configuration with a verdict at
    fixed concurrency levels decides. Uses the verdicts stored at the end of `specwise evaluate`; a run file without
    them (an older one, or a run cut short) is analysed."""
    run = read_run(path)
    verdicts: dict[str, dict[str, Verdict]] = run.stored_verdicts or analyze(run).verdicts
    for name, by_kind in verdicts.items():
        v = by_kind.get("concurrent")
        if v is None:
            continue
        mode, high = policy_from_verdict(v, run.plan.concurrency_levels())
        return mode, high, f"{path}: {name!r} — {v.headline('concurrency')}"
    raise SpecwiseError(
        f"{path}: the run has no verdict at fixed concurrency levels, so it gives no load threshold "
        "(evaluate with --concurrency)"
    )
