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
