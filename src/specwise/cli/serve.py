"""`specwise serve`: its flags; checking them and serving is server/command.py."""

from __future__ import annotations

import argparse
import os

from specwise.cli.common import drafter_arg, k_arg, precision_flags
from specwise.models import MODEL_HELP
from specwise.specs import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_LEN,
    DEFAULT_MAX_QUEUE,
    DEFAULT_POLICY_HIGH,
    DEFAULT_PREFILL_CHUNK,
    DRAFTER_HELP,
    K_MAX,
    VERIFY_HELP,
    VERIFY_METHODS,
)


def add(sub: argparse._SubParsersAction) -> None:
    """This subcommand and its flags."""
    p = sub.add_parser("serve", help="OpenAI-compatible server: continuous batching, load-aware speculation")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--served-model-name", help="the name clients send as `model` (default: the model's name)")
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


def run(args: argparse.Namespace) -> int:
    from specwise.server.command import serve_from_args

    return serve_from_args(args)
