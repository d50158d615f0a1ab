"""Drafting with a model: an independent small model, an int8 copy of the target, or the target's own layers.

The drafter keeps its own KV cache, one row per engine slot, and remembers which tokens it holds per slot. At
each call it feeds what it has not seen (the prompt on the first call; afterwards the accepted tokens and the
recovered or bonus one), then samples k tokens one at a time with the request's own sampling settings, keeping the
distribution of each (q for rejection sampling). A rejected token's cache entries are simply written over next time.
Catching up alone on a long run of unseen tokens (a new prompt, or the output since drafting was last on) is a
one-off, not what a drafted token costs: `one_off_seconds` and `one_off_tokens` tell the engine's cost model to leave
it out and what catching up costs per token, and `lag` tells the engine how much a row would have to catch up on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from specwise.engine.cache import CausalLM
from specwise.engine.draft_vocab import DraftVocab
from specwise.engine.drafters.base import Draft, SequenceView
from specwise.engine.noise import DRAFT
from specwise.engine.sampling import draw, greedy, gumbel_argmax, probabilities

S = TypeVar("S")
LONG_CATCH_UP = 16  # a row with more unseen tokens than this (a new prompt) is fed alone, not padded into a batch


def choose(seq: SequenceView, logits: torch.Tensor, drafted: int) -> tuple[int, np.ndarray | None]:
    """The next draft token from full-vocabulary logits, and the distribution q it was drawn from: with the target's
    Gumbel noise for that output position under coupled verification (so it agrees with the target's draw as often
    as q allows), with the drafter's own counter-based uniform under rejection sampling."""
    if seq.params.greedy:
        return greedy(logits)[0], None
    q = probabilities(logits[None], seq.params)[0]  # (V,), numpy on the host (sampling.host says why)
    position = len(seq.token_ids) - seq.prompt_len + drafted
    if seq.verify == "coupled":
        with np.errstate(divide="ignore"):
            token = gumbel_argmax(np.log(q), seq.noise.gumbel(position, q.shape[-1]))
    else:
        token = draw(q, float(seq.noise.uniforms(position, DRAFT)[0]))
    return token, q


def chain(
    seqs: list[SequenceView],
    ks: list[int],
    state: dict[int, S],
    pick: Callable[[SequenceView, S, int], tuple[int, np.ndarray | None]],
    step: Callable[[list[int], list[Draft], dict[int, S]], dict[int, S]],
) -> list[Draft]:
    """Autoregressive drafting, one token at a time: `state` holds each drafting row's first model output, `pick`
    turns a row's output into its next token (and q), `step(wanting, drafts, state)` runs the model one token further
    for the rows that still want more — until each row i has ks[i] tokens. Rows without a state draft nothing."""
    drafts = [Draft([], None) for _ in seqs]
    probs: list[list[np.ndarray]] = [[] for _ in seqs]
    while state:
        for i, out in state.items():
            token, q = pick(seqs[i], out, len(drafts[i].tokens))
            drafts[i].tokens.append(token)
            if q is not None:
                probs[i].append(q)
        wanting = [i for i in state if len(drafts[i].tokens) < ks[i]]
        state = step(wanting, drafts, state) if wanting else {}
    for d, p in zip(drafts, probs, strict=True):
        if p:
            d.probs = torch.from_numpy(np.stack(p))  # (k, V)
    return drafts


