"""The admin API of a running `specwise serve` from a client: read or set its policy (no torch). `specwise policy`
(cli/policy.py) builds the body from its flags."""

from __future__ import annotations

import httpx

from specwise.errors import SpecwiseError


def admin_policy(endpoint: str, admin_key: str, body: dict | None = None) -> dict:
    """GET the server's policy and its recorded changes, or PUT `body` (a policy, as PolicyFile or the admin API
    writes it) and get the same back; every refusal becomes a SpecwiseError naming the field at fault."""
    if not admin_key:
        raise SpecwiseError("give the server's admin key: --admin-key KEY or $SPECWISE_ADMIN_KEY")
    url = endpoint.rstrip("/").removesuffix("/v1") + "/admin/policy"
    headers = {"Authorization": f"Bearer {admin_key}"}
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
    return data
