"""Per-request statistics: the speculation counts of `specwise.speccounts` plus the request's
token counts and times."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from specwise.speccounts import SpecCounts


@dataclass
class RequestStats(SpecCounts):
    """What one request cost and what speculation did for it. Times are seconds on the device's clock."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, read from the cache rows the slot's last request left (not prefilled)
    generated_tokens: int = 0
    queue_time: float = 0.0  # submitted → prefill started
    prefill_time: float = 0.0  # the prompt's passes
    ttft: float = 0.0  # submitted → first token
    decode_time: float = 0.0  # first token → last token
    e2e: float = 0.0  # submitted → finished

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        return self.decode_time / (self.generated_tokens - 1) if self.generated_tokens > 1 else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_acceptance_length=self.mean_acceptance_length,
            acceptance_by_position=self.acceptance_by_position,
            tpot=self.tpot,
        )
        return d
