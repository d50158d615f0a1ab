"""`specwise policy show|set`: the admin API of a running server."""

from __future__ import annotations

import argparse
import os


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


def run(args: argparse.Namespace) -> int:
    from specwise.server.policy_client import policy_request

    print(policy_request(args))
    return 0
