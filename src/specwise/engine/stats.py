"""Per-request speculative decoding statistics, in vLLM's vocabulary (MISSION.md E7)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestStats:
    """What one request cost and what speculation did for it. Times are seconds on the device's clock."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    queue_time: float = 0.0  # submitted → prefill started
    prefill_time: float = 0.0  # the prompt's forward pass
    ttft: float = 0.0  # submitted → first token
    decode_time: float = 0.0  # first token → last token
    e2e: float = 0.0  # submitted → finished
    verification_steps: int = 0  # target passes after the prefill
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    rejections: int = 0  # verification steps that rejected a draft token (the rest accepted all they were given)
    drafting_time: float = 0.0
    verification_time: float = 0.0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def observe_step(self, drafted: int, accepted: int, drafting_time: float, verification_time: float) -> None:
        self.verification_steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += accepted < drafted
        self.drafting_time += drafting_time
        self.verification_time += verification_time
        for per_pos, n in ((self.drafted_per_position, drafted), (self.accepted_per_position, accepted)):
            per_pos.extend([0] * (n - len(per_pos)))
            for i in range(n):
                per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted; None when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verification step, bonus or recovered token included."""
        return (self.accepted + self.verification_steps) / self.verification_steps if self.verification_steps else None

    @property
    def token_acceptance(self) -> float | None:
        """Per-token acceptance α: accepted over every draft position verification judged (the theory's α)."""
        judged = self.accepted + self.rejections
        return self.accepted / judged if judged else None

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=False) if d]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        return self.decode_time / (self.generated_tokens - 1) if self.generated_tokens > 1 else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, mean_acceptance_length=self.mean_acceptance_length,
                 acceptance_by_position=self.acceptance_by_position, tpot=self.tpot)
        return d
