"""Traffic: closed-loop concurrency levels and open-loop Poisson arrival rates, named like GuideLLM's strategies.

`concurrent@4` keeps four requests in flight, starting the next as one finishes; `poisson@2` starts requests at
random (exponential gaps, seeded) at 2 per second on average, whatever is in flight.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from specwise.errors import SpecwiseError

KINDS = ("concurrent", "poisson")


@dataclass(frozen=True)
class Load:
    kind: str  # "concurrent" or "poisson"
    value: float  # requests in flight, or requests per second

    @property
    def name(self) -> str:
        return f"{self.kind}@{self.value:g}"

    def arrivals(self, n: int, seed: int) -> list[float]:
        """Offsets in seconds from the phase start at which an open loop submits its n requests."""
        rng = random.Random(seed)
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.expovariate(self.value)
        return out


def parse_load(text: str) -> Load:
    kind, _, value = text.partition("@")
    try:
        v = float(value)
    except ValueError:
        v = -1.0
    if kind not in KINDS or v <= 0 or (kind == "concurrent" and v != int(v)):
        raise SpecwiseError(
            f"load {text!r} is not allowed: write concurrent@N (N a whole number ≥ 1) or "
            "poisson@R (R requests per second > 0)"
        )
    return Load(kind, v)


def loads_from_flags(concurrency: str | None, rates: str | None) -> list[Load]:
    """'1,4' and '0.5,2' → [concurrent@1, concurrent@4, poisson@0.5, poisson@2], each checked."""
    loads = []
    for flag, kind, text in (("--concurrency", "concurrent", concurrency), ("--rate", "poisson", rates)):
        for part in (text or "").split(","):
            if part.strip():
                try:
                    loads.append(parse_load(f"{kind}@{part.strip()}"))
                except SpecwiseError:
                    what = "a whole number ≥ 1" if kind == "concurrent" else "a number of requests per second > 0"
                    raise SpecwiseError(f"{flag} {part.strip()!r} is not allowed: each value must be {what}") from None
    if not loads:
        raise SpecwiseError("no load levels: give --concurrency and/or --rate")
    return loads
