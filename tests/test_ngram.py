"""Prompt-lookup proposals, table-driven."""

import numpy as np
import pytest

from specwise.engine.drafters.ngram import lookup


@pytest.mark.parametrize(
    "tokens, k, max_n, expected",
    [
        ([1, 2, 3, 4, 1, 2], 2, 3, [3, 4]),  # bigram [1, 2] seen before, followed by 3 4
        ([1, 2, 3, 4, 1, 2], 5, 3, [3, 4, 1, 2]),  # continuation runs to the end of the sequence
        ([5, 1, 2, 9, 7, 1, 2, 8, 1, 2], 1, 2, [8]),  # the latest match wins
        ([1, 2, 3], 3, 3, []),  # nothing repeats
        ([7, 7], 2, 3, [7]),  # unigram fallback
        ([1, 2, 3, 9, 2, 3, 5, 1, 2, 3], 2, 3, [9, 2]),  # trigram [1,2,3] beats the later bigram [2,3]
    ],
)
def test_lookup(tokens, k, max_n, expected):
    assert lookup(np.asarray(tokens), k, max_n, 1) == expected


def test_lookup_respects_min_ngram():
    assert lookup(np.asarray([4, 1, 5, 1]), 2, 3, 2) == []


def _every_window(tokens: np.ndarray, k: int, max_n: int, min_n: int) -> list[int]:
    """The definition, spelled out: compare every earlier window of each size with the sequence's suffix."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        hits = [i for i in range(len(tokens) - n) if list(tokens[i : i + n]) == list(tokens[len(tokens) - n :])]
        if hits:
            return tokens[hits[-1] + n : hits[-1] + n + k].tolist()
    return []


def test_lookup_equals_comparing_every_window_on_random_sequences():
    """The lookup narrows the positions holding the last token instead of comparing every window: the same
    continuation on short random sequences over small vocabularies (many repeats, many ties), every n range."""
    rng = np.random.default_rng(3)
    for _ in range(3000):
        tokens = rng.integers(0, int(rng.integers(1, 6)), int(rng.integers(0, 40)))
        lo, hi = sorted(int(x) for x in rng.integers(1, 5, 2))
        k = int(rng.integers(0, 6))
        assert lookup(tokens, k, hi, lo) == _every_window(tokens, k, hi, lo), (tokens.tolist(), k, hi, lo)
