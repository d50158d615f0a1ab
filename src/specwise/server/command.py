"""`specwise serve`: check every flag before the model loads, then load it, start the scheduler and serve.

Only the engine, the web stack and the monitor's parts a flag asks for are imported late: `specwise --help` and a
refused flag must stay fast and torch-free.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from specwise.errors import SpecwiseError
from specwise.harness.analyze import policy_from_run
from specwise.monitor.drift import load_baseline, parse_window
from specwise.monitor.live import DriftWatch, WatchOptions
from specwise.monitor.requestlog import RequestLog
from specwise.policy import Policy, PolicyFile
from specwise.server.middleware import LOOPBACK_HOSTS
from specwise.specs import TargetOptions, parse_threshold


def read_policy_from(args: argparse.Namespace):
    """(Policy, why) from --policy-from: a policy file (.json, a per-load k table) or an evaluation run (run.db)."""
    if args.policy_from.endswith(".json"):  # specwise export-config --format specwise
        file = PolicyFile.read(args.policy_from)
        if args.drafter and args.drafter != file.drafter:
            raise SpecwiseError(
                f"--policy-from {args.policy_from} was measured with drafter {file.drafter!r}, "
                f"not --drafter {args.drafter!r}"
            )
        args.drafter = args.drafter or file.drafter
        return file.policy(), f"{args.policy_from}: per-load k of {file.drafter}"
    mode, high, why = policy_from_run(args.policy_from)
    return Policy(mode, high or 1), why


def api_keys(given: list[str] | None) -> tuple[str, ...]:
    """The client keys: every --api-key, else $SPECWISE_API_KEY's comma-separated keys; an empty one is refused."""
    if given is None:
        env = os.environ.get("SPECWISE_API_KEY")
        given = env.split(",") if env is not None else []
        where = "$SPECWISE_API_KEY"
    else:
        where = "--api-key"
    keys = [k.strip() for k in given]
    if any(not k for k in keys):
        raise SpecwiseError(f"{where} holds an empty key: give a key, or leave it out")
    bad = [k for k in keys if any(c.isspace() or not c.isprintable() for c in k)]
    if bad:
        raise SpecwiseError(f"{where}: a key may not hold spaces or control characters (it travels in a header)")
    return tuple(dict.fromkeys(keys))


def allowed_hosts(bind: str, given: str | None) -> tuple[str, ...] | None:
    """The Host header values to answer: --allowed-hosts ('*': any), else loopback's names when bound to
    loopback (a keyless local server is what DNS rebinding reaches), else any."""
    if given is not None:
        names = tuple(h.strip().lower() for h in given.split(",") if h.strip())
        if not names:
            raise SpecwiseError("--allowed-hosts is empty: give host names (e.g. localhost,myhost) or '*' for any")
        return None if "*" in names else names
    return LOOPBACK_HOSTS if bind in LOOPBACK_HOSTS else None


def memory_line(engine) -> str:
    """The resident budget's parts on one line (weights, KV cache of every slot, scratch), for the CPU kernels."""
    from specwise.engine.native import NativeDecoder

    model = engine.target.model
    if not isinstance(model, NativeDecoder):
        return ""
    b = model.memory_budget(max_len=engine.max_len)
    mb = 1e6
    kv = b["kv_bytes"] * engine.max_batch
    return (
        f"weights {b['weights_bytes'] / mb:,.0f} MB, KV cache {kv / mb:,.0f} MB ({engine.max_batch} × "
        f"{engine.max_len} positions), scratch {b['scratch_bytes'] / mb:,.0f} MB; drafters' extra "
        f"{sum(d.extra_memory_bytes() for d in engine.drafters.values()) / mb:,.0f} MB"
    )


def serve_from_args(args: argparse.Namespace) -> int:
    """Check every flag, load the model, start the scheduler thread and serve until interrupted."""
    options = TargetOptions(args.model, args.device, args.dtype, args.quantize, args.activations)
    if not 0 <= args.port <= 65535:
        raise SpecwiseError(f"--port {args.port} is not allowed: give 0..65535")
    if args.max_queue < 1 or args.max_batch < 1 or args.prefill_chunk < 1:
        raise SpecwiseError("--max-queue, --max-batch and --prefill-chunk must be ≥ 1")
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
    why = None
    if args.policy_from:
        policy, why = read_policy_from(args)
    else:
        high, low = parse_threshold(args.policy_threshold)
        policy = Policy(args.policy, high, low)
    drafters = [d for d in (args.drafters or "").split(",") if d]
    if args.log_text and not args.log:
        raise SpecwiseError("--log-text needs --log PATH (it adds prompt and output text to the request log)")
    baseline, window = None, None
    if args.drift_baseline:  # checked before the model loads
        window = parse_window(args.drift_window) or float("inf")
        baseline = load_baseline(args.drift_baseline, args.drafter)
    if not args.log_max_mb > 0:
        raise SpecwiseError(f"--log-max-mb {args.log_max_mb} is not allowed: give a size above 0 (MB)")
    if args.log:
        RequestLog(args.log).close()  # a path that cannot hold a log fails now, not at the first request
    if policy.mode != "never" and not args.drafter and not drafters:
        print("specwise serve: no --drafter given, so every request decodes plainly", file=sys.stderr)

    import uvicorn

    from specwise.engine import Engine, load_target
    from specwise.server.app import ServerState, create_app

    target = load_target(options)
    engine = Engine(
        target,
        drafter=args.drafter,
        k=args.k,
        max_batch=args.max_batch,
        max_len=args.max_len,
        prefill_chunk=args.prefill_chunk,
        verify=args.verify,
    )
    for spec in drafters:
        engine.add_drafter(spec)
    name = args.served_model_name or target.identity.name.removesuffix(".gguf")
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
            engine, watch_options, baseline, revert=lambda reason: scheduler.set_policy(Policy("never"), "drift", reason)
        )
        state.on_finish.append(watch.on_finish)
        state.metrics.add_gauges(watch.gauges)
        scheduler.on_policy.append(watch.on_policy)
    if args.policy_from:  # SIGHUP re-reads it (an admin change, recorded like one)

        def reread(_signum, _frame) -> None:
            try:
                new, reason = read_policy_from(args)
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
