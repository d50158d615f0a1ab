"""Counter-based randomness: every random number a request uses is a pure function of (seed, stream, position, use).

A shared generator's state depends on how many numbers were drawn before, which under speculation depends on how many
tokens were drafted and so on adaptive k, the batch and timings: the same seed would not give the same output twice.
Here each draw is Philox-4x64 (a counter-based generator) keyed by (seed, stream) at counter (position, use):
`stream` tells the choices of one request apart (`n` > 1), `position` is the output token's index, and `use` keeps
the draws for different purposes (the Gumbel noise of coupled sampling, rejection's uniforms, a drafter's own) apart.
"""

from __future__ import annotations

import os

import numpy as np

GUMBEL, ACCEPT, RESIDUAL, BONUS, DRAFT = range(5)  # the `use` of a draw
SEED_LIMIT = 2**63  # seeds are 0 ≤ seed < 2**63 (OpenAI's range is int64)
_KEEP = 24  # Gumbel rows kept per request (a draft and its verification read the same positions)


def fresh_seed() -> int:
    """A random seed for a request that gave none (recorded in its result, so the output can be reproduced)."""
    return int.from_bytes(os.urandom(6), "little")


class Noise:
    """The random numbers of one sequence: (seed, stream) → a deterministic draw per (position, use)."""

    def __init__(self, seed: int, stream: int = 0):
        self.seed, self.stream = int(seed), int(stream)
        self._key = np.array([self.seed, self.stream], dtype=np.uint64)
        self._gumbel: dict[int, np.ndarray] = {}

    def _rng(self, position: int, use: int) -> np.random.Generator:
        counter = np.array([position, use, 0, 0], dtype=np.uint64)
        return np.random.Generator(np.random.Philox(key=self._key, counter=counter))

    def uniforms(self, position: int, use: int, n: int = 1) -> np.ndarray:
        """n uniforms in [0, 1) for (position, use), float64."""
        return self._rng(position, use).random(n)

    def gumbel(self, position: int, vocab: int) -> np.ndarray:
        """Standard Gumbel noise (vocab,) float32 for the token at output `position`: the same vector every time it
        is asked for, so a draft and its verification, or two runs with the same seed, see the same noise."""
        g = self._gumbel.get(position)
        if g is None or g.shape[0] != vocab:
            u = self._rng(position, GUMBEL).random(vocab, dtype=np.float32)
            with np.errstate(divide="ignore"):
                g = -np.log(-np.log(u))  # u = 0 gives −inf: that token is never chosen, as for p = 0
            self._gumbel[position] = g
            if len(self._gumbel) > _KEEP:
                del self._gumbel[min(self._gumbel)]
        return g
