"""Logits to probabilities: greedy, temperature, top-k, top-p, seeded generators.

The same `probs_from_logits` is applied to the draft's and the target's logits, so rejection sampling compares the
two distributions the tokens are really drawn from.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from specwise.errors import SpecwiseError


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0  # 1 = no nucleus cut
    seed: int | None = None  # None: a fresh random seed (recorded in the result)
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings, excluded from the text
    ignore_eos: bool = False  # keep generating past EOS (benchmarks want fixed lengths)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        self.validate()

    def validate(self) -> None:
        """Raise SpecwiseError naming the first bad value and what is allowed."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise SpecwiseError(
                f"max_new_tokens={self.max_new_tokens!r} is not allowed: it must be an integer ≥ 1", param="max_tokens"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SpecwiseError(
                f"temperature={self.temperature!r} is not allowed: it must be ≥ 0 (0 = greedy)", param="temperature"
            )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SpecwiseError(
                f"top_k={self.top_k!r} is not allowed: it must be an integer ≥ 0 (0 = off)", param="top_k"
            )
        if not (0 < self.top_p <= 1):
            raise SpecwiseError(f"top_p={self.top_p!r} is not allowed: it must be in (0, 1]", param="top_p")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise SpecwiseError(f"seed={self.seed!r} is not allowed: it must be an integer ≥ 0", param="seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SpecwiseError(
                f"stop={self.stop!r} is not allowed: stop strings must be non-empty strings", param="stop"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams, device: torch.device) -> tuple[torch.Generator, int]:
    """A per-request generator and the seed it was given (drawn at random when the request has none)."""
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(6), "little")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen, seed


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(N, V) logits → (N, V) fp32 probabilities after temperature, top-k and top-p (sampling only)."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def greedy(logits: torch.Tensor) -> list[int]:
    """Argmax of each row of (N, V) logits (first index on ties). On the CPU through numpy, single-threaded: a torch
    reduction this size wakes torch's OpenMP threads, which then spin beside the kernels' own and slow the next
    pass (measured: verification passes 1.6× slower)."""
    if logits.device.type == "cpu":
        return logits.reshape(-1, logits.shape[-1]).numpy().argmax(-1).tolist()
    return logits.reshape(-1, logits.shape[-1]).argmax(-1).tolist()


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of (N, V) probabilities → (N,)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
