"""`specwise evaluate`: its flags; the run itself is harness/evaluate.py."""

from __future__ import annotations

import argparse
import os

from specwise.cli.common import k_list_arg, precision_flags
from specwise.models import MODEL_HELP
from specwise.specs import BUSY_SHARE, QUIET_MACHINE_MODES, QUIET_WAIT_S, VERIFY_HELP, VERIFY_METHODS


def add(sub: argparse._SubParsersAction) -> None:
    """This subcommand and its flags."""
    p = sub.add_parser("evaluate", help="measure baseline against speculative configurations and give a verdict")
    p.add_argument(
        "--workload",
        help="a YAML/JSONL workload file, or a built-in one: release-notes (default), spec-bench-like "
        "(six Spec-Bench-like categories), agent-like (tool calls answered with JSON) or code (Python edits that copy "
        "their input, and questions about the same code)",
    )
    p.add_argument(
        "--model",
        help=MODEL_HELP + "; with --endpoint, the served model's name",
    )
    p.add_argument("--config", help="YAML file with `configs: [{name, drafter, k}, …]` (the first is the baseline)")
    p.add_argument(
        "--drafter", action="append", help="a speculative configuration's drafter (repeatable; default ngram)"
    )
    p.add_argument(
        "--k",
        type=k_list_arg,
        default=["auto"],
        help="draft length(s) for --drafter configurations: one (default auto), or a sweep such as 1,2,4,8 (one "
        "configuration per drafter and k; `specwise export-config` turns the sweep into server settings)",
    )
    p.add_argument("--concurrency", default=None, help="closed-loop levels, e.g. 1,4 (default 1,4; --quick 1,2)")
    p.add_argument("--rate", default=None, help="open-loop Poisson arrival rates in requests/s, e.g. 0.5,1")
    p.add_argument(
        "--tasks", type=int, default=None, help="run a stratified subset of N tasks (default 12; --quick 4; 0 = all)"
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--verify",
        default=None,
        choices=VERIFY_METHODS,
        help=VERIFY_HELP + "; in-process engines only (a specwise server under --endpoint takes `serve --verify`)",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="cap every task's output limit")
    p.add_argument("--quick", action="store_true", help="a one-minute subset: 4 tasks, 48 tokens, concurrency 1,2")
    p.add_argument(
        "--out", default="specwise-run", help="output directory: run.db and report.html (default ./specwise-run)"
    )
    p.add_argument("--resume", action="store_true", help="continue the interrupted run in --out")
    p.add_argument(
        "--retry-errors",
        action="store_true",
        help="with --resume: also run again the requests whose record is an error (the new record replaces it)",
    )
    p.add_argument(
        "--remeasure-contended",
        action="store_true",
        help="with --resume: measure again the phases recorded on a busy machine (their records are replaced)",
    )
    p.add_argument(
        "--quiet-machine",
        choices=QUIET_MACHINE_MODES,
        default=QUIET_MACHINE_MODES[0],
        help="before each phase: ignore (record the background and flag contended cells; the default), wait (up "
        f"to {QUIET_WAIT_S:.0f} s) for the background to drop, or fail (exit 2) on a busy machine",
    )
    p.add_argument(
        "--busy-share",
        type=float,
        default=BUSY_SHARE,
        help=f"the share of the cores other processes may take before a phase counts as contended "
        f"(default {BUSY_SHARE:g})",
    )
    p.add_argument("--device", default="cpu")
    precision_flags(p)
    p.add_argument(
        "--endpoint",
        help="measure an OpenAI-compatible server at this URL instead of the in-process "
        "engine (e.g. http://127.0.0.1:8000)",
    )
    p.add_argument(
        "--launch",
        action="append",
        metavar="[NAME=]CMD",
        help="with --endpoint: the command that starts one configuration's server (repeat: baseline first); "
        "NAME= (lowercase) names the configuration, else baseline, speculative, speculative-2…",
    )
    p.add_argument(
        "--launch-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for a launched server's /health (default 600)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="with --endpoint: seconds one request may take to its last byte, after which it is that request's "
        "error (default: a generous bound from each task's max_tokens)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("SPECWISE_API_KEY"),
        help="bearer token for --endpoint (default $SPECWISE_API_KEY)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specwise.harness.evaluate import evaluate_from_args

    return evaluate_from_args(args)
