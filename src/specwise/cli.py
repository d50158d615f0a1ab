"""The `specwise` command line. Engine subcommands import torch lazily, so `--help` stays fast."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from specwise import __version__
from specwise.errors import SpecwiseError

if TYPE_CHECKING:
    from specwise.engine import GenerationResult
from specwise.specs import (
    ACTIVATIONS,
    DEFAULT_MAX_LEN,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PREFILL_CHUNK,
    DRAFTER_HELP,
    DTYPES,
    EXPORT_FORMATS,
    K_MAX,
    QUANTIZE,
    VERIFY_HELP,
    VERIFY_METHODS,
    parse_k,
)

DTYPE_HELP = (
    "weights' precision on the CPU kernels: auto (default: a GGUF's own quantised types, bf16 for "
    "Hugging Face weights), bfloat16, float32 (the reference); float16 on CUDA only"
)
QUANTIZE_HELP = "quantise Hugging Face weights per group of 32: int4 or int8 (a different target, with its own hash)"
ACTIVATIONS_HELP = (
    "what the CPU kernels' 4- and 8-bit layers multiply: auto (default: int8, integer dot products as llama.cpp's, "
    "the fastest), int8, or float32 (exact to the weights, several times slower; a different target)"
)


def _precision_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--quantize", default=None, choices=QUANTIZE, help=QUANTIZE_HELP)
    p.add_argument("--activations", default="auto", choices=ACTIVATIONS, help=ACTIVATIONS_HELP)


def _k(value: str) -> int | str:
    try:
        return parse_k(value)
    except SpecwiseError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _k_list(value: str) -> list[int | str]:
    ks = [_k(v.strip()) for v in value.split(",")]
    if len(set(ks)) != len(ks):
        raise argparse.ArgumentTypeError(f"{value!r} repeats a draft length: give each once")
    return ks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specwise", description=__doc__)
    parser.add_argument("--version", action="version", version=f"specwise {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text, speculatively or not, and show what speculation did")
    gen.add_argument("prompt", help="the prompt (sent as a user chat message unless --raw)")
    gen.add_argument("--model", help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--drafter", help=f"{DRAFTER_HELP} (default: none = baseline)")
    gen.add_argument("--k", type=_k, default=4, help=f"draft length 1..{K_MAX}, or 'auto' (adaptive); default 4")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--verify", default=VERIFY_METHODS[0], choices=VERIFY_METHODS, help=VERIFY_HELP)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    gen.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    _precision_flags(gen)
    gen.add_argument("--stats", action="store_true", help="print the request's statistics after the text")
    gen.add_argument("--json", action="store_true", help="print the whole result as JSON instead of streaming")
    gen.set_defaults(func=cmd_generate)

    ev = sub.add_parser("evaluate", help="measure baseline against speculative configurations and give a verdict")
    ev.add_argument(
        "--workload",
        help="a YAML/JSONL workload file, or a built-in one: release-notes (default), spec-bench-like "
        "(six Spec-Bench-like categories) or agent-like (tool calls answered with JSON)",
    )
    ev.add_argument(
        "--model",
        help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct); "
        "with --endpoint, the served model's name",
    )
    ev.add_argument("--config", help="YAML file with `configs: [{name, drafter, k}, …]` (the first is the baseline)")
    ev.add_argument(
        "--drafter", action="append", help="a speculative configuration's drafter (repeatable; default ngram)"
    )
    ev.add_argument(
        "--k",
        type=_k_list,
        default=["auto"],
        help="draft length(s) for --drafter configurations: one (default auto), or a sweep such as 1,2,4,8 (one "
        "configuration per drafter and k; `specwise export-config` turns the sweep into server settings)",
    )
    ev.add_argument("--concurrency", default=None, help="closed-loop levels, e.g. 1,4 (default 1,4; --quick 1,2)")
    ev.add_argument("--rate", default=None, help="open-loop Poisson arrival rates in requests/s, e.g. 0.5,1")
    ev.add_argument(
        "--tasks", type=int, default=None, help="run a stratified subset of N tasks (default 12; --quick 4; 0 = all)"
    )
    ev.add_argument("--repeats", type=int, default=1)
    ev.add_argument("--temperature", type=float, default=0.0)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument(
        "--verify",
        default=None,
        choices=VERIFY_METHODS,
        help=VERIFY_HELP + "; in-process engines only (a specwise server under --endpoint takes `serve --verify`)",
    )
    ev.add_argument("--max-tokens", type=int, default=None, help="cap every task's output limit")
    ev.add_argument("--quick", action="store_true", help="a one-minute subset: 4 tasks, 48 tokens, concurrency 1,2")
    ev.add_argument(
        "--out", default="specwise-run", help="output directory: run.db and report.html (default ./specwise-run)"
    )
    ev.add_argument("--resume", action="store_true", help="continue the interrupted run in --out")
    ev.add_argument(
        "--retry-errors",
        action="store_true",
        help="with --resume: also run again the requests whose record is an error (the new record replaces it)",
    )
    ev.add_argument("--device", default="cpu")
    _precision_flags(ev)
    ev.add_argument(
        "--endpoint",
        help="measure an OpenAI-compatible server at this URL instead of the in-process "
        "engine (e.g. http://127.0.0.1:8000)",
    )
    ev.add_argument(
        "--launch",
        action="append",
        metavar="[NAME=]CMD",
        help="with --endpoint: the command that starts one configuration's server (repeat: baseline first); "
        "NAME= (lowercase) names the configuration, else baseline, speculative, speculative-2…",
    )
    ev.add_argument(
        "--launch-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for a launched server's /health (default 600)",
    )
    ev.add_argument(
        "--api-key",
        default=os.environ.get("SPECWISE_API_KEY"),
        help="bearer token for --endpoint (default $SPECWISE_API_KEY)",
    )
    ev.add_argument("--no-progress", action="store_true")
    ev.set_defaults(func=cmd_evaluate)

    srv = sub.add_parser("serve", help="OpenAI-compatible server: continuous batching, load-aware speculation")
    srv.add_argument("--model", help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    srv.add_argument("--served-model-name", help="the name clients send as `model` (default: the model's name)")
    srv.add_argument("--drafter", help=f"default drafter: {DRAFTER_HELP} (default: none)")
    srv.add_argument("--drafters", help="more drafters requests may choose, comma-separated (e.g. int8,ngram:2)")
    srv.add_argument("--k", type=_k, default="auto", help=f"default draft length 1..{K_MAX} or 'auto' (default auto)")
    srv.add_argument(
        "--policy",
        default="always",
        choices=["always", "never", "auto"],
        help="when steps draft: always, never, or auto (off under load; default always)",
    )
    srv.add_argument(
        "--policy-threshold",
        default="4",
        help="auto: HIGH[:LOW] — drafting stops above HIGH running+waiting requests, resumes at LOW (default 4:2)",
    )
    srv.add_argument(
        "--policy-from",
        help="take the policy from an evaluation run (run.db: the auto threshold) or from a policy file (.json, "
        "from `specwise export-config --format specwise`: a k per load)",
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--api-key",
        action="append",
        help="require 'Authorization: Bearer KEY' on /v1 routes and the API docs (repeat for several clients' keys; "
        "default $SPECWISE_API_KEY, comma-separated keys — out of `ps`)",
    )
    srv.add_argument(
        "--suffix-history",
        default="per-key",
        choices=["per-key", "shared", "off"],
        help="whose earlier outputs suffix drafts may come from: per-key (requests of the same API key; default — "
        "with no --api-key that is every client), shared (all clients: a client could probe another's outputs "
        "through the acceptance it is told), or off",
    )
    srv.add_argument(
        "--admin-key",
        default=os.environ.get("SPECWISE_ADMIN_KEY"),
        help="enable the admin API (GET/PUT /admin/policy: change the policy at run time) with this key of its own "
        "(default $SPECWISE_ADMIN_KEY; off when unset)",
    )
    srv.add_argument("--verify", default=VERIFY_METHODS[0], choices=VERIFY_METHODS, help=VERIFY_HELP)
    srv.add_argument("--max-batch", type=int, default=8, help="requests in the running batch (default 8)")
    srv.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help=f"requests waiting beyond the batch before 429s (default {DEFAULT_MAX_QUEUE})",
    )
    srv.add_argument(
        "--max-len", type=int, default=DEFAULT_MAX_LEN, help=f"context length in tokens (default {DEFAULT_MAX_LEN})"
    )
    srv.add_argument(
        "--prefill-chunk",
        type=int,
        default=DEFAULT_PREFILL_CHUNK,
        help=f"prompt tokens a step takes while other requests decode (default {DEFAULT_PREFILL_CHUNK}): smaller keeps "
        "streams smoother when requests arrive, larger gives a lower time to first token",
    )
    srv.add_argument("--max-body", type=int, default=1 << 20, help="largest request body in bytes (default 1 MiB)")
    srv.add_argument("--device", default="cpu")
    _precision_flags(srv)
    srv.add_argument("--log", help="append one record per finished request to this SQLite request log")
    srv.add_argument("--log-text", action="store_true", help="also log prompt and output text (off by default)")
    srv.add_argument(
        "--drift-baseline",
        help="an evaluation run (run.db): export specwise_acceptance_rate and specwise_drift_alert gauges on /metrics",
    )
    srv.add_argument("--drift-window", default="1h", help="window of recent requests the gauges compare (default 1h)")
    srv.add_argument(
        "--on-drift",
        choices=["alert", "revert"],
        default="alert",
        help="with --drift-baseline: alert (raise the gauge, default) or revert (also turn speculation off, once; a "
        "person turns it back on with `specwise policy set`)",
    )
    srv.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    srv.set_defaults(func=cmd_serve)

    pol = sub.add_parser("policy", help="show or change a running specwise serve's load policy (admin API)")
    pol.add_argument("action", choices=["show", "set"])
    pol.add_argument("mode", nargs="?", choices=["always", "never", "auto", "table"], help="with set: the new mode")
    pol.add_argument("--endpoint", required=True, help="the server, e.g. http://127.0.0.1:8000")
    pol.add_argument("--admin-key", default=os.environ.get("SPECWISE_ADMIN_KEY"), help="default $SPECWISE_ADMIN_KEY")
    pol.add_argument("--threshold", help="with auto: HIGH[:LOW] requests (as serve --policy-threshold)")
    pol.add_argument("--table", help="with table: LOAD:K,… e.g. 1:4,4:2,8:0 (k per highest load; off above)")
    pol.add_argument("--from", dest="from_file", help="a policy file (specwise export-config --format specwise)")
    pol.add_argument("--reason", help="why, recorded with the change")
    pol.set_defaults(func=cmd_policy)

    exp = sub.add_parser("export-config", help="the draft lengths a k sweep chose, as a server's settings")
    exp.add_argument("db", help="a run's results file (run.db) with a k sweep (evaluate --k 1,2,4,8)")
    exp.add_argument(
        "--format", required=True, choices=EXPORT_FORMATS, help="what to write: " + ", ".join(EXPORT_FORMATS)
    )
    exp.add_argument("--drafter", help="which swept drafter (when the run swept several)")
    exp.add_argument("--out", help="write it to this file (default: standard output)")
    exp.set_defaults(func=cmd_export)

    rep = sub.add_parser("report", help="console summary and HTML/JSON/CSV report of a run")
    rep.add_argument("db", help="a run's results file (run.db)")
    rep.add_argument("--html", help="write the HTML report here (default: report.html beside the results file)")
    rep.add_argument("--json", dest="json_path", help="also export everything as JSON to this path")
    rep.add_argument("--csv", dest="csv_path", help="also export one row per request as CSV to this path")
    rep.set_defaults(func=cmd_report)

    mon = sub.add_parser(
        "monitor",
        help="compare live traffic (the server's request log) with the evaluation run "
        "that justified speculation; exit 1 on drift",
    )
    mon.add_argument("--baseline", required=True, help="the evaluation run (run.db)")
    mon.add_argument("--log", required=True, help="the request log written by `specwise serve --log`")
    mon.add_argument("--window", default="1h", help="recent window to judge: 30m, 1h, 2d, … or 'all' (default 1h)")
    mon.add_argument(
        "--alpha", type=float, default=0.01, help="false-alarm level of the distribution tests (default 0.01)"
    )
    mon.add_argument("--watch", action="store_true", help="refresh the table in the terminal until interrupted")
    mon.add_argument("--interval", type=float, default=10.0, help="seconds between refreshes with --watch")
    mon.set_defaults(func=cmd_monitor)

    cmp = sub.add_parser("compare", help="set two runs side by side; flag revisions that differ")
    cmp.add_argument("a")
    cmp.add_argument("b")
    cmp.set_defaults(func=cmd_compare)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from specwise.engine import Engine, SamplingParams, load_target

    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    if not args.prompt.strip():
        raise SpecwiseError("the prompt is empty: give at least one character of text")
    target = load_target(
        args.model, device=args.device, dtype=args.dtype, quantize=args.quantize, activations=args.activations
    )
    engine = Engine(target, drafter=args.drafter, k=args.k, max_batch=1, verify=args.verify)
    use_chat = not args.raw and target.tokenizer.chat_template is not None
    prompt = [{"role": "user", "content": args.prompt}] if use_chat else args.prompt
    if args.json:
        print(json.dumps(engine.generate([prompt], params)[0].to_dict(), indent=2))
        return 0
    result: GenerationResult | None = None
    for event in engine.stream(prompt, params):
        sys.stdout.write(event.text)
        sys.stdout.flush()
        result = event.result
    sys.stdout.write("\n")
    if args.stats and result is not None:
        print(format_stats(result, engine), file=sys.stderr)
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from specwise.harness.evaluate import evaluate_from_args

    return evaluate_from_args(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from specwise.server.command import serve_from_args

    return serve_from_args(args)


def cmd_report(args: argparse.Namespace) -> int:

    from specwise.harness.analyze import load_run
    from specwise.harness.report import console_summary, html_report, to_csv, to_json

    run = load_run(args.db)
    print(console_summary(run))
    html = Path(args.html) if args.html else Path(args.db).with_name("report.html")
    _write(html, html_report(run))
    print(f"\nreport: {html}")
    if args.json_path:
        _write(Path(args.json_path), to_json(run))
    if args.csv_path:
        _write(Path(args.csv_path), to_csv(run))
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    from specwise.server.policy_client import policy_request

    print(policy_request(args))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from specwise.harness.analyze import load_run
    from specwise.harness.export import export_config

    text, notes = export_config(load_run(args.db), args.format, args.drafter)
    if args.out:
        _write(Path(args.out), text + "\n")
    else:
        print(text)
    for note in notes:
        print(f"# {note}", file=sys.stderr)
    return 0


def cmd_monitor(args: argparse.Namespace) -> int:

    from specwise.monitor.drift import check, status

    if args.interval <= 0:
        raise SpecwiseError(f"--interval {args.interval} is not allowed: give seconds > 0")
    rows, table = check(args.baseline, args.log, args.window, args.alpha)
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


def cmd_compare(args: argparse.Namespace) -> int:
    from specwise.harness.analyze import load_run
    from specwise.harness.compare import compare_runs

    text, flagged = compare_runs(load_run(args.a), load_run(args.b))
    print(text)
    return 1 if flagged else 0


def _write(path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:
        raise SpecwiseError(f"cannot write {path}: {exc.strerror or exc}") from None


def format_stats(result, engine) -> str:
    """A short human-readable block of the request's statistics."""
    s = result.stats
    drafter = engine.drafter.name if engine.drafter else "none (baseline)"
    rate = f"{s.acceptance_rate:.2f}" if s.acceptance_rate is not None else "-"
    mal = f"{s.mean_acceptance_length:.2f}" if s.mean_acceptance_length is not None else "-"
    tps = (s.generated_tokens - 1) / s.decode_time if s.decode_time > 0 and s.generated_tokens > 1 else 0.0
    by_pos = " ".join(f"{a:.2f}" for a in s.acceptance_by_position) or "-"
    lines = [
        f"drafter            {drafter}  k={engine.k_spec}",
        f"tokens             prompt {s.prompt_tokens}, generated {s.generated_tokens} ({result.finish_reason})",
        f"time               prefill {s.prefill_time:.3f}s, TTFT {s.ttft:.3f}s, decode {s.decode_time:.3f}s, "
        f"E2E {s.e2e:.3f}s",
        f"decode speed       {tps:.1f} tokens/s",
        f"verification       {s.steps} steps, drafted {s.drafted}, accepted {s.accepted}",
        f"acceptance         rate {rate}, mean acceptance length {mal}",
        f"by position        {by_pos}",
        f"time split         drafting {s.drafting_time:.3f}s, verification {s.verification_time:.3f}s",
    ]
    return "\n".join(lines)


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


if __name__ == "__main__":
    sys.exit(main())
