"""Logits to the target's distribution: penalties, logit bias, min_tokens, then temperature, top-k and top-p.

Penalties and min_tokens depend on the tokens before a position, so a verification pass applies them row by row,
each with its own prefix (the committed output plus the draft tokens before it) — as plain decoding would have at
that position. The same `probs_from_logits` is applied to the draft's and the target's logits, so rejection sampling
compares the two distributions the tokens are really drawn from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specwise.engine.noise import SEED_LIMIT
from specwise.errors import SpecwiseError

MAX_TOP_LOGPROBS = 20  # as OpenAI


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
    min_tokens: int = 0  # EOS is masked until this many tokens are out (vLLM)
    presence_penalty: float = 0.0  # OpenAI: − penalty for every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: − penalty × its count in the output
    repetition_penalty: float = 1.0  # vLLM/CTRL: tokens of prompt or output: logit / r if > 0, else logit × r
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # None: none; n ≥ 0: the chosen token's logprob and the n most likely

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
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
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < SEED_LIMIT):
            raise SpecwiseError(f"seed={self.seed!r} is not allowed: it must be an integer in [0, 2**63)", param="seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SpecwiseError(
                f"stop={self.stop!r} is not allowed: stop strings must be non-empty strings", param="stop"
            )
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise SpecwiseError(
                f"min_tokens={self.min_tokens!r} is not allowed: it must be an integer ≥ 0", param="min_tokens"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise SpecwiseError(f"{name}={v!r} is not allowed: it must be in [-2, 2]", param=name)
        r = self.repetition_penalty
        if not (math.isfinite(r) and 0 < r <= 2.0):
            raise SpecwiseError(
                f"repetition_penalty={r!r} is not allowed: it must be in (0, 2] (1 = off)", param="repetition_penalty"
            )
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or token < 0 or not math.isfinite(bias) or not -100 <= bias <= 100:
                raise SpecwiseError(
                    f"logit_bias entry {token!r}: {bias!r} is not allowed: token ids are integers ≥ 0 and biases "
                    "are in [-100, 100]",
                    param="logit_bias",
                )
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise SpecwiseError(
                f"top_logprobs={self.logprobs!r} is not allowed: it must be an integer in [0, {MAX_TOP_LOGPROBS}]",
                param="top_logprobs",
            )

    @property
    def adjusts(self) -> bool:
        """Whether logits change with the tokens before a position (penalties, min_tokens) or a bias."""
        return bool(
            self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def adjust(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    draft: Sequence[int] = (),
    eos: Sequence[int] = (),
) -> torch.Tensor:
    """(N, V) raw logits of N consecutive positions → the logits plain decoding would see there: row j follows
    `output` + draft[:j] (N ≤ len(draft) + 1). Order as vLLM: min_tokens mask, logit bias, repetition, frequency and
    presence penalties. Returns fp32; the input is not modified."""
    if not params.adjusts:
        return logits.float()
    out = logits.float().clone()
    n, vocab = out.shape
    dev = out.device
    counts = torch.zeros(vocab, dtype=torch.float32, device=dev)
    if output:
        counts += torch.bincount(torch.tensor(list(output), device=dev), minlength=vocab)[:vocab].float()
    seen_prompt = torch.zeros(vocab, dtype=torch.bool, device=dev)
    if params.repetition_penalty != 1.0 and prompt:
        seen_prompt[torch.tensor(list(prompt), device=dev)] = True
    bias = torch.zeros(vocab, dtype=torch.float32, device=dev)
    for token, b in params.logit_bias:
        if token < vocab:
            bias[token] += b
    for j in range(n):
        if j:
            counts[draft[j - 1]] += 1
        row = out[j]
        if params.min_tokens and len(output) + j < params.min_tokens and not params.ignore_eos:
            for e in eos:
                row[e] = float("-inf")
        if params.logit_bias:
            row += bias
        if params.repetition_penalty != 1.0:
            seen = seen_prompt | (counts > 0)
            r = params.repetition_penalty
            row[:] = torch.where(seen, torch.where(row > 0, row / r, row * r), row)
        if params.frequency_penalty or params.presence_penalty:
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return out


def log_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(N, V) adjusted logits → log of the distribution a token is drawn from: log-softmax of the logits when greedy,
    of the temperature/top-k/top-p distribution when sampling (−inf outside its support). What `logprobs` report."""
    if params.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log(probs_from_logits(logits, params))


def gumbel_argmax(log_probs: torch.Tensor, noise: torch.Tensor) -> int:
    """argmax(log π + G): an exact draw from π when G is standard Gumbel noise (the Gumbel-max trick)."""
    return int(torch.argmax(log_probs + noise))


def top_logprobs(row: torch.Tensor, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log probability in a (V,) log distribution and the n most likely tokens, most likely
    first (a −inf one is left out: it could not have been chosen)."""
    chosen = float(row[token])
    if not n:
        return chosen, []
    values, ids = torch.topk(row, min(n, row.shape[-1]))
    return chosen, [(int(i), float(v)) for v, i in zip(values, ids, strict=True) if math.isfinite(float(v))]


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


def draw(probs: torch.Tensor, u: float) -> int:
    """The token whose cumulative-probability interval holds u ∈ [0, 1) (inverse CDF) of a (V,) distribution: with
    u from a counter-based stream, an exact and reproducible draw."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    x = torch.tensor([u * float(cdf[-1])], dtype=torch.float64, device=cdf.device)
    return min(int(torch.searchsorted(cdf, x, right=True)), probs.shape[-1] - 1)  # first i with cdf[i] > x
