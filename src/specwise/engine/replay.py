"""Acceptance replayed from an output the target already produced, instead of re-running speculation.

Greedy and coupled verification keep a speculative output equal to plain decoding's, token for token, so a draft's
fate at each step is fixed by that output alone: the drafter proposes from the tokens committed so far, the longest
prefix equal to the output's next tokens is accepted, and the step commits it plus one token. Walking a baseline
output that way — asking the real drafter, with the engine's own draft-length rule (never past `max_new_tokens` or
the cache) — gives exactly the counts a speculative run with a fixed k records (`SpecCounts`), without one target
pass. Where the output stopped early (EOS, a stop string) a last draft that reaches past its end may have had more
accepted than the output shows: such steps are counted in `open_steps`, the replayed count there a lower bound.

Exact for model-free drafters (n-gram; suffix with its history replayed in the order requests finished) and for a
draft model at temperature 0. Not exact for rejection-sampled runs, whose outputs depend on the drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specwise.engine.drafters.base import Drafter
from specwise.engine.noise import Noise
from specwise.engine.sampling import SamplingParams
from specwise.speccounts import SpecCounts


@dataclass
class ReplayView:
    """A sequence as a drafter sees it (`SequenceView`), growing by the replayed output's tokens."""

    slot: int
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams = field(default_factory=SamplingParams)
    noise: Noise = field(default_factory=lambda: Noise(0))
    verify: str = "coupled"
    history: bool = True
    tenant: str = ""


@dataclass
class Replayed:
    """What speculation with one drafter and k would have done for one output."""

    counts: SpecCounts  # steps, drafted, accepted, per position; drafting_time is what the drafter took here
    open_steps: int = 0  # steps whose draft reached past the output's end: their accepted count is a lower bound
    tokens: int = 0  # output tokens replayed


def replay(
    drafter: Drafter,
    prompt_ids: list[int],
    output_ids: list[int],
    k: int,
    max_new_tokens: int,
    max_len: int,
    slot: int = 0,
    history: bool = True,
) -> Replayed:
    """Walk `output_ids` (the first came from the prefill) as a speculative run with draft length `k` would, asking
    `drafter` at every step; the drafter's slot is released at the end, as the engine does when a request finishes
    (so a suffix drafter's history grows as it would have)."""
    counts, open_steps = SpecCounts(), 0
    n = len(output_ids)
    view = ReplayView(slot, [*prompt_ids, *output_ids[:1]], len(prompt_ids), history=history)
    p = min(1, n)
    try:
        while p < n:
            room = min(max_len - len(view.token_ids), max_new_tokens - p) - 1
            ke = max(0, min(k, room))
            draft: list[int] = []
            spent = 0.0
            if ke > 0:
                t0 = time.perf_counter()
                draft = drafter.propose([view], [ke])[0].tokens[:ke]
                spent = time.perf_counter() - t0
            a = 0
            while a < len(draft) and p + a < n and draft[a] == output_ids[p + a]:
                a += 1
            open_steps += a < len(draft) and p + a >= n  # the output ended where the draft still went on
            counts.observe_step(len(draft), a, spent)
            view.token_ids += output_ids[p : p + a + 1]
            p += a + 1
    finally:
        drafter.release(slot)
    return Replayed(counts, open_steps, n)
