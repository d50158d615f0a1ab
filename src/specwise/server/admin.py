"""The admin API of `specwise serve --admin-key KEY`: read and replace the load policy at run time.

`GET /admin/policy` shows the policy and every change so far; `PUT /admin/policy` takes `{"mode": "always"|"never"}`,
`{"mode": "auto", "high": H, "low": L}`, `{"mode": "table", "table": [[load, k], …]}`, or the file `specwise
export-config --format specwise` writes. A change applies from the next engine step: running requests finish under
it, none is dropped. Its own key, never the client API key (checked in app.BodyLimit).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationError

from specwise.engine.scheduler import Scheduler
from specwise.errors import SpecwiseError
from specwise.policy import FILE_KEYS, Policy, PolicyFile
from specwise.server.protocol import ProtocolError, Strict, pydantic_error
from specwise.specs import K_MAX

LoadRow = tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=0, le=K_MAX)]]


class PolicyBody(Strict):
    """A new policy by mode: always, never, auto with thresholds, or table with its rows. (A specwise policy file
    is the other form a PUT takes; `PolicyFile` reads it, as everywhere else.)"""

    mode: Literal["always", "never", "auto", "table"]
    high: Annotated[int, Field(ge=1)] | None = None
    low: Annotated[int, Field(ge=0)] | None = None
    table: list[LoadRow] | None = None
    reason: str | None = None


def policy_from_body(doc: dict, drafters: list[str]) -> tuple[Policy, str]:
    """(the Policy a PUT body asks for, its reason); a ProtocolError (400, naming the field) when it cannot be one.
    A body with a policy file's keys is a policy file (plus an optional reason), read by `PolicyFile.from_json`."""
    reason = doc.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise ProtocolError("reason must be a string", "reason")
    if any(k in doc for k in FILE_KEYS):
        try:
            file = PolicyFile.from_json({k: v for k, v in doc.items() if k != "reason"}, "the policy file")
        except SpecwiseError as exc:
            raise ProtocolError(str(exc), exc.param) from None
        if file.drafter not in drafters:
            raise ProtocolError(
                f"the policy file was measured with drafter {file.drafter!r}; this server has "
                f"{', '.join(drafters) or 'no drafter'}",
                "drafter",
            )
        return file.policy(), reason or ""
    try:
        body = PolicyBody.model_validate(doc)
    except ValidationError as exc:
        raise pydantic_error([dict(e) for e in exc.errors()]) from None
    table = sorted(body.table) if body.table else None
    if body.mode == "table" and not table:
        raise ProtocolError("mode table needs table: [[highest load, k], …]", "table")
    if body.mode != "table" and table:
        raise ProtocolError(f"table is for mode table, not {body.mode}", "table")
    if body.mode != "auto" and (body.high is not None or body.low is not None):
        raise ProtocolError(f"high and low are auto's thresholds, not {body.mode}'s", "high")
    try:
        return Policy(body.mode, body.high or 4, body.low, table=table), reason or ""
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
