"""`specwise policy show|set`: the admin API of a running `specwise serve`, from the command line (no torch)."""

from __future__ import annotations

import argparse
import time

import httpx

from specwise.errors import SpecwiseError
from specwise.policy import PolicyFile
from specwise.specs import parse_threshold


def policy_body(args: argparse.Namespace) -> dict:
    """The PUT body `set` sends, from the flags; every mistake named before anything is sent."""
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


def policy_request(args: argparse.Namespace) -> str:
    """Show or set the policy; the server's answer, for people."""
    if not args.admin_key:
        raise SpecwiseError("give the server's admin key: --admin-key KEY or $SPECWISE_ADMIN_KEY")
    url = args.endpoint.rstrip("/").removesuffix("/v1") + "/admin/policy"
    headers = {"Authorization": f"Bearer {args.admin_key}"}
    body = policy_body(args) if args.action == "set" else None
    try:
        r = (
            httpx.put(url, json=body, headers=headers, timeout=30)
            if body
            else httpx.get(url, headers=headers, timeout=30)
        )
    except httpx.HTTPError as exc:
        raise SpecwiseError(f"cannot reach {url} ({exc})") from None
    try:
        data = r.json()
    except ValueError:
        raise SpecwiseError(f"{url} answered {r.status_code} without JSON") from None
    if r.status_code != 200:
        err = data.get("error", {}) if isinstance(data, dict) else {}
        param = f" [{err.get('param')}]" if err.get("param") else ""
        raise SpecwiseError(f"the server refused ({r.status_code}){param}: {err.get('message', data)}")
    lines = [f"policy: {data['policy']}" + (" (applies from the next step)" if body else "")]
    for c in data.get("changes", []):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c["time"]))
        lines.append(f"  {when} by {c['by']}: {c['old']} → {c['new']}" + (f" ({c['reason']})" if c["reason"] else ""))
    return "\n".join(lines)
