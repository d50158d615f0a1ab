"""`specwise evaluate`: its flags, checked before anything loads, and the plan and system under test they describe;
measuring, judging and reporting are harness/evaluate.py's.

With no arguments it runs the built-in release-note workload (a stratified subset of 12 tasks) on the embedded
model, baseline against n-gram drafting with adaptive k, at concurrency 1 and 4, twice (the second repeat measures
how far a phase shifts its requests together, docs/harness.md), and prints the verdict. `--quick` is a one-minute
subset."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from specwise.cli.common import k_list_arg, precision_flags, target_options
from specwise.errors import SpecwiseError
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
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="times every task runs per configuration and load (default 2: the second measures how far a phase "
        "shifts its requests together, which the intervals then carry; --quick 1)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--verify",
        default=None,
        choices=VERIFY_METHODS,
        help=VERIFY_HELP + "; in-process engines only (a specwise server under --endpoint takes `serve --verify`)",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="cap every task's output limit")
    p.add_argument(
        "--quick", action="store_true", help="a one-minute subset: 4 tasks, 48 tokens, concurrency 1,2, one repeat"
    )
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
    p.add_argument(
        "--predict-first",
        action="store_true",
        help="measure the baseline first (kept in OUT/predict-baseline), predict every fixed-k configuration from its "
        "outputs (as `specwise predict`), and run only those not predicted to lose in every cell; the report sets "
        "what was predicted beside what was measured",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def predict_first(workload, loads, configs, target, cap, out: Path, progress: bool):
    """--predict-first: the baseline measured once into OUT/predict-baseline, each configuration predicted from its
    outputs (every k of a drafter from one replay; k=auto as the engine would choose it on this machine's costs),
    and the configurations predicted to lose in every cell named for skipping; those without a prediction (a sampled
    run's model drafters) are run as asked."""
    from specwise.cli.predict import BaselineSpec, PredictSetup, check_predictable, measure_baseline, predict
    from specwise.harness.predict import config_name
    from specwise.harness.results import PredictedCell, PredictFirst

    by_drafter: dict[str, list] = {}
    unpredicted: dict[str, str] = {}
    for c in configs[1:]:
        try:
            check_predictable(c.drafter, [c.k], False)
            by_drafter.setdefault(c.drafter, []).append(c)
        except SpecwiseError as exc:
            unpredicted[c.name] = str(exc).split(": ", 1)[-1]
    baseline = measure_baseline(BaselineSpec(workload, loads, target, cap), out / "predict-baseline", progress)
    setup = PredictSetup(target.model, target.dtype, target.quantize, target.activations)
    cells: list[PredictedCell] = []
    for drafter, group in by_drafter.items():
        p = predict(baseline, drafter, list(dict.fromkeys(c.k for c in group)), setup)
        for c in group:
            name = config_name(p.drafter, c.k)
            cells += [
                PredictedCell(c.name, x.load, x.group, x.n, x.e2e_speedup.value, x.e2e_speedup.lo, x.e2e_speedup.hi)
                for x in p.predicted.analysed.comparisons
                if x.config == name
            ]
    skipped = []
    for c in configs[1:]:
        mine = [x for x in cells if x.config == c.name]
        verdict = "not predicted: " + unpredicted[c.name] + "; run" if c.name in unpredicted else "run"
        if mine and all(x.loses() for x in mine):
            skipped.append(c.name)
            verdict = "predicted to lose in every cell: not run"
        shown = ", ".join(f"{x.group}@{x.load.split('@')[-1]} {x.value:.2f}x [{x.lo:.2f}–{x.hi:.2f}]" for x in mine)
        print(f"predict-first: {c.name}: {verdict}" + (f" ({shown})" if shown else ""), file=sys.stderr)
    return PredictFirst(str(baseline), cells, skipped, unpredicted)


def run(args: argparse.Namespace) -> int:
    """Check every flag before the model loads or anything is measured, build the plan and the system under test,
    then measure, judge and report (harness/evaluate.py)."""
    from specwise.harness.backends import Backend
    from specwise.harness.engine_backend import EngineBackend
    from specwise.harness.evaluate import (
        check_output_dir,
        configs_from,
        engine_batch,
        evaluate,
        stratified,
        workload_from,
    )
    from specwise.harness.http_backend import EndpointOptions, HTTPBackend
    from specwise.harness.load import loads_from_flags
    from specwise.harness.runner import Plan, RunOptions, check_store
    from specwise.harness.store import Store

    if args.launch and not args.endpoint:
        raise SpecwiseError("--launch needs --endpoint: the URL where the launched server will listen")
    if args.retry_errors and not args.resume:
        raise SpecwiseError("--retry-errors needs --resume: it re-runs the failed requests of the run in --out")
    if args.remeasure_contended and not args.resume:
        raise SpecwiseError("--remeasure-contended needs --resume: it re-runs the busy phases of the run in --out")
    options = RunOptions(
        resume=args.resume,
        show_progress=not args.no_progress,
        retry_errors=args.retry_errors,
        quiet=args.quiet_machine,
        busy_share=args.busy_share,
        remeasure_contended=args.remeasure_contended,
    )
    other_precision = args.dtype != "auto" or args.quantize or args.activations != "auto"
    if args.endpoint and other_precision:
        raise SpecwiseError(
            "--dtype, --quantize and --activations set the in-process engine's precision; with --endpoint the server "
            "decides it (put them in the command you --launch)"
        )
    n_tasks = args.tasks if args.tasks is not None else (4 if args.quick else 12)
    if n_tasks < 0:
        raise SpecwiseError(f"--tasks {n_tasks} is not allowed: give 0 (all) or a positive number")
    workload = stratified(workload_from(args.workload), n_tasks)
    loads = loads_from_flags(args.concurrency or ("1,2" if args.quick else ("" if args.rate else "1,4")), args.rate)
    configs = configs_from(args.config, args.drafter, args.k, args.launch, bool(args.endpoint))
    cap = args.max_tokens or (48 if args.quick else None)
    if cap is not None and cap < 1:
        raise SpecwiseError(f"--max-tokens {cap} is not allowed: it must be ≥ 1")
    if args.temperature < 0:
        raise SpecwiseError(f"--temperature {args.temperature} is not allowed: it must be ≥ 0")
    if args.endpoint and args.verify:
        raise SpecwiseError(
            "--verify chooses how in-process engines verify sampled drafts; a server under --endpoint verifies as it "
            "was started (specwise: `serve --verify`, in the --launch command), and the audit reads what it reports"
        )
    verify = args.verify or VERIFY_METHODS[0]
    engine_target = target_options(args)
    target = args.model
    if not args.endpoint and other_precision:  # another precision is another target
        target = " ".join(filter(None, [args.model, engine_target.precision_flags()]))
    if args.endpoint:
        target = f"{args.endpoint} {args.model or ''}".strip()
    out = Path(args.out)
    check_output_dir(out)
    first = None
    if args.predict_first:
        if args.endpoint:
            raise SpecwiseError(
                "--predict-first replays drafters over the in-process engine's own output tokens: not with --endpoint"
            )
        if args.temperature > 0:
            raise SpecwiseError("--predict-first predicts greedy runs (temperature 0): drop --temperature or it")
        first = predict_first(workload, loads, configs, engine_target, cap, out, not args.no_progress)
        kept = [c for c in configs if c.name not in first.skipped]
        if len(kept) == 1:
            print(
                "every speculative configuration is predicted to lose in every cell: nothing left to measure "
                f"(the baseline and its outputs: {first.baseline})"
            )
            return 0
        configs = kept
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 2)
    plan = Plan(workload, configs, loads, repeats, args.seed, args.temperature, target, cap, verify)
    store = Store(out / "run.db")
    check_store(plan, store, args.resume)  # before the model loads
    if first is not None:
        store.set_meta("predict_first", first.to_json())
    print(
        f"specwise evaluate: {len(workload.tasks)} tasks × {len(configs)} configurations × "
        f"{', '.join(ld.name for ld in loads)} × {plan.repeats} repeat(s) → {out / 'run.db'}",
        file=sys.stderr,
    )
    backend: Backend
    if args.endpoint:
        endpoint_options = EndpointOptions(
            api_key=args.api_key,
            temperature=args.temperature,
            launch_timeout=args.launch_timeout,
            request_timeout=args.request_timeout,
            log_dir=out,
        )
        backend = HTTPBackend(args.endpoint, args.model, configs, endpoint_options)
    else:
        backend = EngineBackend(
            engine_target, configs, max_batch=engine_batch(loads), temperature=args.temperature, verify=verify
        )
    return evaluate(plan, store, backend, out, options)
