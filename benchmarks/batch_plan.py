"""Adaptive k in a batch: the pass's tokens per second (the engine's `plan_batch`) against each row's own speed (tried).

A pass's time is every row's time; its accepted drafts are only the drafting rows' tokens. `plan_batch` spends a
pass's draft tokens where they raise the pass's expected tokens per second, and a copying row drafts beside rows
that gain nothing from it: in an evaluation of the pair's code workload at concurrency 4 (Zen 4, n-gram k=auto)
edits ran 1.13x and questions 0.84x plain. The tried alternative serves the requests' summed log latencies (the
geometric-mean speedup an evaluation reports): `plan_for_each_row` below.

Three engines on one loaded target — plain, k=auto with `plan_batch`, k=auto with the alternative (patched in for
that engine's steps only) — run the workload's tasks with --concurrency requests in flight (a finished one replaced
at once), their steps alternating so drift on a shared machine falls on all alike. A request's latency is the sum
of its engine's own steps while it was in flight. Prints, per round and group, the geometric mean of plain's latency
over each engine's (the E2E speedup), the engines' total seconds (throughput), and whether every output equals
plain's.

    python benchmarks/batch_plan.py [--model qwen2.5-coder-1.5b] [--drafter ngram] [--workload code]
                                    [--concurrency 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import deque

import specwise.engine.engine as engine_module
from specwise.engine import Engine, load_target
from specwise.engine.draft_length import CostModel
from specwise.engine.sampling import SamplingParams
from specwise.harness.workload import builtin_workload


def plan_for_each_row(rows: list[tuple[float, int, str | None]], plain: int, costs: CostModel) -> list[int] | None:
    """The tried plan: one more draft token on row i where its chance of acceptance over the row's expected tokens
    a pass (what it shortens that request's latency by) outweighs the rows × seconds it adds over the pass's seconds
    (what it lengthens every row's by) — the gradient of the requests' summed log latencies."""
    n = plain + len(rows)
    seconds = costs.pass_cost(n)
    if seconds is None:
        return None
    ks, expected, tokens = [0] * len(rows), [1.0] * len(rows), n
    longest: dict[str | None, int] = {}
    drafting: dict[str | None, int] = {}
    while True:
        grow = (costs.pass_cost(tokens + 1) or 0.0) - seconds
        best, best_value, best_step = None, 1e-9, (0.0, 0.0, 0, 0)
        for i, (alpha, k_own, drafter) in enumerate(rows):
            if ks[i] >= k_own:
                continue
            gain = min(alpha, 1.0) ** (ks[i] + 1)
            k_before, n_before = longest.get(drafter, 0), drafting.get(drafter, 0)
            k_after, n_after = max(k_before, ks[i] + 1), n_before + (ks[i] == 0)
            extra = grow + (costs.draft_cost(k_after, drafter, n_after) or 0.0)
            extra -= costs.draft_cost(k_before, drafter, n_before) or 0.0
            value = gain / expected[i] - n * extra / seconds
            if value > best_value:
                best, best_value, best_step = i, value, (gain, extra, k_after, n_after)
        if best is None:
            return ks
        gain, extra, k_after, n_after = best_step
        ks[best] += 1
        expected[best] += gain
        longest[rows[best][2]], drafting[rows[best][2]] = k_after, n_after
        tokens, seconds = tokens + 1, seconds + extra


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--workload", default="code", help="a built-in workload")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    tasks = builtin_workload(args.workload).tasks
    target = load_target(args.model)
    names = ["plain", "pass-rate plan", "per-row plan"]
    engines = [Engine(target, max_batch=args.concurrency)]
    engines += [Engine(target, drafter=args.drafter, k="auto", max_batch=args.concurrency) for _ in range(2)]
    landed = engine_module.plan_batch

    def run() -> tuple[list[dict[int, float]], list[float], list[dict[int, list[int]]]]:
        """Every task through every engine; per engine each task's latency, the total seconds and the outputs."""
        queues = [deque(enumerate(tasks)) for _ in engines]
        latency: list[dict[int, float]] = [{} for _ in engines]
        outputs: list[dict[int, list[int]]] = [{} for _ in engines]
        totals = [0.0] * len(engines)
        flying: list[dict[str, int]] = [{} for _ in engines]  # request id → task index
        while any(q or e.has_work for q, e in zip(queues, engines, strict=True)):
            for i, (queue, engine) in enumerate(zip(queues, engines, strict=True)):
                while queue and len(flying[i]) < args.concurrency:
                    j, task = queue.popleft()
                    params = SamplingParams(max_new_tokens=task.max_tokens, temperature=0.0)
                    flying[i][engine.submit(task.request, params)] = j
                    latency[i][j] = 0.0
                if not engine.has_work:
                    continue
                engine_module.plan_batch = plan_for_each_row if i == 2 else landed
                t0 = time.perf_counter()
                try:
                    events = engine.step()
                finally:
                    engine_module.plan_batch = landed
                dt = time.perf_counter() - t0
                totals[i] += dt
                for j in flying[i].values():
                    latency[i][j] += dt
                for event in events:
                    if event.result is not None:
                        j = flying[i].pop(event.request_id)
                        outputs[i][j] = list(event.result.token_ids)
        return latency, totals, outputs

    run()  # warm up: one-time costs, and each engine measures its pass and draft costs
    groups = sorted({g for t in tasks for g in t.groups})
    print(
        f"{target.identity.name}, {args.drafter} k=auto, the {args.workload} workload ({len(tasks)} tasks), "
        f"concurrency {args.concurrency}, greedy, steps interleaved; E2E speedup = geometric mean of plain's "
        "latency over the engine's, per group"
    )
    table: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        latency, totals, outputs = run()
        equal = all(outputs[i] == outputs[0] for i in (1, 2))
        cells = []
        for g in groups:
            mine = [j for j, t in enumerate(tasks) if g in t.groups]
            for i in (1, 2):
                s = math.exp(statistics.mean(math.log(latency[0][j] / latency[i][j]) for j in mine))
                table.setdefault((names[i], g), []).append(s)
                cells.append(f"{names[i]} {g} {s:.2f}x")
        for i in (1, 2):
            table.setdefault((names[i], "throughput"), []).append(totals[0] / totals[i])
        print(
            f"  round {r + 1}: " + ", ".join(cells) + f"; seconds plain {totals[0]:.1f}, pass-rate {totals[1]:.1f}, "
            f"per-row {totals[2]:.1f}; outputs equal plain's: {equal}"
        )
    print("  medians over the rounds:")
    for (name, what), values in table.items():
        print(f"    {name:>15} {what:>12}: {statistics.median(values):.2f}x ({', '.join(f'{v:.2f}' for v in values)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
