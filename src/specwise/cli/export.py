"""`specwise export-config`: a k sweep's choice as a server's settings."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specwise.cli.common import write_file
from specwise.specs import EXPORT_FORMATS


def add(sub: argparse._SubParsersAction) -> None:
    """This subcommand and its flags."""
    p = sub.add_parser("export-config", help="the draft lengths a k sweep chose, as a server's settings")
    p.add_argument("db", help="a run's results file (run.db) with a k sweep (evaluate --k 1,2,4,8)")
    p.add_argument(
        "--format", required=True, choices=EXPORT_FORMATS, help="what to write: " + ", ".join(EXPORT_FORMATS)
    )
    p.add_argument("--drafter", help="which swept drafter (when the run swept several)")
    p.add_argument("--out", help="write it to this file (default: standard output)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specwise.harness.analyze import load_run
    from specwise.harness.export import export_config

    text, notes = export_config(load_run(args.db), args.format, args.drafter)
    if args.out:
        write_file(Path(args.out), text + "\n")
    else:
        print(text)
    for note in notes:
        print(f"# {note}", file=sys.stderr)
    return 0
