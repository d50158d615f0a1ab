"""The one speculation-counts type: each formula checked against counts worked out by hand, and both
serialisations round-trip."""

import pytest

from specwise.speccounts import SpecCounts


def three_steps() -> SpecCounts:
    c = SpecCounts()
    c.observe_step(drafted=4, accepted=4, drafting_time=0.1, verification_time=0.9)  # all kept (+ bonus)
    c.observe_step(drafted=3, accepted=1, drafting_time=0.1, verification_time=0.9)  # rejected at position 2
    c.observe_step(drafted=0, accepted=0, drafting_time=0.0, verification_time=1.0)  # nothing drafted
    return c


def test_counts_by_hand():
    c = three_steps()
    assert (c.steps, c.drafted, c.accepted, c.rejections) == (3, 7, 5, 1)
    assert c.drafted_per_position == [2, 2, 2, 1] and c.accepted_per_position == [2, 1, 1, 1]


def test_formulas_by_hand():
    c = three_steps()
    assert c.acceptance_rate == pytest.approx(5 / 7)
    assert c.mean_acceptance_length == pytest.approx((5 + 3) / 3)  # one target token per step besides the accepted
    assert c.token_acceptance == pytest.approx(5 / 6)  # 5 accepted, 1 rejected position judged
    assert c.acceptance_by_position == pytest.approx([1.0, 0.5, 0.5, 1.0])
    assert c.drafting_share == pytest.approx(0.2 / 3.0)
    assert c.speedup_estimate == pytest.approx(8 / 3 * (1 - 0.2 / 3.0))


def test_empty_counts_have_no_figures():
    c = SpecCounts()
    assert c.acceptance_rate is None and c.mean_acceptance_length is None and c.token_acceptance is None
    assert c.drafting_share is None and c.speedup_estimate is None and c.acceptance_by_position == []
    plain = SpecCounts(steps=5)  # decoded without drafting: one token a step, no acceptance to speak of
    assert plain.mean_acceptance_length == 1.0 and plain.acceptance_rate is None and plain.speedup_estimate is None


def test_pooling_equals_observing_every_step_in_one():
    a, b = SpecCounts(), SpecCounts()
    a.observe_step(5, 2, 0.01, 0.2)
    b.observe_step(2, 2, 0.02, 0.3)
    b.observe_step(1, 0, 0.0, 0.1)
    one = SpecCounts()
    for args in ((5, 2, 0.01, 0.2), (2, 2, 0.02, 0.3), (1, 0, 0.0, 0.1)):
        one.observe_step(*args)
    pooled = SpecCounts.pooled([a, b])
    assert _same(pooled, one)
    assert a.drafted_per_position == [1, 1, 1, 1, 1]  # pooling did not alter its parts


def _same(x: SpecCounts, y: SpecCounts) -> bool:
    dx, dy = x.to_dict(), y.to_dict()
    assert dx.keys() == dy.keys()
    for k in dx:
        assert dx[k] == pytest.approx(dy[k]), k
    return True


def test_serialisations_round_trip_and_differ_in_names():
    c = three_steps()
    assert _same(SpecCounts.from_dict(c.to_dict()), c)
    usage = c.to_usage()
    assert usage["verification_steps"] == 3 and usage["drafted_tokens"] == 7 and usage["accepted_tokens"] == 5
    assert usage["acceptance_rate"] == pytest.approx(5 / 7)
    assert _same(SpecCounts.from_usage(usage), c)
    assert _same(SpecCounts.from_dict(None), SpecCounts()) and _same(SpecCounts.from_usage({}), SpecCounts())


def test_a_subclass_reduces_to_its_counts():
    from specwise.engine.request_stats import RequestStats

    s = RequestStats()
    s.observe_step(2, 1)
    assert type(s.counts()) is SpecCounts and _same(s.counts(), SpecCounts(1, 2, 1, 1, [1, 1], [1]))
