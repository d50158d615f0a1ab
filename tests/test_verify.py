"""Verification from hand-built logits and probabilities (vLLM's rejection-sampler cases)."""

import numpy as np
import pytest
import torch

from specwise.engine.noise import Noise
from specwise.engine.sampling import draw
from specwise.engine.verify import BONUS, RECOVERED, coupled_verify, greedy_verify, rejection_verify


def rv(draft, draft_probs, target, seed):
    """rejection_verify with the request's stream for `seed`; the bonus drawn from the last row."""
    noise = Noise(seed)
    k = len(draft)
    p = target.numpy()
    return rejection_verify(draft, draft_probs, p, noise, 0, lambda: draw(p[k], noise.uniforms(k, 9)[0]))


def onehot(ids, V=6):
    p = torch.zeros(len(ids), V)
    p[torch.arange(len(ids)), torch.tensor(ids)] = 1.0
    return p


def test_greedy_perfect_match_gets_bonus():
    v = greedy_verify([3, 1, 4], [3, 1, 4, 5])
    assert (v.accepted, v.token, v.kind) == (3, 5, BONUS)


def test_greedy_early_mismatch_recovers_target_token():
    v = greedy_verify([3, 1, 4], [3, 2, 4, 5])
    assert (v.accepted, v.token, v.kind) == (1, 2, RECOVERED)


def test_greedy_first_token_mismatch():
    v = greedy_verify([0, 1], [2, 1, 1])
    assert (v.accepted, v.token, v.kind) == (0, 2, RECOVERED)


def test_greedy_empty_draft_is_plain_decoding():
    v = greedy_verify([], [4])
    assert (v.accepted, v.token, v.kind) == (0, 4, BONUS)


def test_rejection_certain_target_accepts_matching_draft_and_samples_bonus():
    target = onehot([2, 3, 5])
    v = rv([2, 3], None, target, 0)  # one-hot draft, target agrees with certainty
    assert (v.accepted, v.token, v.kind) == (2, 5, BONUS)


def test_rejection_zero_target_probability_always_rejects_and_recovers_from_residual():
    target = torch.tensor([[0.0, 0.5, 0.5, 0, 0, 0], [1 / 6] * 6])
    for seed in range(20):
        v = rv([0], None, target, seed)
        assert v.accepted == 0 and v.kind == RECOVERED and v.token in (1, 2)


def test_rejection_recovered_token_never_the_rejected_onehot_draft():
    target = torch.tensor([[0.6, 0.4, 0, 0, 0, 0], [1 / 6] * 6])
    for seed in range(50):
        v = rv([0], None, target, seed)
        if v.kind == RECOVERED:
            assert v.token == 1  # residual max(0, p − onehot(0)) keeps only token 1


def test_rejection_with_draft_probs_uses_residual_p_minus_q():
    # q puts mass on 0 and 1, p on 1 and 2: after rejecting, only token 2 has p > q.
    target = torch.tensor([[0.0, 0.5, 0.5, 0, 0, 0], [1 / 6] * 6])
    draft_probs = torch.tensor([[0.5, 0.5, 0, 0, 0, 0]])
    for seed in range(50):
        v = rv([1], draft_probs, target, seed)
        assert v.kind == BONUS or v.token == 2


def test_rejection_acceptance_probability_is_p_over_q():
    target = torch.tensor([[0.3, 0.7, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]])
    draft_probs = torch.tensor([[0.6, 0.4, 0, 0, 0, 0]])  # p/q for token 0 = 0.5
    accepted = sum(rv([0], draft_probs, target, s).accepted for s in range(4000))
    assert accepted / 4000 == pytest.approx(0.5, abs=0.03)


def test_rejection_empty_draft_samples_target():
    target = torch.tensor([[0, 0, 0, 1.0, 0, 0]])
    v = rv([], None, target, 0)
    assert (v.accepted, v.token, v.kind) == (0, 3, BONUS)


def test_rejection_is_deterministic_for_a_seed():
    target = torch.softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), -1)
    runs = {rv([1, 2, 3], None, target, 7) for _ in range(5)}
    assert len(runs) == 1


def test_coupled_keeps_draft_tokens_equal_to_the_targets_draws_and_asks_no_further():
    asked = []

    def target_token(i):
        asked.append(i)
        return [3, 1, 2, 7][i]

    v = coupled_verify([3, 1, 4], target_token)
    assert (v.accepted, v.token, v.kind) == (2, 2, RECOVERED)
    assert asked == [0, 1, 2]  # the row after the mismatch is never drawn
    v = coupled_verify([3, 1, 2], lambda i: [3, 1, 2, 7][i])
    assert (v.accepted, v.token, v.kind) == (3, 7, BONUS)


def test_rejection_draws_depend_on_position_not_on_what_was_drawn_before():
    """Counter-based: the same (seed, position) gives the same uniform whatever was asked for before it."""
    a, b = Noise(5), Noise(5)
    b.uniforms(0, 1), b.uniforms(3, 2), b.gumbel(2, 10)
    assert a.uniforms(4, 1)[0] == b.uniforms(4, 1)[0]
    assert np.array_equal(a.gumbel(7, 50), b.gumbel(7, 50))
    assert not np.array_equal(a.gumbel(7, 50), a.gumbel(8, 50))  # and positions differ
    assert a.uniforms(4, 1)[0] != Noise(5, stream=1).uniforms(4, 1)[0]  # choices of n differ
