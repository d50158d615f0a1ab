"""The `specwise` command line: one module per subcommand, each owning its flags. Engine subcommands import torch
lazily, so `--help` stays fast."""

from __future__ import annotations

import argparse
import difflib
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


def unexpected(parser: argparse.ArgumentParser, command: str, extras: list[str]) -> str:
    """What argparse's "unrecognized arguments" leaves unsaid: which flags the subcommand does not have, the one it
    probably meant (evaluate's --max-tokens typed to another command, an underscore for a dash), and where its
    options are listed. Words after an unknown flag are its value as often as not: named only when no flag is."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options = sorted(o for a in sub.choices[command]._actions for o in a.option_strings if o.startswith("--"))
    flags = [w.split("=", 1)[0] for w in extras if w.startswith("-")]
    said = []
    for flag in flags:
        close = difflib.get_close_matches(flag.replace("_", "-"), options, n=2, cutoff=0.75)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        said.append(f"{flag} is not an option of `specwise {command}`{hint}")
    if not flags:
        words = " ".join(repr(w) for w in extras)
        said.append(f"`specwise {command}` does not take {words} (a value with spaces needs quotes)")
    return f"specwise {command}: error: " + "; ".join(said) + f"; its options: `specwise {command} --help`\n"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        parser.exit(2, unexpected(parser, args.command, extras))
    try:
        return args.func(args)
    except SpecwiseError as exc:
        print(f"specwise: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specwise: interrupted", file=sys.stderr)
        return 130
