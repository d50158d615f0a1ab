"""`specwise monitor --predict`: replayed acceptance as the drift monitor's input, and the speedup it predicts.

The window's requests that the server decoded plainly (served with `--log-text`, so their token ids are logged)
become a baseline run in one group (`predict.run_from_log`) and are replayed through the evaluated configuration's
drafter at its k (`predict.predict`): exactly the acceptance a speculative server would have logged for them at
temperature 0. That acceptance replaces their empty counts in the monitor's distribution tests, and the time model
turns it into the E2E speedup the current traffic predicts per load, set beside the speedup the evaluation measured
at that load (its groups pooled: the log knows no workload groups). Requests the server decoded speculatively keep
their own counts. This loads the target and measures pass costs (once per machine), so it is asked for, not default.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from specwise.errors import SpecwiseError
from specwise.monitor.drift import DRIFTED, OK, SPEEDUP_DROP, Baseline, Replayed, Row
from specwise.monitor.requestlog import LogEntry

AUTO_KS = [1, 2, 4, 8]  # an evaluated k=auto is predicted at these fixed k and the best per load is shown


def pooled(run: Any) -> Any:
    """`run` (harness.results.Run) with every record in one group, to be analysed: per-load figures over all of it."""
    records = [dataclasses.replace(r, groups=["all"]) for r in run.records]
    return dataclasses.replace(run, records=records, analysis=None)


def predict_window(base: Baseline, log: str, entries: list[LogEntry]) -> Replayed:
    """The window's entries with replayed counts where the server decoded them plainly, the predicted-speedup rows for
    the monitor's table, and the lines printed under it (`drift.check`'s `replay`)."""
    from specwise.cli.predict import PredictSetup, check_predictable, predict, run_from_log
    from specwise.engine import load_target
    from specwise.harness.analyze import analyze
    from specwise.harness.predict import config_name
    from specwise.harness.results import read_run
    from specwise.specs import TargetOptions

    evaluation = read_run(base.path)
    config = next(c for c in evaluation.plan.configs if c.name == base.config)
    drafter = config.drafter or ""
    fixed = config.k if isinstance(config.k, int) else None
    ks = [fixed] if fixed is not None else AUTO_KS
    try:
        check_predictable(drafter, ks, evaluation.plan.temperature > 0)
    except SpecwiseError as exc:
        return entries, [], [f"no prediction for {base.config}: {exc}"]
    loaded = load_target(TargetOptions(evaluation.plan.model))  # once, for the log's run and the replay
    with tempfile.TemporaryDirectory(prefix="specwise-monitor-") as tmp:
        try:
            run_path, tasks = run_from_log(Path(log), loaded, Path(tmp) / "w", entries, group="all")
        except SpecwiseError as exc:
            return entries, [], [f"no prediction: {exc}"]
        p = predict(run_path, drafter, ks, PredictSetup(model=evaluation.plan.model, loaded=loaded))
    evaluated = {c.load: c.e2e_speedup for c in analyze(pooled(evaluation)).comparisons if c.config == base.config}
    replayed = {}  # id(entry) → the counts a server speculating at the evaluated k would have logged for it
    if fixed is not None:
        name = config_name(p.drafter, fixed)
        for r in p.predicted.records:
            if r.config == name and r.spec is not None:  # the drafting share as predicted: the rest verifies
                spec = dataclasses.replace(r.spec, verification_time=max((r.decode or 0.0) - r.spec.drafting_time, 0))
                replayed[id(tasks[r.task_id])] = spec
    replaced = [
        dataclasses.replace(e, spec=replayed[id(e)], speculative=True) if id(e) in replayed else e for e in entries
    ]
    how = (
        f"k={fixed} (their acceptance is in the table above)"
        if fixed is not None
        else f"k in {AUTO_KS} (the evaluation ran k=auto: no acceptance replayed into the table; the best k per load)"
    )
    lines = [
        f"replayed: {len(tasks)} plainly decoded requests of the window through {drafter} {how}; pass costs of "
        f"{p.costs.cpu} ({p.costs.kernels})"
    ]
    rows = []
    k_of = {c.name: c.k for c in p.predicted.plan.configs[1:]}
    best: dict[str, Any] = {}  # load → the predicted comparison of the k that does best there
    for c in p.predicted.analysed.comparisons:
        if c.load not in best or c.e2e_speedup.value > best[c.load].e2e_speedup.value:
            best[c.load] = c
    order = {ld.name: ld.value for ld in p.predicted.plan.loads}
    for load, c in sorted(best.items(), key=lambda kv: order[kv[0]]):
        e, then = c.e2e_speedup, evaluated.get(load)
        lines.append(
            f"  {load}: predicted E2E {e.value:.2f}x [{e.lo:.2f}–{e.hi:.2f}] at k={k_of[c.config]} over {e.n} requests"
            + (f"; the evaluation measured {then.value:.2f}x [{then.lo:.2f}–{then.hi:.2f}]" if then else
               "; the evaluation did not measure this load")
        )  # fmt: skip
        if then is None:
            continue
        fell = e.hi < then.value * (1 - SPEEDUP_DROP)
        rows.append(
            Row(
                f"predicted E2E speedup at {load} (replayed)",
                f"{then.value:.2f}x",
                f"{e.value:.2f}x",
                f"{e.value / then.value - 1:+.0%}",
                DRIFTED if fell else OK,
                f"interval [{e.lo:.2f}–{e.hi:.2f}], n={e.n}; drift if its top is {SPEEDUP_DROP:.0%} or more below "
                "the evaluation's",
            )
        )
    for cfg, by_kind in p.predicted.analysed.verdicts.items():
        for v in by_kind.values():
            lines.append(f"  PREDICTED VERDICT for this traffic, {drafter} k={k_of[cfg]}: {v.headline('concurrency')}")
    return replaced, rows, lines
