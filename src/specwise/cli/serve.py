"""`specwise serve`: its flags, every one checked before the model loads; then the engine, the server and the
monitor's parts the flags ask for (server/command.py holds the helpers below the command line)."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from specwise.cli.common import drafter_arg, k_arg, precision_flags, target_options
from specwise.errors import SpecwiseError
from specwise.models import MODEL_HELP, named
from specwise.specs import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_LEN,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_SLOWDOWN,
    DEFAULT_POLICY_HIGH,
    DEFAULT_PREFILL_CHUNK,
    DRAFTER_HELP,
    K_MAX,
    VERIFY_HELP,
    VERIFY_METHODS,
    parse_threshold,
)


def add(sub: argparse._SubParsersAction) -> None:
    """This subcommand and its flags."""
    p = sub.add_parser("serve", help="OpenAI-compatible server: continuous batching, load-aware speculation")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument(
        "--served-model-name",
        help="the name clients send as `model` (default: the name --model gave, e.g. qwen2.5-coder-1.5b, else the "
        "model file's name)",
    )
    p.add_argument(
        "--drafter", type=drafter_arg, help=f"default drafter: {DRAFTER_HELP}, or none (the default: plain decoding)"
    )
    p.add_argument("--drafters", help="more drafters requests may choose, comma-separated (e.g. int8,ngram:2)")
    p.add_argument("--k", type=k_arg, default="auto", help=f"default draft length 1..{K_MAX} or 'auto' (default auto)")
    p.add_argument(
        "--policy",
        default="always",
        choices=["always", "never", "auto"],
        help="when steps draft: always, never, or auto (off under load; default always)",
    )
    p.add_argument(
        "--policy-threshold",
        default=str(DEFAULT_POLICY_HIGH),
        help="auto: HIGH[:LOW] — drafting stops above HIGH running+waiting requests, resumes at LOW (default "
        f"{DEFAULT_POLICY_HIGH}, LOW half of it)",
    )
    p.add_argument(
        "--policy-from",
        help="take the policy from an evaluation run (run.db: the auto threshold) or from a policy file (.json, "
        "from `specwise export-config --format specwise`: a k per load)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--allowed-hosts",
        help="comma-separated Host header values the server answers (others get 421; '*': any). Default: "
        "localhost, 127.0.0.1 and ::1 when bound to loopback, any otherwise",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=256,
        help="concurrent connections served; more get 503 (default 256)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        help="require 'Authorization: Bearer KEY' on /v1 routes and the API docs (repeat for several clients' keys; "
        "default $SPECWISE_API_KEY, comma-separated keys — out of `ps`)",
    )
    p.add_argument(
        "--suffix-history",
        default="per-key",
        choices=["per-key", "shared", "off"],
        help="whose earlier outputs suffix drafts may come from: per-key (requests of the same API key; default — "
        "with no --api-key that is every client), shared (all clients: a client could probe another's outputs "
        "through the acceptance it is told), or off",
    )
    p.add_argument(
        "--admin-key",
        default=os.environ.get("SPECWISE_ADMIN_KEY"),
        help="enable the admin API (GET/PUT /admin/policy: change the policy at run time) with this key of its own "
        "(default $SPECWISE_ADMIN_KEY; off when unset)",
    )
    p.add_argument("--verify", default=VERIFY_METHODS[0], choices=VERIFY_METHODS, help=VERIFY_HELP)
    p.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_MAX_BATCH,
        help=f"requests in the running batch (default {DEFAULT_MAX_BATCH})",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help=f"requests waiting beyond the batch before 429s (default {DEFAULT_MAX_QUEUE})",
    )
    p.add_argument(
        "--max-len", type=int, default=DEFAULT_MAX_LEN, help=f"context length in tokens (default {DEFAULT_MAX_LEN})"
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=DEFAULT_PREFILL_CHUNK,
        help=f"prompt tokens a step takes while other requests decode (default {DEFAULT_PREFILL_CHUNK}): smaller keeps "
        "streams smoother when requests arrive, larger gives a lower time to first token",
    )
    p.add_argument(
        "--max-slowdown",
        type=float,
        default=DEFAULT_MAX_SLOWDOWN,
        help="what drafts may cost a request that drafts nothing, beyond what speculation has saved it, as a share "
        f"of its time in the engine (default {DEFAULT_MAX_SLOWDOWN}: k=auto drafts are trimmed to fit; 'inf': drafts "
        "only have to pay for the pass, for the most tokens per second)",
    )
    p.add_argument(
        "--no-prompt-reuse",
        action="store_true",
        help="prefill every prompt whole, instead of reading the start it shares with the slot's last request of "
        "the same API key from the cache (the output is the same either way; only times change)",
    )
    p.add_argument("--max-body", type=int, default=1 << 20, help="largest request body in bytes (default 1 MiB)")
    p.add_argument("--device", default="cpu")
    precision_flags(p)
    p.add_argument("--log", help="append one record per finished request to this SQLite request log")
    p.add_argument("--log-text", action="store_true", help="also log prompt and output text (off by default)")
    p.add_argument(
        "--log-max-mb",
        type=float,
        default=1024.0,
        help="keep the request log's records within this many MB: the oldest are dropped, and counted (default 1024)",
    )
    p.add_argument(
        "--drift-baseline",
        help="an evaluation run (run.db): export specwise_acceptance_rate and specwise_drift_alert gauges on /metrics",
    )
    p.add_argument("--drift-window", default="1h", help="window of recent requests the gauges compare (default 1h)")
    p.add_argument(
        "--on-drift",
        choices=["alert", "revert"],
        default="alert",
        help="with --drift-baseline: alert (raise the gauge, default) or revert (also turn speculation off, once; a "
        "person turns it back on with `specwise policy set`)",
    )
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def served_name(model: str | None, told: str | None, file_name: str) -> str:
    """The name clients send as `model`: --served-model-name, else the registry name --model gave (a user who started
    `serve --model qwen2.5-coder-1.5b` asks for that name), else the model file's name without `.gguf`."""
    return told or named(model, file_name.removesuffix(".gguf"))