class ModelDrafter:
    """Autoregressive drafting with `model` (anything with our decoder's forward/new_cache)."""

    def __init__(
        self, model: CausalLM, name: str, num_slots: int, cache_len: int, extra_weight_bytes: int, identity=None
    ):
        self.model, self.name = model, name
        self.vocab = model if isinstance(model, DraftVocab) else None  # a reduced draft vocabulary, or every id
        self.identity = identity  # a ModelIdentity for an independent draft model; None when derived from the target
        self.cache = model.new_cache(num_slots, cache_len)
        self.seen: dict[int, list[int]] = {}  # slot → tokens whose keys/values the draft cache holds, in order
        self._extra_weights = extra_weight_bytes
        self.device = model.device
        self.one_off_seconds = 0.0  # of the last propose: catching up alone on a new prompt or a long gap
        self.one_off_tokens = 0  # … and how many tokens that was

    def extra_memory_bytes(self) -> int:
        return self._extra_weights + self.cache.nbytes()

    def provenance(self, target_sha256: str) -> dict:
        if self.identity is not None:
            out = self.identity.to_dict()
        else:
            out = {"name": self.name, "derived_from": target_sha256}
        if self.vocab is not None:
            v = self.vocab
            out["draft_vocab"] = {"first_ids": v.size, "special_ids": len(v.always), "prompt_ids": True}
        return out

    def admit(self, slot: int, prompt_ids: list[int]) -> None:
        """A new request in `slot`: a reduced vocabulary also scores its prompt's ids."""
        if self.vocab is not None:
            self.vocab.admit(slot, prompt_ids)

    def release(self, slot: int) -> None:
        self.seen.pop(slot, None)
        if self.vocab is not None:
            self.vocab.release(slot)

    def _unseen(self, seq: SequenceView) -> int:
        """Length of the prefix of seq.token_ids the cache already holds (never the last token: we need its logits)."""
        seen, toks = self.seen.get(seq.slot, []), seq.token_ids
        n = min(len(seen), len(toks) - 1)
        # Asked every step for every drafting row (and by the engine's catch-up hold): the lists agree but for the
        # last draft's rejected tokens, so compare in C up to a short tail, and step through the tail alone.
        i = max(0, n - 2 * LONG_CATCH_UP)
        if seen[:i] != toks[:i]:
            i = 0
        while i < n and seen[i] == toks[i]:
            i += 1
        return i

    def lag(self, seq: SequenceView) -> int:
        """Tokens of `seq` this drafter must feed its cache before it can draft for it."""
        return len(seq.token_ids) - self._unseen(seq)

    def _forward(self, rows: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """rows of (slot, tokens, start position) → each row's last-token logits (B, V), in one pass."""
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        for slot, toks, start in rows:
            tokens += toks
            positions += range(start, start + len(toks))
            slots += [slot] * len(toks)
            last.append(len(tokens) - 1)
        dev = self.device
        return self.model.forward_tokens(
            self.cache,
            torch.tensor(tokens, device=dev),
            torch.tensor(positions, device=dev),
            torch.tensor(slots, device=dev),
            torch.tensor(last),
        )

    def propose(self, seqs: list[SequenceView], ks: list[int]) -> list[Draft]:
        active = [i for i, k in enumerate(ks) if k > 0]
        # 1. Catch up on unseen tokens; new prompts alone, the rest batched.
        pending = {}
        for i in active:
            seq = seqs[i]
            if self.vocab is not None and not self.vocab.admitted(seq.slot):
                self.vocab.admit(seq.slot, seq.token_ids[: seq.prompt_len])
            start = self._unseen(seq)
            pending[i] = (seq.slot, seq.token_ids[start:], start)
            self.seen[seq.slot] = list(seq.token_ids[:start])
        long_rows = [i for i in active if len(pending[i][1]) > LONG_CATCH_UP]
        groups = [[i] for i in long_rows] + [[i for i in active if i not in long_rows]]
        last_logits: dict[int, torch.Tensor] = {}
        self.one_off_seconds, self.one_off_tokens = 0.0, 0
        for group in groups:
            if group:
                t0 = time.perf_counter()
                for i, row in zip(group, self._forward([pending[i] for i in group]), strict=False):
                    last_logits[i] = row
                if len(group) == 1 and group[0] in long_rows:
                    self.one_off_seconds += time.perf_counter() - t0
                    self.one_off_tokens += len(pending[group[0]][1])
        for i in active:
            self.seen[seqs[i].slot] += pending[i][1]

        # 2. Draft one token at a time for the rows that still want more.
        def step(wanting: list[int], drafts: list[Draft], _: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
            rows = [(seqs[i].slot, [drafts[i].tokens[-1]], len(self.seen[seqs[i].slot])) for i in wanting]
            out = dict(zip(wanting, self._forward(rows), strict=False))
            for i in wanting:
                self.seen[seqs[i].slot].append(drafts[i].tokens[-1])
            return out

        return chain(seqs, ks, last_logits, choose, step)
