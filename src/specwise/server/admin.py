"""The admin API of `specwise serve --admin-key KEY`: read and replace the load policy at run time.

`GET /admin/policy` shows the policy and every change so far; `PUT /admin/policy` takes `{"mode": "always"|"never"}`,
`{"mode": "auto", "high": H, "low": L}`, `{"mode": "table", "table": [[load, k], …]}`, or the file `specwise
export-config --format specwise` writes. A change applies from the next engine step: running requests finish under
it, none is dropped. Its own key, never the client API key (checked in app.BodyLimit).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from specwise.engine.scheduler import Policy, Scheduler
from specwise.errors import SpecwiseError
from specwise.server.protocol import ProtocolError, Strict
from specwise.specs import K_MAX

LoadRow = tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=0, le=K_MAX)]]


class PolicyBody(Strict):
    """A new policy: by mode and thresholds or table, or as a specwise policy file."""

    mode: Literal["always", "never", "auto", "table"] | None = None
    high: Annotated[int, Field(ge=1)] | None = None
    low: Annotated[int, Field(ge=0)] | None = None
    table: list[LoadRow] | None = None
    # the fields of `specwise export-config --format specwise`
    specwise_policy: Literal[1] | None = None
    drafter: str | None = None
    k_by_concurrency: list[LoadRow] | None = None
    source: str | None = None
    fingerprint: str | None = None
    reason: str | None = None


def policy_from_body(body: PolicyBody, drafters: list[str]) -> Policy:
    """The Policy a body asks for; a ProtocolError (400, naming the field) when it cannot be one."""
    if body.specwise_policy is not None or body.k_by_concurrency is not None:
        if not body.k_by_concurrency:
            raise ProtocolError("a policy file needs k_by_concurrency rows", "k_by_concurrency")
        if body.drafter is not None and body.drafter not in drafters:
            raise ProtocolError(
                f"the policy file was measured with drafter {body.drafter!r}; this server has "
                f"{', '.join(drafters) or 'no drafter'}",
                "drafter",
            )
        return _policy("table", body, sorted(body.k_by_concurrency))
    if body.mode is None:
        raise ProtocolError("give mode (always, never, auto or table), or a specwise policy file", "mode")
    table = sorted(body.table) if body.table else None
    if body.mode == "table" and not table:
        raise ProtocolError("mode table needs table: [[highest load, k], …]", "table")
    if body.mode != "table" and table:
        raise ProtocolError(f"table is for mode table, not {body.mode}", "table")
    if body.mode != "auto" and (body.high is not None or body.low is not None):
        raise ProtocolError(f"high and low are auto's thresholds, not {body.mode}'s", "high")
    return _policy(body.mode, body, table)


def _policy(mode: str, body: PolicyBody, table: list[tuple[int, int]] | None) -> Policy:
    try:
        return Policy(mode, body.high or 4, body.low, table=table)
    except SpecwiseError as exc:
        raise ProtocolError(str(exc), exc.param or "mode") from None


def policy_view(scheduler: Scheduler) -> dict:
    p = scheduler.policy
    return {
        "policy": p.describe(),
        "mode": p.mode,
        "high": p.high if p.mode == "auto" else None,
        "low": p.low if p.mode == "auto" else None,
        "table": p.table,
        "speculating": p.on,
        "changes": [c.to_dict() for c in scheduler.policy_changes],
    }
