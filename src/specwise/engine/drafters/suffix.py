"""Suffix drafting (after SuffixDecoding, arXiv 2411.04975): no model — continuations learned from text.

Two indexes of "which token followed this context", for contexts of 1..`depth` tokens, with counts:

- per request, over its prompt and output so far (updated with the new tokens only, each step);
- global, over the outputs of earlier requests drafted by this drafter (bounded: at most `max_tokens` tokens kept,
  the oldest outputs evicted, their counts taken back out), so traffic that repeats itself across requests — tool
  calls of the same shape, the same headings — is drafted from history.

Each step it matches the longest suffix of the context in each index and follows the most frequent continuation
token by token, stopping when the continuation's share of its context's counts falls below `min_share` (the draft
is as long as the match is confident: SuffixDecoding's adaptive speculation length, capped by the engine's k). The
longer of the two drafts is proposed. Proposals are deterministic (a point mass), like n-gram's, so verification
keeps greedy output equal to plain output and sampling exact.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from dataclasses import dataclass

from specwise.engine.drafters.base import Draft, SequenceView

DEPTH = 6  # longest context matched, in tokens
MIN_SHARE = 0.5  # stop drafting where the most frequent continuation has less than this share of its context
GLOBAL_MIN_MATCH = 2  # a global continuation needs this many context tokens matched (one token is too common)
HISTORY_TOKENS = 50_000  # the shared history's default bound (`suffix` = `suffix:50000`)


class SuffixIndex:
    """Next-token counts after every context of 1..depth tokens in the sequences added (optionally bounded)."""

    def __init__(self, depth: int = DEPTH, max_tokens: int | None = None):
        self.depth, self.max_tokens = depth, max_tokens
        self.next: dict[tuple[int, ...], dict[int, int]] = {}
        self.sequences: deque[list[int]] = deque()
        self.tokens = 0
        self.lock = threading.Lock()  # the server's engine thread writes; tests and /metrics may read

    def _count(self, seq: list[int], start: int, sign: int) -> None:
        for i in range(max(start, 1), len(seq)):
            tok = seq[i]
            for n in range(1, min(self.depth, i) + 1):
                ctx = tuple(seq[i - n : i])
                counts = self.next.setdefault(ctx, {})
                counts[tok] = counts.get(tok, 0) + sign
                if counts[tok] <= 0:
                    del counts[tok]
                    if not counts:
                        del self.next[ctx]

    def extend(self, seq: list[int], seen: int) -> None:
        """Count the continuations of `seq` that end after its first `seen` tokens (an append-only sequence)."""
        with self.lock:
            self._count(seq, seen, +1)

    def add(self, seq: list[int]) -> None:
        """Keep a whole sequence (an earlier request's output), evicting the oldest beyond `max_tokens`."""
        if len(seq) < 2 or self.max_tokens == 0:
            return
        if self.max_tokens is not None:
            seq = seq[-self.max_tokens :]
        with self.lock:
            self.sequences.append(seq)
            self.tokens += len(seq)
            self._count(seq, 1, +1)
            while self.max_tokens is not None and self.tokens > self.max_tokens:
                old = self.sequences.popleft()
                self.tokens -= len(old)
                self._count(old, 1, -1)

    def continuation(self, context: list[int], k: int, min_match: int = 1) -> list[int]:
        """Up to k tokens: from the longest matching suffix, the most frequent next token, while it is confident."""
        out: list[int] = []
        ctx = list(context[-self.depth :])
        with self.lock:
            while len(out) < k:
                for n in range(min(self.depth, len(ctx)), min_match - 1, -1):
                    counts = self.next.get(tuple(ctx[-n:])) if n > 0 else None
                    if counts:
                        tok, best = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))
                        break
                else:
                    return out
                if best < MIN_SHARE * sum(counts.values()):
                    return out
                out.append(tok)
                ctx = [*ctx, tok][-self.depth :]
        return out

    def nbytes(self) -> int:
        """Approximate memory of the index (dicts, tuples, ints)."""
        with self.lock:
            per_ctx = sys.getsizeof(()) + 8 * self.depth + sys.getsizeof({}) + 2 * sys.getsizeof(0)
            return len(self.next) * per_ctx + 8 * self.tokens


@dataclass
class _Slot:
    """A running request's state: its own index, how many of its tokens it counted, its token list (complete when it
    is released) and prompt length, and the shared history it may use (None: it opted out)."""

    index: SuffixIndex
    tokens: list[int]
    prompt_len: int
    shared: SuffixIndex | None
    seen: int = 0


class SuffixDrafter:
    """Suffix drafting over the request itself and the history of earlier requests (see the module docstring).

    The history is kept per tenant (`SequenceView.tenant`: the server passes the API key a request came with), so
    one client cannot probe another's outputs through the acceptance its drafts get; requests of one tenant share."""

    def __init__(self, max_tokens: int = HISTORY_TOKENS, depth: int = DEPTH):
        """`max_tokens` bounds each tenant's shared history; 0 turns it off (each request drafts from itself only)."""
        self.name = "suffix" if max_tokens == HISTORY_TOKENS else f"suffix:{max_tokens}"
        self.depth, self.max_tokens = depth, max_tokens
        self.histories: dict[str, SuffixIndex] = {}  # tenant → its history ("" when the server tells them apart not)
        self.local: dict[int, _Slot] = {}  # slot → its request's state

    def shared(self, tenant: str = "") -> SuffixIndex:
        """The history of `tenant` (created empty on first use)."""
        if tenant not in self.histories:
            self.histories[tenant] = SuffixIndex(self.depth, self.max_tokens)
        return self.histories[tenant]

    @property
    def history(self) -> SuffixIndex:
        """The history of requests that name no tenant."""
        return self.shared("")

    def history_tokens(self) -> int:
        """All tenants' history tokens, from a snapshot: /metrics reads this while the engine thread adds tenants."""
        return sum(h.tokens for h in tuple(self.histories.values()))

    def history_bytes(self) -> int:
        return sum(h.nbytes() for h in tuple(self.histories.values()))

    def propose(self, seqs: list[SequenceView], ks: list[int]) -> list[Draft]:
        out = []
        for seq, k in zip(seqs, ks, strict=False):
            tokens = seq.token_ids
            slot = self.local.get(seq.slot)
            if slot is None or slot.tokens is not tokens:  # a new request in this slot
                shared = self.shared(getattr(seq, "tenant", "")) if seq.history and self.max_tokens != 0 else None
                slot = self.local[seq.slot] = _Slot(SuffixIndex(self.depth), tokens, seq.prompt_len, shared)
            slot.index.extend(tokens, slot.seen)
            slot.seen = len(tokens)
            if k <= 0:
                out.append(Draft([]))
                continue
            mine = slot.index.continuation(tokens, k)
            theirs = slot.shared.continuation(tokens, k, GLOBAL_MIN_MATCH) if slot.shared is not None else []
            out.append(Draft(theirs if len(theirs) > len(mine) else mine))
        return out

    def release(self, slot: int, keep: bool = False) -> None:  # no cache of its own: nothing to keep
        """The request in `slot` finished: its output joins its tenant's history (only requests this drafter
        served; a request that opted out leaves nothing behind)."""
        state = self.local.pop(slot, None)
        if state is not None and state.shared is not None:
            state.shared.add(list(state.tokens[state.prompt_len :]))

    def extra_memory_bytes(self) -> int:
        return self.history_bytes() + sum(state.index.nbytes() for state in self.local.values())

    def provenance(self, target_sha256: str) -> dict:
        return {"name": self.name, "derived_from": None}  # no weights: proposals come from text alone
