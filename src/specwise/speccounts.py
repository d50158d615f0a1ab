"""What speculation did over some verification steps — one request, or many pooled — and every figure derived from
it, each computed here and nowhere else (vLLM's vocabulary). No torch: the engine, the server, the
request log, the harness's backends, the analysis, the monitor and the benchmarks all use it.

Two serialisations: `to_dict` / `from_dict` (the field names below) wherever specwise stores counts — the results
file, the request log — and `to_usage` / `from_usage`, the names of the `usage.speculative` object `specwise serve`
returns to clients (its public API: `verification_steps`, `drafted_tokens`, `accepted_tokens`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from specwise.errors import SpecwiseError


@dataclass
class SpecCounts:
    """Counts and times of speculation."""

    steps: int = 0  # verification steps: target passes after the prefill
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    rejections: int = 0  # steps that rejected a draft token (the others accepted all they were given)
    drafted_per_position: list[int] = field(default_factory=list)  # steps that drafted a token at position i
    accepted_per_position: list[int] = field(default_factory=list)  # … and had it accepted
    drafting_time: float = 0.0  # seconds
    verification_time: float = 0.0

    def observe_step(
        self, drafted: int, accepted: int, drafting_time: float = 0.0, verification_time: float = 0.0
    ) -> None:
        """One verification step that was given `drafted` tokens and kept `accepted` of them."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += accepted < drafted
        self.drafting_time += drafting_time
        self.verification_time += verification_time
        _add_positions(self.drafted_per_position, [1] * drafted)
        _add_positions(self.accepted_per_position, [1] * accepted)

    def add(self, other: SpecCounts) -> None:
        """Pool `other` into these counts."""
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.rejections += other.rejections
        self.drafting_time += other.drafting_time
        self.verification_time += other.verification_time
        _add_positions(self.drafted_per_position, other.drafted_per_position)
        _add_positions(self.accepted_per_position, other.accepted_per_position)

    @classmethod
    def pooled(cls, items: Iterable[SpecCounts]) -> SpecCounts:
        total = cls()
        for c in items:
            total.add(c)
        return total

    def counts(self) -> SpecCounts:
        """These counts alone (a subclass's extra fields dropped)."""
        return SpecCounts(**{f.name: getattr(self, f.name) for f in fields(SpecCounts)})

    # --- the figures ----------------------------------------------------------------------------------------

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted; None when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verification step, the bonus or recovered token included; None without steps."""
        return (self.accepted + self.steps) / self.steps if self.steps else None

    @property
    def token_acceptance(self) -> float | None:
        """Per-token acceptance α: accepted over every draft position verification judged (the theory's α)."""
        judged = self.accepted + self.rejections
        return self.accepted / judged if judged else None

    @property
    def acceptance_by_position(self) -> list[float]:
        """Acceptance at each draft position, over the steps that drafted that far."""
        return [a / d for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=False) if d]

    @property
    def drafting_share(self) -> float | None:
        """Drafting time over drafting + verification time."""
        spent = self.drafting_time + self.verification_time
        return self.drafting_time / spent if spent > 0 else None

    @property
    def speedup_estimate(self) -> float | None:
        """Tokens per verification step × (1 − drafting share): what speculation yields per unit of step time,
        relative to one token per plain step (verification of k+1 tokens taken to cost a plain step). None when
        nothing was drafted."""
        mal = self.mean_acceptance_length
        if not self.drafted or mal is None:
            return None
        return mal * (1 - (self.drafting_share or 0.0))

    # --- serialisations ---------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(SpecCounts)}

    @classmethod
    def from_dict(cls, d: dict | None) -> SpecCounts:
        """From `to_dict`'s names; missing entries count as zero (a record of a request that did not speculate)."""
        d = d or {}
        return cls(**{f.name: d[f.name] for f in fields(SpecCounts) if d.get(f.name) is not None})

    def to_usage(self) -> dict:
        """`usage.speculative` as `specwise serve` returns it (with the derived rates)."""
        return {
            "verification_steps": self.steps,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "rejections": self.rejections,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "drafting_time": self.drafting_time,
            "verification_time": self.verification_time,
        }

    @classmethod
    def from_usage(cls, u: dict | None) -> SpecCounts:
        """From a server's `usage.speculative`; a value of the wrong kind is refused (SpecwiseError) by name."""
        u = u or {}

        def count(key: str) -> int:
            v = u.get(key) or 0
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise SpecwiseError(f"the server reported speculative.{key} = {v!r:.80}, not a count")
            return v

        def counts(key: str) -> list[int]:
            v = u.get(key) or []
            if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
                raise SpecwiseError(f"the server reported speculative.{key} = {v!r:.80}, not a list of counts")
            return list(v)

        def seconds(key: str) -> float:
            v = u.get(key) or 0.0
            if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
                raise SpecwiseError(f"the server reported speculative.{key} = {v!r:.80}, not a time in seconds")
            return float(v)

        return cls(
            steps=count("verification_steps"),
            drafted=count("drafted_tokens"),
            accepted=count("accepted_tokens"),
            rejections=count("rejections"),
            drafted_per_position=counts("drafted_per_position"),
            accepted_per_position=counts("accepted_per_position"),
            drafting_time=seconds("drafting_time"),
            verification_time=seconds("verification_time"),
        )


def _add_positions(into: list[int], more: list[int]) -> None:
    into.extend([0] * (len(more) - len(into)))
    for i, n in enumerate(more):
        into[i] += n
