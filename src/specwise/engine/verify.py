"""Verification of a draft against one target pass (Leviathan et al. 2023, Chen et al. 2023).

A drafter proposes k draft tokens d1..dk. The target scores the pending token and the draft in one pass, giving
k+1 distributions p1..p(k+1): p(i) is the target's distribution for the position of di, p(k+1) for the position
after the whole draft.

- accepted tokens: the longest prefix d1..dn that verification keeps.
- recovered token: on the first rejection (n < k), the token sampled in place of d(n+1) — the target's argmax
  (greedy) or a draw from norm(max(0, p − q)) (sampling).
- bonus token: when all k are accepted, one more token drawn from p(k+1) — for free, from the same pass.
- output tokens: the accepted tokens followed by the recovered or bonus token; every step emits n + 1 ≥ 1 tokens.

Greedy: di is accepted while it equals argmax p(i). Sampling offers two exact methods:

- coupled (Gumbel-max): the target's token at a position is argmax(log p + G), G the request's Gumbel noise for that
  position (noise.py) — an exact draw from p, and the very token plain decoding with the same seed draws there. di is
  accepted while it equals that token, and the first that does not is replaced by it. The output is token for token
  plain decoding's, whatever the drafter or k. A one-hot draft is accepted with probability p(di), as by rejection
  sampling; a draft model proposing argmax(log q + G) with the same noise is accepted less often than 1 − TV(p, q).
- rejection (Leviathan et al.): di is accepted with probability min(1, p(di)/q(di)), q the draft's distribution (a
  one-hot q for drafters without probabilities: accept with probability p(di)); a rejection draws from
  norm(max(0, p − q)). Distributed exactly as the target, but which tokens come out depends on the draft.

Every random number comes from the request's counter-based stream at the position it decides, so a step uses the same
numbers however the batch, k or timings went.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specwise.engine.noise import ACCEPT, RESIDUAL, Noise
from specwise.engine.sampling import draw, host

BONUS = "bonus"
RECOVERED = "recovered"


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one draft: `accepted` draft tokens kept, then `token` (recovered or bonus)."""

    accepted: int
    token: int
    kind: str  # BONUS or RECOVERED


def greedy_verify(draft: list[int], target_argmax: list[int]) -> Verdict:
    """Keep the longest prefix of `draft` matching the target's argmax (k+1 entries), then one target token."""
    assert len(target_argmax) == len(draft) + 1, "need one target prediction per draft token, plus one"
    for i, token in enumerate(draft):
        if token != target_argmax[i]:
            return Verdict(i, target_argmax[i], RECOVERED)
    return Verdict(len(draft), target_argmax[len(draft)], BONUS)


def coupled_verify(draft: list[int], target_token: Callable[[int], int]) -> Verdict:
    """Keep draft tokens while they equal the target's own draw at their position (`target_token(i)`, the Gumbel-max
    token of row i), then that draw. Rows after the first mismatch are never asked for."""
    for i, token in enumerate(draft):
        t = target_token(i)
        if token != t:
            return Verdict(i, t, RECOVERED)
    return Verdict(len(draft), target_token(len(draft)), BONUS)


def rejection_verify(
    draft: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: np.ndarray,
    noise: Noise,
    position: int,
    bonus_token: Callable[[], int],
) -> Verdict:
    """Exact speculative sampling. draft_probs (k, V) or None for one-hot drafts; target_probs (k+1, V); `position`
    is the output index of d1; `bonus_token()` draws from p(k+1) as plain decoding would at that position."""
    k = len(draft)
    assert target_probs.shape[0] == k + 1, "need one target distribution per draft token, plus one"
    q_all = host(draft_probs) if draft_probs is not None else None
    for n, token in enumerate(draft):
        p = float(target_probs[n, token])
        q = float(q_all[n, token]) if q_all is not None else 1.0
        if noise.uniforms(position + n, ACCEPT)[0] * q < p:  # accept dn iff u < p/q
            continue
        if q_all is not None:
            residual = np.clip(target_probs[n] - q_all[n], 0.0, None)
        else:
            residual = target_probs[n].copy()
            residual[token] = 0.0  # max(0, p − onehot(dn))
        # Only float error can empty the residual (p == q); then p itself is the right distribution.
        if not float(residual.sum()) > 0:
            residual = target_probs[n]
        return Verdict(n, draw(residual, float(noise.uniforms(position + n, RESIDUAL)[0])), RECOVERED)
    return Verdict(k, bonus_token(), BONUS)
