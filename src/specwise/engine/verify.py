"""Verification of a draft against one target pass (Leviathan et al. 2023, Chen et al. 2023).

A drafter proposes k draft tokens d1..dk. The target scores the pending token and the draft in one pass, giving
k+1 distributions p1..p(k+1): p(i) is the target's distribution for the position of di, p(k+1) for the position
after the whole draft.

- accepted tokens: the longest prefix d1..dn that verification keeps.
- recovered token: on the first rejection (n < k), the token sampled in place of d(n+1) — the target's argmax
  (greedy) or a draw from norm(max(0, p − q)) (sampling).
- bonus token: when all k are accepted, one more token drawn from p(k+1) — for free, from the same pass.
- output tokens: the accepted tokens followed by the recovered or bonus token; every step emits n + 1 ≥ 1 tokens.

Greedy: di is accepted while it equals argmax p(i). Sampling: di is accepted with probability min(1, p(di)/q(di)),
where q is the draft's distribution; a drafter without probabilities (n-gram lookup) is a one-hot q, for which
the rule is: accept with probability p(di). Either way the output is distributed exactly as the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def rejection_verify(
    draft: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """Exact speculative sampling. draft_probs (k, V) or None for one-hot drafts; target_probs (k+1, V)."""
    k = len(draft)
    assert target_probs.shape[0] == k + 1, "need one target distribution per draft token, plus one"
    if k:
        idx = torch.arange(k, device=target_probs.device)
        tok = torch.tensor(draft, device=target_probs.device)
        p = target_probs[idx, tok]  # (k,) target probability of each draft token
        q = draft_probs[idx, tok] if draft_probs is not None else torch.ones_like(p)  # (k,)
        u = torch.rand(k, generator=generator, device=target_probs.device)
        rejected = (u * q >= p).nonzero()  # accept di iff u < p/q, i.e. u·q < p
        if len(rejected):
            n = int(rejected[0, 0])
            residual = target_probs[n].clone()
            if draft_probs is not None:
                residual = torch.clamp(residual - draft_probs[n], min=0.0)
            else:
                residual[draft[n]] = 0.0  # max(0, p − onehot(dn))
            total = residual.sum()
            # Only float error can empty the residual (p == q); then p itself is the right distribution.
            residual = residual / total if total > 0 else target_probs[n]
            return Verdict(n, int(torch.multinomial(residual, 1, generator=generator)), RECOVERED)
    bonus = torch.multinomial(target_probs[k], 1, generator=generator)
    return Verdict(k, int(bonus), BONUS)
