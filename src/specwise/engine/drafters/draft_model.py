"""Drafting with a model: an independent small model, an int8 copy of the target, or the target's own layers.

The drafter keeps its own KV cache, one row per engine slot, and remembers which tokens it holds per slot. At
each call it feeds what it has not seen (the prompt on the first call; afterwards the accepted tokens and the
recovered or bonus one), then samples k tokens one at a time with the request's own sampling settings, keeping the
distribution of each (q for rejection sampling). A rejected token's cache entries are simply written over next time.
Each pass also feeds a guess of how the draft goes on — the text's own continuation of its last n-gram, as the
n-gram drafter would propose — and the draft takes the logits after each guessed token for as long as it picks that
token: the same drafts and distributions as one token at a time (a row's logits do not depend on the rows beside
it), in one pass instead of k when the draft copies, as it does in edits.
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
from specwise.engine.draft_length import CATCH_UP_FREE
from specwise.engine.draft_vocab import DraftVocab
from specwise.engine.drafters.base import Draft, SequenceView
from specwise.engine.drafters.ngram import lookup
from specwise.engine.noise import DRAFT
from specwise.engine.sampling import draw, greedy, gumbel_argmax, host, probabilities

S = TypeVar("S")
# A row with more unseen tokens than this (a new prompt) is fed alone, not padded into a batch: the same number as
# the engine's and the replay's catch-up that costs nothing apart (a shorter gap is priced inside the drafting).
LONG_CATCH_UP = CATCH_UP_FREE
GUESS_NGRAM = 3  # the longest n-gram a guess of the draft's continuation matches (ngram.lookup)


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


def confidence(logits: torch.Tensor | np.ndarray) -> np.ndarray:
    """The probability a draft gives its greedy token after each row of (..., V) logits: softmax's largest value,
    in numpy (`sampling.host`). The drafter's stop and the replay's (`replay.greedy_guesses`) both read it here."""
    a = host(logits)
    return 1.0 / np.exp(a - a.max(-1, keepdims=True)).sum(-1)


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
        self,
        model: CausalLM,
        name: str,
        num_slots: int,
        cache_len: int,
        extra_weight_bytes: int,
        identity=None,
        repacked: str | None = None,
        guess: bool = True,
    ):
        self.model, self.name = model, name
        self.guess = guess  # feed a guess of the draft's continuation with each pass (the same drafts, fewer passes)
        self.vocab = model if isinstance(model, DraftVocab) else None  # a reduced draft vocabulary, or every id
        self.identity = identity  # a ModelIdentity for an independent draft model; None when derived from the target
        self.repacked = repacked  # the precision its layers were re-packed in (weights.repacked); None: as stored
        self.cache = model.new_cache(num_slots, cache_len)
        self.seen: dict[int, list[int]] = {}  # slot → tokens whose keys/values the draft cache holds, in order
        self._extra_weights = extra_weight_bytes
        self.device = model.device
        self.one_off_seconds = 0.0  # of the last propose: catching up alone on a new prompt or a long gap
        self.one_off_tokens = 0  # … and how many tokens that was
        self.passes = 0  # of the last propose: its drafting passes (k a row without guesses; fewer with them)

    def extra_memory_bytes(self) -> int:
        return self._extra_weights + self.cache.nbytes()

    def provenance(self, target_sha256: str) -> dict:
        if self.identity is not None:
            out = self.identity.to_dict()
        else:
            out = {"name": self.name, "derived_from": target_sha256}
        if self.repacked is not None:
            out["layers_repacked"] = self.repacked
        if self.vocab is not None:
            v = self.vocab
            out["draft_vocab"] = {"first_ids": v.size, "special_ids": len(v.always), "prompt_ids": True}
        return out

    def admit(self, slot: int, prompt_ids: list[int]) -> None:
        """A new request in `slot`: a reduced vocabulary also scores its prompt's ids."""
        if self.vocab is not None:
            self.vocab.admit(slot, prompt_ids)

    def release(self, slot: int, keep: bool = False) -> None:
        if not keep:
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

    def _forward(self, rows: list[tuple[int, list[int], int]], outs: list[list[int]] | None = None) -> list:
        """rows of (slot, tokens, start position) → each row's logits at its offsets outs[i] (default: its last
        token), (len(outs[i]), V) per row, in one pass."""
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        picks: list[int] = []
        counts: list[int] = []
        for r, (slot, toks, start) in enumerate(rows):
            at = [len(toks) - 1] if outs is None else outs[r]
            picks += [len(tokens) + a for a in at]
            counts.append(len(at))
            tokens += toks
            positions += range(start, start + len(toks))
            slots += [slot] * len(toks)
        dev = self.device
        logits = self.model.forward_tokens(
            self.cache,
            torch.tensor(tokens, device=dev),
            torch.tensor(positions, device=dev),
            torch.tensor(slots, device=dev),
            torch.tensor(picks),
        )
        return list(torch.split(logits, counts))

    def propose(self, seqs: list[SequenceView], ks: list[int]) -> list[Draft]:
        active = [i for i, k in enumerate(ks) if k > 0]
        drafts = [Draft([], None) for _ in seqs]
        probs: list[list[np.ndarray]] = [[] for _ in seqs]
        # 1. Catch up on unseen tokens; new prompts alone (a one-off), the rest batched with their first guesses.
        feed: dict[int, tuple[list[int], int]] = {}  # row → (tokens to feed, the position of the first)
        for i in active:
            seq = seqs[i]
            if self.vocab is not None and not self.vocab.admitted(seq.slot):
                self.vocab.admit(seq.slot, seq.token_ids[: seq.prompt_len])
            start = self._unseen(seq)
            feed[i] = (list(seq.token_ids[start:]), start)
            self.seen[seq.slot] = list(seq.token_ids[:start])
        self.one_off_seconds, self.one_off_tokens, self.passes = 0.0, 0, 0
        for i in [i for i in active if len(feed[i][0]) > LONG_CATCH_UP]:
            t0 = time.perf_counter()
            toks, start = feed.pop(i)
            logits = self._forward([(seqs[i].slot, toks, start)], [[len(toks) - 1]])[0]
            self.seen[seqs[i].slot] += toks
            self.one_off_seconds += time.perf_counter() - t0
            self.one_off_tokens += len(toks)
            self._walk(seqs[i], ks[i], logits, [], drafts[i], probs[i])
            if len(drafts[i].tokens) < ks[i] and not drafts[i].stopped:
                feed[i] = ([drafts[i].tokens[-1]], len(self.seen[seqs[i].slot]))
        # 2. Draft: each pass feeds a row's unseen tokens and then a guess of how the draft goes on (the text's own
        # continuation of its last n-gram, ngram.lookup); the guess's logits are the draft's next steps for as long
        # as the draft picks the guessed tokens, so a draft that copies costs one pass, not one per token.
        while feed:
            rows = list(feed)
            self.passes += 1
            # Alone, a guess's rows are nearly free (the pass streams the draft's weights anyway); beside other rows
            # they are not (a batch of 4 with guesses: 0.93x plain on the edits, against 0.99x without).
            guesses = {i: self._guess(seqs[i], drafts[i].tokens, ks[i]) if len(rows) == 1 else [] for i in rows}
            outs = self._forward(
                [(seqs[i].slot, feed[i][0] + guesses[i], feed[i][1]) for i in rows],
                [list(range(len(feed[i][0]) - 1, len(feed[i][0]) + len(guesses[i]))) for i in rows],
            )
            nxt = {}
            for i, logits in zip(rows, outs, strict=True):
                slot = seqs[i].slot
                self.seen[slot] += feed[i][0]
                used = self._walk(seqs[i], ks[i], logits, guesses[i], drafts[i], probs[i])
                self.seen[slot] += guesses[i][:used]  # the guessed tokens the draft took: their entries are its own
                if len(drafts[i].tokens) < ks[i] and not drafts[i].stopped:
                    nxt[i] = ([drafts[i].tokens[-1]], len(self.seen[slot]))
            feed = nxt
        for d, p in zip(drafts, probs, strict=True):
            if p:
                d.probs = torch.from_numpy(np.stack(p))  # (k, V)
        return drafts

    def _guess(self, seq: SequenceView, drafted: list[int], k: int) -> list[int]:
        """Up to k − len(drafted) − 1 tokens the draft may go on with: the continuation of the latest earlier
        occurrence of the text's last n-gram (n = 3 down to 2), as the n-gram drafter proposes."""
        want = k - len(drafted) - 1
        if want <= 0 or not self.guess:
            return []
        return lookup(np.asarray(seq.token_ids + drafted), want, GUESS_NGRAM, 2)

    @staticmethod
    def _walk(
        seq: SequenceView, k: int, logits: torch.Tensor, guess: list[int], draft: Draft, probs: list[np.ndarray]
    ) -> int:
        """Draft tokens from logits (row j: the draft's next distribution after guess[:j]) while the draft picks
        the guessed token; the number of guessed tokens it took. Where the row has a draft floor, drafting stops
        after a token the draft gave less probability than the floor: that token is still proposed (its pass is
        paid), no further pass runs."""
        j = 0
        floor = seq.draft_floor
        while len(draft.tokens) < k:
            token, q = choose(seq, logits[j], len(draft.tokens))
            draft.tokens.append(token)
            if q is not None:
                probs.append(q)
            if floor > 0 and float(q[token] if q is not None else confidence(logits[j])) < floor:
                draft.stopped = True
                break
            if j < len(guess) and token == guess[j] and j + 1 < len(logits):
                j += 1
            else:
                break
        return j
