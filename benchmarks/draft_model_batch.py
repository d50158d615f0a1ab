"""A draft model in a batch: plain against the draft model at k=auto on the same loaded target, in one process.

The built-in `code` workload's tasks (or one --group of them) run with --concurrency requests in flight (a finished
one is replaced at once), the two engines' steps alternating. Prints each round's seconds per engine (its own
steps'), their ratio, where the draft model's time went — its catch-ups (feeding its cache a new prompt or the
output since it last drafted) against its drafted tokens — each group's per-request latency (its own engine's step
seconds from submission to its last token) against plain, and the costs the engine measured. What
`_hold_catch_ups` and `_fit_slowdown` are for: at concurrency 4 on two cores a drafted token rarely pays for itself,
and an edit's drafts slow the questions beside it (`--max-slowdown inf` turns that bound off).

    python benchmarks/draft_model_batch.py [--concurrency 4] [--group edit] [--rounds 2] [--max-slowdown inf]
                                           [--per-task]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque

from specwise.engine import Engine, load_target
from specwise.engine.sampling import SamplingParams
from specwise.harness.workload import builtin_workload


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="model:qwen2.5-coder-0.5b")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--group", default=None, help="only the tasks of this group (edit, question)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--per-task", action="store_true", help="print each task's latencies")
    ap.add_argument("--max-slowdown", type=float, default=None, help="the engine's bound (default: its own)")
    args = ap.parse_args()
    tasks = [t for t in builtin_workload("code").tasks if args.group is None or args.group in t.groups]
    target = load_target(args.model)
    plain = Engine(target, max_batch=args.concurrency)
    spec = Engine(target, drafter=args.drafter, k="auto", max_batch=args.concurrency)
    if args.max_slowdown is not None:
        spec.max_slowdown = args.max_slowdown
    drafter = spec.drafter
    spent = {"drafting": 0.0, "catch-up": 0.0, "caught up": 0.0, "calls": 0.0}
    propose = drafter.propose

    def timed(seqs, ks):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = propose(seqs, ks)
        spent["drafting"] += time.perf_counter() - t0
        spent["catch-up"] += getattr(drafter, "one_off_seconds", 0.0)
        spent["caught up"] += getattr(drafter, "one_off_tokens", 0)
        spent["calls"] += 1
        return out

    drafter.propose = timed  # type: ignore[method-assign]

    def run(engines: list[Engine], latency: list[dict[tuple[str, str], list[float]]] | None = None) -> list[float]:
        """The tasks through each engine with --concurrency in flight, the engines' steps alternating (so drift on a
        shared machine falls on both alike); each engine's seconds are its own steps'. A request's latency is its own
        engine's step seconds from its submission to its last token, kept per group in `latency` (one per engine)."""
        queues = [deque(tasks) for _ in engines]
        seconds = [0.0] * len(engines)
        inflight: list[dict[str, tuple[tuple[str, str], float]]] = [{} for _ in engines]  # id → ((group, task), s)
        while any(q or e.has_work for q, e in zip(queues, engines, strict=True)):
            for i, (queue, engine) in enumerate(zip(queues, engines, strict=True)):
                while queue and len(engine.waiting) + len(engine.running) < args.concurrency:
                    task = queue.popleft()
                    rid = engine.submit(task.request, SamplingParams(max_new_tokens=task.max_tokens, temperature=0.0))
                    inflight[i][rid] = ((task.groups[0], task.id), 0.0)
                if engine.has_work:
                    t0 = time.perf_counter()
                    events = engine.step()
                    spent_now = time.perf_counter() - t0
                    seconds[i] += spent_now
                    for rid, (key, so_far) in inflight[i].items():
                        inflight[i][rid] = (key, so_far + spent_now)
                    for ev in events:
                        if ev.finished and ev.request_id in inflight[i]:
                            key, so_far = inflight[i].pop(ev.request_id)
                            if latency is not None:
                                latency[i].setdefault(key, []).append(so_far)
        return seconds

    run([plain, spec])  # warm up: the first run pays one-time costs and measures the engine's costs
    print(
        f"{target.identity.name} + {args.drafter}, {len(tasks)} code tasks ({args.group or 'every group'}), "
        f"concurrency {args.concurrency}, greedy, steps interleaved"
    )
    ratios = []
    latency: list[dict[tuple[str, str], list[float]]] = [{}, {}]
    for r in range(args.rounds):
        for key in spent:
            spent[key] = 0.0
        base, drafted = run([plain, spec], latency)
        ratios.append(base / drafted)
        print(
            f"  round {r + 1}: plain {base:6.2f} s, draft model {drafted:6.2f} s: {base / drafted:5.2f}x; the draft "
            f"{spent['drafting']:.2f} s in {spent['calls']:.0f} steps, of which catch-ups {spent['catch-up']:.2f} s "
            f"over {spent['caught up']:.0f} tokens"
        )
    print(f"  median speedup {statistics.median(ratios):.2f}x")
    for group in sorted({g for g, _ in latency[0]}):
        keys = [key for key in latency[0] if key[0] == group]
        b = [x for key in keys for x in latency[0][key]]
        d = [x for key in keys for x in latency[1][key]]  # the same tasks, round by round
        per = [x / y for x, y in zip(b, d, strict=True)]
        print(
            f"  {group}: {len(b)} requests, latency plain {sum(b):.2f} s, draft model {sum(d):.2f} s "
            f"({sum(b) / sum(d):.2f}x); per request mean {statistics.mean(per):.3f}x, median "
            f"{statistics.median(per):.3f}x, worst {min(per):.3f}x"
        )
    if args.per_task:
        for key in latency[0]:
            pairs = ", ".join(f"{b:.2f}/{d:.2f}" for b, d in zip(latency[0][key], latency[1][key], strict=True))
            print(f"    {key[1]:22s} plain/draft model s: {pairs}")
    costs = spec.costs
    print("  measured pass costs (ms by tokens):", {t: round(s * 1000, 1) for t, s in sorted(costs.passes.items())})
    print(
        "  a drafted token (ms), one row drafting:",
        {d: round(s * 1000, 2) for d, s in costs.draft_per_token.items()},
        "several:",
        {d: round(s * 1000, 2) for d, s in costs.draft_per_token_shared.items()},
        "catching up a token (ms):",
        {d: round(s * 1000, 2) for d, s in costs.catch_up_per_token.items()},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