def run(args: argparse.Namespace) -> int:
    """Check every flag before the model loads, then load it, start the scheduler thread and serve until
    interrupted. The engine, the web stack and the monitor's parts a flag asks for are imported late."""
    from specwise.monitor.drift import load_baseline, parse_window
    from specwise.monitor.live import DriftWatch, WatchOptions
    from specwise.monitor.requestlog import RequestLog
    from specwise.policy import Policy
    from specwise.server.command import allowed_hosts, api_keys, memory_line, read_policy_from
    from specwise.server.middleware import LOOPBACK_HOSTS

    options = target_options(args)
    if not 0 <= args.port <= 65535:
        raise SpecwiseError(f"--port {args.port} is not allowed: give 0..65535")
    if args.max_queue < 1 or args.max_batch < 1 or args.prefill_chunk < 1:
        raise SpecwiseError("--max-queue, --max-batch and --prefill-chunk must be ≥ 1")
    if not args.max_slowdown >= 0:  # NaN too
        raise SpecwiseError(f"--max-slowdown {args.max_slowdown} is not allowed: give a share ≥ 0 (0.03 is 3%) or inf")
    if args.max_body < 1024:
        raise SpecwiseError(f"--max-body {args.max_body} is too small: allow at least 1024 bytes")
    if args.max_connections < 1:
        raise SpecwiseError(f"--max-connections {args.max_connections} is not allowed: give 1 or more")
    hosts = allowed_hosts(args.host, args.allowed_hosts)
    keys = api_keys(args.api_key)
    if args.admin_key is not None and (not args.admin_key.strip() or args.admin_key in keys):
        raise SpecwiseError("--admin-key must be a non-empty key of its own (not a client --api-key)")
    if args.on_drift == "revert" and not args.drift_baseline:
        raise SpecwiseError("--on-drift revert needs --drift-baseline RUN.db (what the traffic is compared with)")
    why, drafter = None, args.drafter
    if args.policy_from:
        policy, why, drafter = read_policy_from(args.policy_from, args.drafter)
    else:
        high, low = parse_threshold(args.policy_threshold)
        policy = Policy(args.policy, high, low)
    drafters = [d for d in (args.drafters or "").split(",") if d]
    if args.log_text and not args.log:
        raise SpecwiseError("--log-text needs --log PATH (it adds prompt and output text to the request log)")
    baseline, window = None, None
    if args.drift_baseline:  # checked before the model loads
        window = parse_window(args.drift_window) or float("inf")
        baseline = load_baseline(args.drift_baseline, drafter)
    if not args.log_max_mb > 0:
        raise SpecwiseError(f"--log-max-mb {args.log_max_mb} is not allowed: give a size above 0 (MB)")
    if args.log:
        RequestLog(args.log).close()  # a path that cannot hold a log fails now, not at the first request
    if policy.mode != "never" and not drafter and not drafters:
        print("specwise serve: no --drafter given, so every request decodes plainly", file=sys.stderr)

    import uvicorn

    from specwise.engine import Engine, load_target
    from specwise.server.app import ServerState, create_app

    target = load_target(options)
    engine = Engine(
        target,
        drafter=drafter,
        k=args.k,
        max_batch=args.max_batch,
        max_len=args.max_len,
        prefill_chunk=args.prefill_chunk,
        verify=args.verify,
    )
    engine.reuse_prompts = not args.no_prompt_reuse
    engine.max_slowdown = args.max_slowdown
    for spec in drafters:
        engine.add_drafter(spec)
    name = served_name(args.model, args.served_model_name, target.identity.name)
    state = ServerState.build(
        engine, name, policy, args.max_queue, keys, args.admin_key, suffix_history=args.suffix_history
    )
    scheduler = state.scheduler
    watch = None
    if args.log or baseline is not None:
        watch_options = WatchOptions(
            log_path=args.log,
            log_text=args.log_text,
            log_max_bytes=int(args.log_max_mb * 2**20),
            window_seconds=window or float("inf"),
            on_drift=args.on_drift,
        )
        watch = DriftWatch(
            engine,
            watch_options,
            baseline,
            revert=lambda reason: scheduler.set_policy(Policy("never"), "drift", reason),
        )
        state.on_finish.append(watch.on_finish)
        state.metrics.add_gauges(watch.gauges)
        scheduler.on_policy.append(watch.on_policy)
    if args.policy_from:  # SIGHUP re-reads it (an admin change, recorded like one)

        def reread(_signum, _frame) -> None:
            try:
                new, reason, _ = read_policy_from(args.policy_from, drafter)
            except SpecwiseError as exc:
                print(f"specwise serve: SIGHUP: policy kept, {exc}", file=sys.stderr, flush=True)
                return
            scheduler.set_policy(new, "admin", f"SIGHUP: {reason}")

        signal.signal(signal.SIGHUP, reread)
    app = create_app(state, max_body=args.max_body, allowed_hosts=hosts)
    scheduler.start()
    budget = memory_line(engine)
    if budget:
        print(f"specwise serve: memory: {budget}", file=sys.stderr, flush=True)
    print(
        f"specwise serve: {name} on http://{args.host}:{args.port} — drafters: "
        f"{', '.join(engine.drafters) or 'none'}; policy: {policy.describe()}" + (f" [{why}]" if why else ""),
        file=sys.stderr,
        flush=True,
    )
    if not keys and args.host not in LOOPBACK_HOSTS:
        print(
            f"specwise serve: warning: bound to {args.host} without --api-key: anyone who can reach this port can "
            "generate, and every client shares one suffix-drafting history",
            file=sys.stderr,
            flush=True,
        )
    try:
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
            limit_concurrency=args.max_connections,
        )
    finally:
        scheduler.stop()
        if watch is not None:
            watch.close()
    return 0
