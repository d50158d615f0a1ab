"""The load policy, torch-free: when the server's steps may draft (`Policy`), a run-time change of it
(`PolicyChange`), and the policy file — `specwise export-config --format specwise` writes it, `serve --policy-from`,
`specwise policy set --from` and `PUT /admin/policy` read it — as one type with one set of rules (`PolicyFile`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specwise.errors import SpecwiseError
from specwise.specs import DEFAULT_POLICY_HIGH, K_MAX

POLICIES = ("always", "never", "auto", "table")
POLICY_VERSION = 1  # the policy file's format


@dataclass
class Policy:
    """When steps may draft. `auto` stops drafting when the load (running + waiting requests) rises above `high` and
    starts again once it falls to `low` or below — a two-way switch with hysteresis, so it does not flap."""

    mode: str = "always"
    high: int = DEFAULT_POLICY_HIGH
    low: int | None = None
    on: bool = True
    switches: int = 0  # times auto turned drafting off or back on
    table: list[tuple[int, int]] | None = None  # mode "table": (highest load, k) rows, k 0 = off; off above the last
    k_limit: int | None = None  # the table's k for the current load (None: no limit)

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise SpecwiseError(f"policy {self.mode!r} is not allowed: choose one of {', '.join(POLICIES)}")
        if not isinstance(self.high, int) or self.high < 1:
            raise SpecwiseError(f"policy threshold {self.high!r} is not allowed: it must be a whole number ≥ 1")
        if self.low is None:
            self.low = max(self.high // 2, 1) if self.high > 1 else 0
        if not isinstance(self.low, int) or not 0 <= self.low < self.high:
            raise SpecwiseError(
                f"policy low threshold {self.low!r} is not allowed: it must be from 0 to "
                f"{self.high - 1} (below the high threshold {self.high})",
                param="low",
            )
        self.on = self.mode != "never"
        if self.mode == "table" and not self.table:
            raise SpecwiseError("policy 'table' needs its (load, k) rows: give them with --policy-from a policy file")

    def update(self, load: int) -> bool:
        """Whether the next step drafts, given the current load."""
        if self.mode == "table" and self.table:
            k = next((k for hi, k in self.table if load <= hi), 0)  # above the highest measured level: off
            if (k > 0) != self.on:
                self.on, self.switches = k > 0, self.switches + 1
            self.k_limit = k or None
        elif self.mode == "auto":
            if self.on and load > self.high:
                self.on, self.switches = False, self.switches + 1
            elif not self.on and load <= (self.low or 0):  # low is set in __post_init__
                self.on, self.switches = True, self.switches + 1
        return self.on

    def describe(self) -> str:
        if self.mode == "table" and self.table:
            rows = ", ".join(f"k={k} up to {hi}" if k else f"off up to {hi}" for hi, k in self.table)
            return f"table ({rows}; off above {self.table[-1][0]} requests)"
        if self.mode == "auto":
            return f"auto (off above {self.high} requests, back on at {self.low} or fewer)"
        return self.mode


@dataclass(frozen=True)
class PolicyChange:
    """One replacement of the load policy at run time: when, from what to what, by whom (`admin`, `drift`) and why."""

    time: float
    old: str
    new: str
    by: str
    reason: str = ""

    def to_dict(self) -> dict:
        return {"time": self.time, "old": self.old, "new": self.new, "by": self.by, "reason": self.reason}


FILE_KEYS = ("specwise_policy", "drafter", "k_by_concurrency", "source", "fingerprint")


@dataclass(frozen=True)
class PolicyFile:
    """A per-load k table measured by an evaluation: for each highest load (running + waiting requests), the draft
    length that paid there (0: off); above the last row drafting is off. `source` and `fingerprint` say which run."""

    drafter: str
    table: tuple[tuple[int, int], ...]
    source: str | None = None
    fingerprint: str | None = None

    def to_json(self) -> dict:
        return {
            "specwise_policy": POLICY_VERSION,
            "drafter": self.drafter,
            "k_by_concurrency": [list(row) for row in self.table],
            "source": self.source,
            "fingerprint": self.fingerprint,
        }

    def policy(self) -> Policy:
        return Policy("table", table=list(self.table))

    @classmethod
    def from_json(cls, doc: object, where: str) -> PolicyFile:
        """The file's content checked: the one reader every entry point uses (SpecwiseError naming the field)."""
        hint = "write one with `specwise export-config RUN.db --format specwise`"
        where = f"{where}: not a specwise policy file"
        if not isinstance(doc, dict):
            raise SpecwiseError(f"{where} (a JSON object; {hint})")
        extra = sorted(set(doc) - set(FILE_KEYS))
        if extra:
            raise SpecwiseError(
                f"{where}: unknown key(s) {extra} (allowed: {', '.join(FILE_KEYS)})",
                param=extra[0],
            )
        if doc.get("specwise_policy") != POLICY_VERSION:
            raise SpecwiseError(
                f"{where}: specwise_policy is {doc.get('specwise_policy')!r}; this specwise reads version "
                f"{POLICY_VERSION} ({hint})",
                param="specwise_policy",
            )
        if not isinstance(doc.get("drafter"), str) or not doc["drafter"]:
            raise SpecwiseError(f"{where}: drafter must name the drafter the table was measured with", param="drafter")
        table = doc.get("k_by_concurrency")
        whole = lambda x: isinstance(x, int) and not isinstance(x, bool)  # noqa: E731
        if (
            not isinstance(table, list)
            or not table
            or not all(isinstance(r, list) and len(r) == 2 and all(whole(x) for x in r) for r in table)
        ):
            raise SpecwiseError(
                f"{where}: k_by_concurrency must be a non-empty list of [highest load, k] pairs of whole numbers",
                param="k_by_concurrency",
            )
        bad = [r for r in table if r[0] < 1 or not 0 <= r[1] <= K_MAX]
        if bad:
            raise SpecwiseError(
                f"{where}: k_by_concurrency rows {bad} are not allowed: each is [load ≥ 1, k from 0 (off) to {K_MAX}]",
                param="k_by_concurrency",
            )
        loads = [r[0] for r in table]
        if len(set(loads)) != len(loads):
            raise SpecwiseError(f"{where}: k_by_concurrency names a load twice: {loads}", param="k_by_concurrency")
        for key in ("source", "fingerprint"):
            if doc.get(key) is not None and not isinstance(doc[key], str):
                raise SpecwiseError(f"{where}: {key} must be a string or null", param=key)
        rows = tuple(sorted((int(hi), int(k)) for hi, k in table))
        return cls(doc["drafter"], rows, doc.get("source"), doc.get("fingerprint"))

    @classmethod
    def read(cls, path: str | Path) -> PolicyFile:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise SpecwiseError(f"{path}: not a readable JSON policy file ({exc})") from None
        return cls.from_json(doc, str(path))
