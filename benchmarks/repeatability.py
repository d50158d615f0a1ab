"""Does an evaluation agree with itself? The same `specwise evaluate` run several times in a row, and for every cell
(configuration × load × group) its E2E speedups and intervals side by side: the spread of the runs' point estimates
(standard deviation of log speedups) against the spread the intervals claim (their median half-width in log terms ÷
1.96), how many pairs of runs have disjoint intervals, and the outcome classes (wins: lower bound > 1, loses: upper
bound < 1, else unclear). A ratio near 1 means the intervals are honest on this machine; well above 1, a cell's class
can change from one identical run to the next. With two or more repeats the intervals carry how far a phase shifts
its requests together (docs/harness.md, "Phases in the intervals"), and the ratio should sit near 1.

    python benchmarks/repeatability.py [--runs 6] [--workload benchmarks/data/edits.yaml] [--drafter ngram]
                                       [--k auto] [--concurrency 1,4] [--repeats 2] [--max-tokens 64] [--keep DIR]
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specwise.harness.analyze import load_run

ROOT = Path(__file__).resolve().parents[1]


def outcome(lo: float, hi: float) -> str:
    return "wins" if lo > 1 else "loses" if hi < 1 else "unclear"


def cells_of(out: Path, cells: dict[tuple[str, str, str], list[tuple[float, float, float]]]) -> None:
    for c in load_run(out / "run.db").analysis.comparisons:
        iv = c.e2e_speedup
        cells.setdefault((c.config, c.load, c.group), []).append((iv.value, iv.lo, iv.hi))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--workload", default=str(ROOT / "benchmarks" / "data" / "edits.yaml"))
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--k", default="auto")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--repeats", default="2")
    ap.add_argument("--max-tokens", default="64")
    ap.add_argument(
        "--keep",
        metavar="DIR",
        help="keep each run's directory in DIR, and analyse again those already there (to iterate on the analysis "
        "against fixed measurements)",
    )
    args = ap.parse_args()
    if args.runs < 2:
        raise SystemExit("--runs must be at least 2: one run cannot disagree with itself")
    cells: dict[tuple[str, str, str], list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            out = Path(args.keep or tmp) / f"run{i}"
            t0 = time.perf_counter()
            if args.keep and (out / "run.db").is_file():  # kept from an earlier call: analysed again, not re-run
                cells_of(out, cells)
                continue
            argv = [
                sys.executable, "-m", "specwise.cli", "evaluate", "--workload", args.workload,
                "--drafter", args.drafter, "--k", args.k, "--concurrency", args.concurrency, "--repeats", args.repeats,
                "--max-tokens", args.max_tokens, "--out", str(out), "--no-progress",
            ]  # fmt: skip
            proc = subprocess.run(argv, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"evaluate failed:\n{proc.stderr[-3000:]}")
            cells_of(out, cells)
            print(f"run {i + 1}/{args.runs}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"\n{'configuration':>14} {'load':>14} {'group':>11}  runs: E2E speedup [95% CI]")
    ratios = []
    for (config, load, group), runs in cells.items():
        logs = [math.log(v) for v, _, _ in runs]
        spread = statistics.stdev(logs) if len(logs) > 1 else 0.0
        claimed = statistics.median((math.log(hi) - math.log(lo)) / 2 / 1.96 for _, lo, hi in runs)
        disjoint = sum(a[2] < b[1] or b[2] < a[1] for a, b in itertools.combinations(runs, 2))
        pairs = len(runs) * (len(runs) - 1) // 2
        classes = [outcome(lo, hi) for _, lo, hi in runs]
        tally = ", ".join(f"{n} {cls}" for cls, n in sorted({c: classes.count(c) for c in classes}.items()))
        ratio = spread / claimed if claimed > 0 else math.inf
        ratios.append(ratio)
        shown = ", ".join(f"{v:.2f} [{lo:.2f}–{hi:.2f}]" for v, lo, hi in runs)
        print(f"{config:>14} {load:>14} {group:>11}  {shown}")
        print(
            f"{'':>41}  spread of the runs {spread:.3f} against {claimed:.3f} claimed ({ratio:.1f}x); "
            f"{disjoint} of {pairs} pairs of runs disjoint; classes: {tally}"
        )
    print(f"\nmedian over cells of spread ÷ claimed: {statistics.median(ratios):.1f}x (honest intervals: about 1)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
