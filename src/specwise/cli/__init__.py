"""The `specwise` command line: one module per subcommand, each owning its flags. Engine subcommands import torch
lazily, so `--help` stays fast."""

from __future__ import annotations

import argparse
import sys

from specwise import __version__
from specwise.cli import (
    compare,
    evaluate,
    export,
    export_hf,
    generate,
    models,
    monitor,
    policy,
    predict,
    report,
    serve,
    train_draft,
)
from specwise.errors import SpecwiseError

SUBCOMMANDS = (
    generate,
    evaluate,
    predict,
    serve,
    policy,
    export,
    export_hf,
    train_draft,
    report,
    monitor,
    compare,
    models,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specwise",
        description="Serve speculative decoding, and measure whether it pays off for your workload.",
    )
    parser.add_argument("--version", action="version", version=f"specwise {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    for command in SUBCOMMANDS:
        command.add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecwiseError as exc:
        print(f"specwise: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specwise: interrupted", file=sys.stderr)
        return 130
