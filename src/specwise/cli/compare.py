"""`specwise compare`: two runs side by side."""

from __future__ import annotations

import argparse


def add(sub: argparse._SubParsersAction) -> None:
    """This subcommand and its flags."""
    p = sub.add_parser("compare", help="set two runs side by side; flag revisions that differ")
    p.add_argument("a")
    p.add_argument("b")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specwise.harness.analyze import load_run
    from specwise.harness.compare import compare_runs

    text, flagged = compare_runs(load_run(args.a), load_run(args.b))
    print(text)
    return 1 if flagged else 0
