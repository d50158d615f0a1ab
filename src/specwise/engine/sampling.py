"""Logits to the target's distribution: penalties, logit bias, min_tokens, then temperature, top-k and top-p.

Penalties and min_tokens depend on the tokens before a position, so a verification pass applies them row by row,
each with its own prefix (the committed output plus the draft tokens before it) — as plain decoding would have at
that position. The same `probabilities` is applied to the draft's and the target's logits, so rejection sampling
compares the two distributions the tokens are really drawn from.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
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


def host(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """fp32 numpy view (or copy) of logits or probabilities. The sampling arithmetic runs in numpy, single-threaded:
    a torch op over a 49k vocabulary wakes torch's OpenMP threads, which then spin beside the kernels' own and slow
    the next pass (measured: greedy verification passes 1.6× slower; sampled decoding ran at half greedy's speed)."""
    if isinstance(x, np.ndarray):
        return x if x.dtype == np.float32 else x.astype(np.float32)
    return x.detach().float().cpu().numpy()


def adjust(
    logits: torch.Tensor | np.ndarray,
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    draft: Sequence[int] = (),
    eos: Iterable[int] = (),
) -> np.ndarray:
    """(N, V) raw logits of N consecutive positions → the logits plain decoding would see there: row j follows
    `output` + draft[:j] (N ≤ len(draft) + 1). Order as vLLM: min_tokens mask, logit bias, repetition, frequency and
    presence penalties. Returns a new fp32 array."""
    out = np.array(host(logits), dtype=np.float32, copy=True)
    if not params.adjusts:
        return out
    n, vocab = out.shape
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=vocab)[:vocab].astype(np.float32)
    seen_prompt = np.zeros(vocab, dtype=bool)
    if params.repetition_penalty != 1.0 and prompt:
        seen_prompt[np.asarray(prompt, dtype=np.int64)] = True
    bias = np.zeros(vocab, dtype=np.float32)
    for token, b in params.logit_bias:
        if token < vocab:
            bias[token] += b
    for j in range(n):
        if j:
            counts[draft[j - 1]] += 1
        row = out[j]
        if params.min_tokens and len(output) + j < params.min_tokens and not params.ignore_eos:
            for e in eos:
                row[e] = -np.inf
        if params.logit_bias:
            row += bias
        if params.repetition_penalty != 1.0:
            seen = seen_prompt | (counts > 0)
            r = np.float32(params.repetition_penalty)
            row[:] = np.where(seen, np.where(row > 0, row / r, row * r), row)
        if params.frequency_penalty or params.presence_penalty:
            row -= np.float32(params.frequency_penalty) * counts + np.float32(params.presence_penalty) * (counts > 0)
    return out


def probabilities(logits: torch.Tensor | np.ndarray, params: SamplingParams) -> np.ndarray:
    """(N, V) logits → (N, V) fp32 probabilities after temperature, top-k and top-p (sampling only)."""
    a = host(logits)
    z = a.reshape(-1, a.shape[-1]) / np.float32(params.temperature)
    vocab = z.shape[-1]
    if params.top_k and params.top_k < vocab:
        kth = np.partition(z, vocab - params.top_k, axis=-1)[:, vocab - params.top_k][:, None]
        z = np.where(z < kth, np.float32(-np.inf), z)
    z = z - z.max(axis=-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        for row in probs:
            _nucleus(row, params.top_p)
    return probs


def _nucleus(p: np.ndarray, top_p: float, first: int = 1024) -> None:
    """Keep (in place) the most likely tokens until the mass before a token reaches top_p; the first always stays.
    Sorts only the `first` most likely tokens when they hold top_p of the mass (exact either way); ties by id."""
    idx = np.argpartition(-p, min(first, p.shape[0]) - 1)[:first] if p.shape[0] > first else np.arange(p.shape[0])
    if float(p[idx].sum(dtype=np.float64)) < top_p:
        idx = np.arange(p.shape[0])
    order = idx[np.lexsort((idx, -p[idx]))]
    sorted_p = p[order].astype(np.float64)
    keep = order[(np.cumsum(sorted_p) - sorted_p) < top_p]
    kept = p[keep]
    p[:] = 0.0
    p[keep] = kept / kept.sum()


def log_distribution(logits: torch.Tensor | np.ndarray, params: SamplingParams) -> np.ndarray:
    """(N, V) adjusted logits → log of the distribution a token is drawn from: log-softmax of the logits when greedy,
    of the temperature/top-k/top-p distribution when sampling (−inf outside its support). What `logprobs` report."""
    if params.greedy:
        z = host(logits)
        z = z - z.max(axis=-1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    with np.errstate(divide="ignore"):
        return np.log(probabilities(logits, params))


def gumbel_argmax(log_probs: np.ndarray, noise: np.ndarray) -> int:
    """argmax(log π + G): an exact draw from π when G is standard Gumbel noise (the Gumbel-max trick)."""
    return int(np.argmax(log_probs + noise))


def top_logprobs(row: np.ndarray, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log probability in a (V,) log distribution and the n most likely tokens, most likely
    first (ties by id; a −inf one is left out: it could not have been chosen)."""
    chosen = float(row[token])
    if not n:
        return chosen, []
    n = min(n, row.shape[-1])
    idx = np.argpartition(-row, n - 1)[:n]
    idx = idx[np.lexsort((idx, -row[idx]))]
    return chosen, [(int(i), float(row[i])) for i in idx if math.isfinite(float(row[i]))]


def greedy(logits: torch.Tensor | np.ndarray) -> list[int]:
    """Argmax of each row of (N, V) logits (first index on ties), in numpy on the host (see `host`)."""
    if isinstance(logits, torch.Tensor) and logits.device.type != "cpu":
        return logits.reshape(-1, logits.shape[-1]).argmax(-1).tolist()
    a = host(logits)
    return a.reshape(-1, a.shape[-1]).argmax(-1).tolist()


def draw(probs: torch.Tensor | np.ndarray, u: float) -> int:
    """The token whose cumulative-probability interval holds u ∈ [0, 1) (inverse CDF) of a (V,) distribution: with
    u from a counter-based stream, an exact and reproducible draw."""
    p = host(probs)
    cdf = np.cumsum(p, dtype=np.float64)
    return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), p.shape[-1] - 1)  # first i with cdf[i] > x
