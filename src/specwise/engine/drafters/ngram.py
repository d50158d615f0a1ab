"""Prompt lookup / n-gram drafting: no model, just copying.

Find the most recent earlier occurrence of the sequence's last n tokens (n from `max_ngram` down to `min_ngram`)
in the prompt and the text generated so far, and propose the tokens that followed it. Free to run, and very good
on tasks whose answers reuse the input (rewriting, extraction, formatting).
"""

from __future__ import annotations

import numpy as np

from specwise.engine.drafters.base import Draft, SequenceView
from specwise.errors import SpecwiseError


def lookup(tokens: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to k tokens following the latest earlier match of the longest matching suffix n-gram.

    Only the earlier positions holding the last token can end a match, so those are found once and narrowed one
    token further back per n (a replay asks this at every step of every output: ~10x faster than comparing every
    window of the history)."""
    L = len(tokens)
    top = min(max_ngram, L - 1)
    if top < min_ngram:
        return []
    ends = np.flatnonzero(tokens[: L - 1] == tokens[L - 1])  # where an earlier n-gram could end
    for n in range(top, min_ngram - 1, -1):
        hits = ends[ends >= n - 1]
        for j in range(1, n):
            hits = hits[tokens[hits - j] == tokens[L - 1 - j]]
        if len(hits):
            start = int(hits[-1]) + 1  # continuation of the latest match
            return tokens[start : start + k].tolist()
    return []


class NgramDrafter:
    """Propose the continuation of the latest matching n-gram (one-hot proposals)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise SpecwiseError(f"n-gram sizes must satisfy 1 ≤ min ≤ max (got min={min_ngram}, max={max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.name = f"ngram:{max_ngram}" if max_ngram != 3 else "ngram"

    def propose(self, seqs: list[SequenceView], ks: list[int]) -> list[Draft]:
        out = []
        for seq, k in zip(seqs, ks, strict=False):
            tokens = lookup(np.asarray(seq.token_ids), k, self.max_ngram, self.min_ngram) if k > 0 else []
            out.append(Draft(tokens))
        return out

    def provenance(self, target_sha256: str) -> dict:
        return {"name": self.name, "derived_from": None}  # no weights: proposals come from the text alone

    def release(self, slot: int, keep: bool = False) -> None:
        pass

    def extra_memory_bytes(self) -> int:
        return 0
