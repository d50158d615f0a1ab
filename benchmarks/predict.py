"""`specwise predict` against the evaluation it predicts, side by side in one run (issue 35's targets).

For each workload (the built-in release-notes, and benchmarks/data/edits.yaml, which no test and no built-in uses)
and drafter: `specwise evaluate` with the baseline and the drafter at each of --ks (default k=1, k=4 and adaptive
k), at concurrency 1 and 4 (the measurement), then `specwise predict --from-run` on that run for the same ks (the
prediction, costs measured on the first call and cached), and a predicted k sweep of 8 values. Over the cells with
n ≥ 4 it prints, for every k and for the fixed ks and k=auto apart:

- the mean absolute error of the predicted E2E speedup, as a share of the measured one (target ≤ 10%);
- the share of cells whose predicted 95% interval covers the measured point (target ≥ 80%);
- the share of cells whose outcome class (wins: lower bound > 1, loses: upper bound < 1, else no clear difference —
  what each verdict clause says of its cell) is the same predicted and measured (target ≥ 90%): the predicted class
  is the predicted verdict's, judged on the interval the evaluation is expected to report (its timing noise, not the
  model's error), and the class of the prediction interval itself is printed beside it;
- evaluate's wall time over predict's, for the same ks (target ≥ 10×) and for the 8-value sweep (target ≥ 30×; the
  sweep's evaluation is estimated as the measured one scaled by the number of configurations it would run), per
  workload: the targets are the built-in's, the unseen workload's are printed beside them.

    python benchmarks/predict.py [--drafters ngram,suffix,layerskip:20] [--ks 1,4,auto] [--tasks 24] [--max-tokens 64]
                                 [--repeats 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {"release-notes": "release-notes", "edits (unseen)": str(ROOT / "benchmarks" / "data" / "edits.yaml")}
SWEEP = "1,2,3,4,5,6,7,8"


def specwise(*args: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "specwise.cli", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"specwise {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0, proc.stdout


def _evaluate(workload: str, drafter: str, label: str, args: argparse.Namespace, out: Path) -> float:
    t_eval, _ = specwise(
        "evaluate", "--workload", workload, "--drafter", drafter, "--k", args.ks, "--tasks", str(args.tasks),
        "--max-tokens", str(args.max_tokens), "--concurrency", args.concurrency, "--out", str(out),
        "--no-progress", "--repeats", str(args.repeats),
    )  # fmt: skip
    return t_eval


def outcome(iv: dict) -> str:
    return "wins" if iv["lo"] > 1 else "loses" if iv["hi"] < 1 else "unclear"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", default="ngram,suffix,layerskip:20")
    ap.add_argument("--tasks", type=int, default=24, help="tasks per workload (the built-in has 24, edits 12)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ks", default="1,4,auto", help="the draft lengths evaluated and predicted")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="repeats per evaluation (2: the evaluation measures how far a phase shifts its requests together and "
        "its intervals carry it; predict reads that from the run it predicts)",
    )
    ap.add_argument(
        "--keep",
        metavar="DIR",
        help="keep the evaluations' runs in DIR, and reuse those already there (to iterate on the time model against "
        "fixed measurements; the evaluate/predict time ratios then compare with the first run's wall time)",
    )
    args = ap.parse_args()
    runs = 1 + len(args.ks.split(","))  # configurations an evaluation runs: the baseline and one per k
    cells, timing = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for label, workload in WORKLOADS.items():
            for drafter in args.drafters.split(","):
                out = Path(args.keep or tmp) / f"{len(timing)}"
                kept = out / "evaluate-seconds"
                if args.keep and kept.is_file():
                    t_eval = float(kept.read_text())
                else:
                    t_eval = _evaluate(workload, drafter, label, args, out)
                    kept.write_text(f"{t_eval}\n")
                db = str(out / "run.db")
                specwise("predict", "--from-run", db, "--drafter", drafter, "--k", SWEEP)  # measures the costs once
                pred = str(out / "p.json")
                t_pred, _ = specwise("predict", "--from-run", db, "--drafter", drafter, "--k", args.ks, "--json", pred)
                t_sweep, _ = specwise("predict", "--from-run", db, "--drafter", drafter, "--k", SWEEP)
                doc = json.loads((out / "p.json").read_text())
                timing.append((label, drafter, t_eval, t_pred, t_sweep))
                for c in doc["cells"]:
                    m = c["measured_e2e_speedup"]
                    if m is None or c["n"] < 4:
                        continue
                    p = c["predicted_e2e_speedup"]
                    cells.append(
                        {
                            "workload": label, "drafter": drafter, "k": c["k"], "load": c["load"],
                            "group": c["group"], "n": c["n"], "predicted": p, "measured": m,
                            "expected": c.get("expected_e2e_interval"),
                        }
                    )  # fmt: skip
                print(f"{label:>15} {drafter:>14}: evaluate {t_eval:6.1f} s, predict k={args.ks} {t_pred:5.1f} s "
                      f"({t_eval / t_pred:4.1f}x), predict 8 ks {t_sweep:5.1f} s "
                      f"({t_eval * 9 / runs / t_sweep:4.1f}x est.)", flush=True)  # fmt: skip
    print()
    print(f"{'workload':>15} {'drafter':>14} {'k':>4} {'load':>14} {'group':>12} {'n':>3} "
          f"{'predicted [95% CI]':>22} {'measured':>9} {'err':>6}")  # fmt: skip
    for c in cells:
        p, m = c["predicted"], c["measured"]
        c["err"] = abs(p["value"] - m["value"]) / m["value"]
        c["covered"] = p["lo"] <= m["value"] <= p["hi"]
        c["same"] = outcome(c["expected"] or p) == outcome(m)  # the predicted verdict's own interval
        c["same_pi"] = outcome(p) == outcome(m)  # … against classing the prediction interval itself
        interval = f"{p['value']:>8.2f}x [{p['lo']:.2f}–{p['hi']:.2f}]"
        print(f"{c['workload']:>15} {c['drafter']:>14} {c['k']:>4} {c['load']:>14} {c['group']:>12} {c['n']:>3} "
              f"{interval} {m['value']:>8.2f}x {100 * c['err']:>5.1f}%")  # fmt: skip
    if not cells:
        raise SystemExit("no cell with n ≥ 4 was measured: raise --tasks")
    kinds = {"every k": cells, "fixed k": [c for c in cells if c["k"] != "auto"]}
    kinds["k=auto"] = [c for c in cells if c["k"] == "auto"]
    for kind, mine in kinds.items():
        if not mine:
            continue
        errors = [c["err"] for c in mine]
        print()
        print(f"{kind}: cells with n ≥ 4: {len(mine)}")
        print(f"  mean absolute error of the predicted E2E speedup: {100 * statistics.mean(errors):.1f}% of the "
              f"measured (median {100 * statistics.median(errors):.1f}%; target ≤ 10%)")  # fmt: skip
        covered = 100 * sum(c["covered"] for c in mine) / len(mine)
        same = 100 * sum(c["same"] for c in mine) / len(mine)
        print(f"  predicted interval covers the measured point: {covered:.0f}% of cells (target ≥ 80%)")
        same_pi = 100 * sum(c["same_pi"] for c in mine) / len(mine)
        print(f"  same outcome class (wins / loses / unclear): {same:.0f}% of cells (target ≥ 90%; judged on the "
              f"prediction interval instead: {same_pi:.0f}%)")  # fmt: skip
    print()
    # The speed targets name the built-in workload; the unseen one (half the tasks, shorter outputs) is
    # printed beside it: predict's fixed cost (importing torch, loading the target: ~1.7 s) weighs more there.
    for which in ("release-notes", "edits (unseen)"):
        mine = [t for t in timing if t[0] == which]
        if not mine:
            continue
        ratios = [t_eval / t_pred for _, _, t_eval, t_pred, _ in mine]
        sweeps = [t_eval * 9 / runs / t_sweep for _, _, t_eval, _, t_sweep in mine]
        print(
            f"{which}: evaluate / predict, same ks: median {statistics.median(ratios):.1f}x (target ≥ 10x on the "
            f"built-in); 8-value sweep (evaluation estimated at 9/{runs} of the measured one): median "
            f"{statistics.median(sweeps):.1f}x (target ≥ 30x on the built-in)"
        )


if __name__ == "__main__":
    main()
