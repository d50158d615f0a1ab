"""From records to the numbers a decision needs: per configuration × load × group statistics, paired speedups with
bootstrap intervals, greedy equality, and the verdict for each speculative configuration.

Groups are reported apart and never averaged together; a task counts in each of its groups.
"""

from __future__ import annotations

import math
from collections import defaultdict

from specwise.harness.load import parse_load
from specwise.harness.stats import ks_two_sample, speedup_ci, summarize
from specwise.harness.store import Record
from specwise.harness.verdict import Cell, decide
from specwise.speccounts import SpecCounts


def _tpot(r: Record) -> float | None:
    if r.e2e is None or r.ttft is None or r.output_tokens < 2:
        return None
    return (r.e2e - r.ttft) / (r.output_tokens - 1)


def config_stats(records: list[Record], phase_seconds: float | None) -> dict:
    """Latency percentiles, errors, validation, goodput and speculation figures for one set of records."""
    ok = [r for r in records if r.error is None]
    spec = [SpecCounts.from_dict(r.spec) for r in ok if r.spec]
    pooled = SpecCounts.pooled(spec)
    decode = sum(r.decode or 0.0 for r in ok)
    passed = sum(1 for r in ok if r.passed)
    return {
        "requests": len(records), "errors": len(records) - len(ok),
        "error_rate": (len(records) - len(ok)) / len(records) if records else 0.0,
        "validated": passed, "validation_rate": passed / len(records) if records else 0.0,
        "goodput": passed / phase_seconds if phase_seconds else None,
        "ttft": summarize([r.ttft for r in ok]), "tpot": summarize([_tpot(r) for r in ok]),
        "itl": summarize([x for r in ok for x in r.itl]), "e2e": summarize([r.e2e for r in ok]),
        "prefill": summarize([r.prefill for r in ok]), "decode": summarize([r.decode for r in ok]),
        "output_tokens": summarize([r.output_tokens for r in ok]),
        "acceptance_rate": pooled.acceptance_rate,
        "mean_acceptance_length": pooled.mean_acceptance_length if pooled.drafted else None,
        "acceptance_by_position": pooled.acceptance_by_position,
        # drafting time as a share of the decode phase (the client's clock), as the report's draft% column says
        "drafting_share": pooled.drafting_time / decode if decode and spec else None,
        "per_request_acceptance": [c.acceptance_rate for c in spec if c.drafted],
    }


def analyze(records: list[Record], plan: dict, phase_seconds: dict) -> dict:
    """Every table the report shows, and a verdict per speculative configuration."""
    configs = [c["name"] for c in plan["configs"]]
    baseline, specs = configs[0], configs[1:]
    loads = plan["loads"]
    greedy = plan.get("temperature", 0.0) == 0.0
    by: dict[tuple[str, str, str], list[Record]] = defaultdict(list)
    groups: set[str] = set()
    for r in records:
        for g in r.groups:
            by[(r.config, r.load, g)].append(r)
            groups.add(g)
    table = []
    for c in configs:
        for ld in loads:
            # goodput is per phase (all groups share the phase's wall time)
            phase = phase_seconds.get(f"{c}|{ld}")
            for g in sorted(groups):
                recs = by.get((c, ld, g), [])
                if recs:
                    table.append({"config": c, "load": ld, "group": g, **config_stats(recs, phase)})
    comparisons, verdicts = [], {}
    for s in specs:
        cells_by_kind: dict[str, list[Cell]] = defaultdict(list)
        for ld in loads:
            load = parse_load(ld)
            for g in sorted(groups):
                base = {(r.task_id, r.repeat): r for r in by.get((baseline, ld, g), [])}
                spec = {(r.task_id, r.repeat): r for r in by.get((s, ld, g), [])}
                pairs = [(base[k], spec[k]) for k in sorted(base.keys() & spec.keys())
                         if base[k].error is None and spec[k].error is None]
                if not pairs:
                    continue
                e2e = speedup_ci([b.e2e for b, _ in pairs], [x.e2e for _, x in pairs])
                dec = speedup_ci([b.decode or math.nan for b, _ in pairs], [x.decode or math.nan for _, x in pairs])
                mismatches = [b.task_id for b, x in pairs if b.output != x.output] if greedy else []
                # Sampled runs cannot match token for token: compare the distributions instead.
                lengths = None if greedy else ks_two_sample([b.output_tokens for b, _ in pairs],
                                                            [x.output_tokens for _, x in pairs])
                bstats, sstats = config_stats(list(base.values()), None), config_stats(list(spec.values()), None)
                comparisons.append({
                    "config": s, "load": ld, "group": g, "n": len(pairs), "e2e_speedup": e2e.to_dict(),
                    "decode_speedup": dec.to_dict() if dec else None, "mismatches": mismatches,
                    "output_length_ks": lengths,
                    "validation_base": bstats["validation_rate"], "validation_spec": sstats["validation_rate"],
                    "errors_base": bstats["error_rate"], "errors_spec": sstats["error_rate"],
                    "ttft_p50_base": bstats["ttft"]["p50"], "ttft_p50_spec": sstats["ttft"]["p50"],
                })
                cells_by_kind[load.kind].append(Cell(
                    g, load.value, e2e.value, e2e.lo, e2e.hi, e2e.n, bstats["validation_rate"],
                    sstats["validation_rate"], bstats["error_rate"], sstats["error_rate"], len(mismatches),
                    lengths["p"] if lengths else None))
        verdicts[s] = {kind: decide(cells, load_name="concurrency" if kind == "concurrent" else "rate").to_dict()
                       for kind, cells in cells_by_kind.items()}
    return {"baseline": baseline, "configs": configs, "loads": loads, "groups": sorted(groups), "table": table,
            "comparisons": comparisons, "verdicts": verdicts, "greedy": greedy}
