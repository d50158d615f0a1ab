"""`specwise policy show|set`: the admin API of a running server."""

from __future__ import annotations

import argparse
import os
import time

from specwise.errors import SpecwiseError
from specwise.specs import parse_threshold


def add(sub: argparse._SubParsersAction) -> None:
    """This subcommand and its flags."""
    p = sub.add_parser("policy", help="show or change a running specwise serve's load policy (admin API)")
    p.add_argument("action", choices=["show", "set"])
    p.add_argument("mode", nargs="?", choices=["always", "never", "auto", "table"], help="with set: the new mode")
    p.add_argument("--endpoint", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--admin-key", default=os.environ.get("SPECWISE_ADMIN_KEY"), help="default $SPECWISE_ADMIN_KEY")
    p.add_argument("--threshold", help="with auto: HIGH[:LOW] requests (as serve --policy-threshold)")
    p.add_argument("--table", help="with table: LOAD:K,… e.g. 1:4,4:2,8:0 (k per highest load; off above)")
    p.add_argument("--from", dest="from_file", help="a policy file (specwise export-config --format specwise)")
    p.add_argument("--reason", help="why, recorded with the change")
    p.set_defaults(func=run)


def policy_body(args: argparse.Namespace) -> dict:
    """The PUT body `set` sends, from the flags; every mistake named before anything is sent."""
    from specwise.policy import PolicyFile

    if args.from_file:  # checked here by the reader the server uses, so a bad file is refused before sending
        body = PolicyFile.read(args.from_file).to_json()
    elif args.mode is None:
        raise SpecwiseError("policy set: give a mode (always, never, auto, table) or --from FILE")
    else:
        body = {"mode": args.mode}
        if args.threshold:
            if args.mode != "auto":
                raise SpecwiseError("--threshold is auto's: HIGH[:LOW]")
            high, low = parse_threshold(args.threshold, "--threshold")
            body.update(high=high, **({"low": low} if low is not None else {}))
        if args.table:
            if args.mode != "table":
                raise SpecwiseError("--table is for mode table")
            try:
                body["table"] = [[int(a), int(b)] for a, b in (row.split(":") for row in args.table.split(","))]
            except ValueError:
                raise SpecwiseError(f"--table {args.table!r} is not allowed: write LOAD:K,… e.g. 1:4,4:2,8:0") from None
    if args.reason:
        body["reason"] = args.reason
    return body


def run(args: argparse.Namespace) -> int:
    """Show or set the policy, and print the server's answer: the policy and its recorded changes."""
    from specwise.server.policy_client import admin_policy

    body = policy_body(args) if args.action == "set" else None
    data = admin_policy(args.endpoint, args.admin_key, body)
    print(f"policy: {data['policy']}" + (" (applies from the next step)" if body else ""))
    for c in data.get("changes", []):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c["time"]))
        print(f"  {when} by {c['by']}: {c['old']} → {c['new']}" + (f" ({c['reason']})" if c["reason"] else ""))
    return 0
