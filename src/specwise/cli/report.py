"""`specwise report`: a run's console summary and its HTML, JSON and CSV reports."""

from __future__ import annotations

import argparse
from pathlib import Path

from specwise.cli.common import write_file


def add(sub: argparse._SubParsersAction) -> None:
    """This subcommand and its flags."""
    p = sub.add_parser("report", help="console summary and HTML/JSON/CSV report of a run")
    p.add_argument("db", help="a run's results file (run.db)")
    p.add_argument("--html", help="write the HTML report here (default: report.html beside the results file)")
    p.add_argument("--json", dest="json_path", help="also export everything as JSON to this path")
    p.add_argument("--csv", dest="csv_path", help="also export one row per request as CSV to this path")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    from specwise.harness.analyze import load_run
    from specwise.harness.report import console_summary, html_report, to_csv, to_json

    run = load_run(args.db)
    print(console_summary(run))
    html = Path(args.html) if args.html else Path(args.db).with_name("report.html")
    write_file(html, html_report(run))
    print(f"\nreport: {html}")
    if args.json_path:
        write_file(Path(args.json_path), to_json(run))
    if args.csv_path:
        write_file(Path(args.csv_path), to_csv(run))
    return 0
