"""The drafter protocol: propose up to k draft tokens per sequence, with probabilities where the drafter has them.

Drafters see the running sequences through `SequenceView`; a stateful drafter (one with its own model and cache)
keeps per-slot state and learns what was accepted from the sequence's committed tokens at the next call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specwise.engine.noise import Noise
from specwise.engine.sampling import SamplingParams


class SequenceView(Protocol):
    """What a drafter may read of a running sequence."""

    slot: int  # cache row of this sequence
    token_ids: list[int]  # prompt + committed output; the last one is not yet in the target's cache
    prompt_len: int  # token_ids[prompt_len:] is the output so far
    params: SamplingParams
    noise: Noise  # the request's counter-based random numbers, keyed by output position
    verify: str  # "coupled": draw with the target's Gumbel noise; "rejection": with the drafter's own uniforms
    history: bool  # may draft from, and add to, a drafter's cross-request history (suffix)
    tenant: str  # whose history: requests of different tenants never see each other's outputs
    draft_floor: float  # stop drafting after a token the draft gave less probability than this (0: never)


@dataclass
class Draft:
    """Draft tokens for one sequence; probs (len(tokens), V) are the distributions they were drawn from."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # None: deterministic proposals (one-hot q)
    stopped: bool = False  # it stopped short of k: the drafter gave its last token less than the row's draft_floor


class Drafter(Protocol):
    """Proposes draft tokens for a batch of sequences. A drafter may also set `one_off_seconds` and
    `one_off_tokens` after a propose: the part of its time that was one-off work (a draft model prefilling a new
    prompt) and over how many tokens, which the engine's cost model leaves out of what a drafted token costs (absent:
    none); and have `lag(seq)`: the tokens it must catch up on before it can draft for seq (absent: none)."""

    name: str

    def propose(self, seqs: list[SequenceView], ks: list[int]) -> list[Draft]:
        """At most ks[i] draft tokens for seqs[i] (fewer, even none, when it has nothing good to offer)."""
        ...

    def release(self, slot: int, keep: bool = False) -> None:
        """The sequence in `slot` finished; forget its state — except, with `keep`, what a cache of the drafter's own
        holds for the slot's tokens (the engine reuses a prompt's start: the next request that begins with them
        catches up from where they end)."""
        ...

    def extra_memory_bytes(self) -> int:
        """Memory the drafter adds beyond the target (weights it does not share, its own cache)."""
        ...

    def provenance(self, target_sha256: str) -> dict:
        """What the drafter's proposals come from, for run records and the request log: its own weights' identity,
        the target's hash when derived from the target's weights, or none (model-free)."""
        ...
