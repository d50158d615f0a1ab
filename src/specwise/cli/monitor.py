"""`specwise monitor`: live traffic against the evaluation that justified speculation."""

from __future__ import annotations

import argparse
import sys
import time

from specwise.errors import SpecwiseError


def add(sub: argparse._SubParsersAction) -> None:
    """This subcommand and its flags."""
    p = sub.add_parser(
        "monitor",
        help="compare live traffic (the server's request log) with the evaluation run "
        "that justified speculation; exit 1 on drift",
    )
    p.add_argument("--baseline", required=True, help="the evaluation run (run.db)")
    p.add_argument("--log", required=True, help="the request log written by `specwise serve --log`")
    p.add_argument("--window", default="1h", help="recent window to judge: 30m, 1h, 2d, … or 'all' (default 1h)")
    p.add_argument(
        "--alpha", type=float, default=0.01, help="false-alarm level of the distribution tests (default 0.01)"
    )
    p.add_argument(
        "--predict",
        action="store_true",
        help="replay the window's plainly decoded requests (served with --log-text) through the evaluated drafter: "
        "their acceptance joins the tests and the speedup the traffic predicts is set beside the evaluation's "
        "(loads the target; pass costs measured once per machine)",
    )
    p.add_argument("--watch", action="store_true", help="refresh the table in the terminal until interrupted")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between refreshes with --watch")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    from specwise.monitor.drift import check, status

    if args.interval <= 0:
        raise SpecwiseError(f"--interval {args.interval} is not allowed: give seconds > 0")
    if args.predict and args.watch:
        raise SpecwiseError("--predict and --watch: a prediction loads the model and replays the window; run it alone")
    replay = None
    if args.predict:
        from specwise.cli.monitor_predict import predict_window

        replay = predict_window
    rows, table = check(args.baseline, args.log, args.window, args.alpha, replay=replay)
    if not args.watch:
        print(table)
        return status(rows)
    while True:  # until Ctrl-C (exit 130)
        sys.stdout.write("\x1b[H\x1b[2J" + time.strftime("%Y-%m-%d %H:%M:%S  ") + table + "\n")
        sys.stdout.flush()
        time.sleep(args.interval)
        try:
            rows, table = check(args.baseline, args.log, args.window, args.alpha)
        except SpecwiseError as exc:  # e.g. the window emptied: say so and keep watching
            table = f"(no comparison: {exc})"
