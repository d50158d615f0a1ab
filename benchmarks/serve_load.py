"""`specwise serve` under load: speculation off, on, and the `auto` policy, side by side at each concurrency.

Servers of the embedded model run at once on their own ports (idle ones cost nothing): `--policy never` and
`--policy always --drafter ngram`. A calibration round measures both at every level and sets the auto policy's
threshold as an evaluation would: the highest level up to which speculation won at every level. Then
`--policy auto --drafter ngram --policy-threshold T` starts, and in measured rounds whose order alternates (never,
always, auto / auto, always, never) the harness's HTTP client sends the same chat requests, closed loop, and takes
throughput (generated tokens / phase seconds) and E2E latency as a client sees them. Prints the ratios the targets
are about:

- baseline throughput at concurrency 8 over concurrency 1 (target ≥ 3×);
- auto over the better of on and off at every level (target ≥ 0.95).

`--workload chat` sends general conversation prompts instead (benchmarks/prompts.py CHAT), where n-gram drafts rarely
match: there the question is what speculation costs, at worst.

    python benchmarks/serve_load.py [--levels 1,2,4,8,16] [--max-tokens 48] [--rounds 1] [--threshold auto]
                                    [--workload summary|chat]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from specwise.harness.backends import Request
from specwise.harness.config import Config
from specwise.harness.http_backend import HTTPBackend
from specwise.harness.load import Load
from specwise.harness.workload import Task, builtin_workload
from specwise.speccounts import SpecCounts

sys.path.insert(0, os.path.dirname(__file__))
from prompts import CHAT

MODES = ("never", "always", "auto")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(mode: str, port: int, threshold: str, max_batch: int, log_dir: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "specwise.cli",
        "serve",
        "--port",
        str(port),
        "--served-model-name",
        "smollm2",
        "--max-batch",
        str(max_batch),
        "--max-queue",
        "256",
        "--policy",
        mode,
    ]
    if mode != "never":
        cmd += ["--drafter", "ngram", "--k", "auto"]
    if mode == "auto" and threshold == "never":
        cmd[cmd.index("auto")] = "never"
    elif mode == "auto":
        cmd += ["--policy-threshold", threshold]
    log = open(log_dir / f"serve-{mode}.log", "w")  # noqa: SIM115 - closed when the server stops
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(port: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server on port {port} did not become healthy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,2,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--threshold",
        default="calibrate",
        help="auto policy HIGH[:LOW], or 'calibrate' (default): from a calibration round of on and off",
    )
    ap.add_argument(
        "--requests", type=int, default=8, help="requests per phase at levels below 8 (default 8); 2 × the level above"
    )
    ap.add_argument(
        "--workload",
        default="summary",
        choices=["summary", "chat"],
        help="the built-in workload's summary tasks (default) or general chat prompts",
    )
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "specwise-serve-load"
    log_dir.mkdir(exist_ok=True)
    if args.workload == "chat":
        tasks = [
            Task(f"chat{i}", ("chat",), args.max_tokens, messages=({"role": "user", "content": p},))
            for i, p in enumerate(CHAT)
        ]
    else:
        tasks = [t for t in builtin_workload().tasks if "summary" in t.groups][: max(2 * max(levels), args.requests)]
    ports = {m: free_port() for m in MODES}
    procs = {m: start(m, ports[m], args.threshold, max(levels), log_dir) for m in MODES[:2]}
    try:
        for m in MODES[:2]:
            wait_healthy(ports[m])
        backends = {m: HTTPBackend(f"http://127.0.0.1:{ports[m]}", "smollm2", [Config(m)]) for m in MODES[:2]}
        for b in backends.values():
            b.warm_up()

        def phase(m: str, c: int, rnd: int, results: dict) -> None:
            n = max(args.requests, 2 * c)
            reqs = [
                Request(t.id, list(t.groups), rnd, i, t.request, args.max_tokens) for i, t in enumerate((tasks * 4)[:n])
            ]
            recs = []
            seconds = backends[m].run(m, Load("concurrent", c), reqs, recs.append).seconds
            errors = [r.error for r in recs if r.error]
            if errors:
                raise SystemExit(f"{m} @ {c}: {errors[0]}")
            tokens = sum(r.output_tokens for r in recs)
            results.setdefault((m, c), []).append(
                {
                    "throughput": tokens / seconds,
                    "e2e": [r.e2e for r in recs],
                    "spec": SpecCounts.pooled(r.spec or SpecCounts() for r in recs),
                }
            )
            print(f"round {rnd} c={c:<3} {m:<7} {tokens / seconds:7.1f} tok/s", file=sys.stderr, flush=True)

        if args.threshold == "calibrate":
            calib: dict = {}
            for c in levels:
                for m in MODES[:2]:
                    phase(m, c, -1, calib)
            wins = [calib[("always", c)][0]["throughput"] > calib[("never", c)][0]["throughput"] for c in levels]
            upto = next((i for i, w in enumerate(wins) if not w), len(levels))
            args.threshold = str(levels[upto - 1]) if upto else "never"  # never won: what a reject verdict gives
            print(f"calibrated auto threshold: {args.threshold}", file=sys.stderr)
        procs["auto"] = start("auto", ports["auto"], args.threshold, max(levels), log_dir)
        wait_healthy(ports["auto"])
        backends["auto"] = HTTPBackend(f"http://127.0.0.1:{ports['auto']}", "smollm2", [Config("auto")])
        backends["auto"].warm_up()
        results: dict[tuple[str, int], list[dict]] = {}
        flip = False
        for rnd in range(args.rounds):
            for c in levels:
                for m in MODES[::-1] if flip else MODES:
                    phase(m, c, rnd, results)
                flip = not flip
        report(levels, results, args)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(30)


def report(levels: list[int], results: dict, args) -> None:
    kind = "general chat" if args.workload == "chat" else "summary (copy-heavy) chat"
    print(
        f"\nspecwise serve, embedded SmolLM2-135M, {args.max_tokens} tokens per request, {kind} "
        f"requests, rounds={args.rounds}, auto threshold {args.threshold}"
    )
    print(
        f"{'conc':>4} | {'tok/s off':>9} {'on':>7} {'auto':>7} | {'p50 off':>7} {'on':>6} {'auto':>6} | "
        f"{'p99 off':>7} {'on':>6} {'auto':>6} | {'on/off':>6} {'auto/best':>9} | {'accept on':>9}"
    )
    for c in levels:
        tp = {m: statistics.median(r["throughput"] for r in results[(m, c)]) for m in MODES}
        e2e = {m: [x for r in results[(m, c)] for x in r["e2e"]] for m in MODES}
        p50 = {m: statistics.median(e2e[m]) for m in MODES}
        p99 = {m: sorted(e2e[m])[min(len(e2e[m]) - 1, int(0.99 * len(e2e[m])))] for m in MODES}
        on = results[("always", c)]
        acc = SpecCounts.pooled(r["spec"] for r in on).acceptance_rate or 0.0
        best = max(tp["never"], tp["always"])
        print(
            f"{c:>4} | {tp['never']:>9.1f} {tp['always']:>7.1f} {tp['auto']:>7.1f} | {p50['never']:>7.2f} "
            f"{p50['always']:>6.2f} {p50['auto']:>6.2f} | {p99['never']:>7.2f} {p99['always']:>6.2f} "
            f"{p99['auto']:>6.2f} | {tp['always'] / tp['never']:>6.2f} {tp['auto'] / best:>9.2f} | {acc:>9.2f}"
        )
    if 1 in levels and 8 in levels:
        base = {c: statistics.median(r["throughput"] for r in results[("never", c)]) for c in (1, 8)}
        print(f"\nbaseline throughput c=8 / c=1: {base[8] / base[1]:.2f}× (target ≥ 3×)")


if __name__ == "__main__":
    main()
