"""Sizing drafts by what verifying costs: expected tokens per unit of forward cost."""

import itertools
import random

import pytest

from mlxd.scheduler_proc.speculation import (
    MARGIN, Acceptance, cost_of, expected_tokens, plan_lengths,
)
from mlxd.worker_proc.verify_cost import MOST_POSITIONS, cost_curve

# a compute-bound CPU's curve (steep) and a memory-bound one's (nearly flat)
STEEP = cost_of(cost_curve({1: 1.0, 2: 1.8, 4: 2.4, 8: 2.8, 16: 4.8, 32: 8.8}))
FLAT = cost_of(cost_curve({1: 1.0, 8: 1.1, 32: 1.6}))


def value(ks, rates, rows, cost):
    """Expected tokens per unit of cost of the rectangular verify forward."""
    return (rows + sum(expected_tokens(a, k) - 1 for a, k in zip(rates, ks))) / cost(
        rows * (1 + max(ks, default=0)))


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_the_cost_curve_is_relative_non_decreasing_and_linear_between_and_beyond():
    curve = cost_curve({1: 0.02, 2: 0.03, 8: 0.025, 16: 0.06})
    assert len(curve) == MOST_POSITIONS and curve[0] == 1.0
    assert all(b >= a for a, b in zip(curve, curve[1:]))
    assert curve[1] == pytest.approx(1.5) and curve[7] == pytest.approx(1.5)   # made monotone
    assert curve[11] == pytest.approx(1.5 + (3.0 - 1.5) / 2)                  # between 8 and 16
    assert curve[31] - curve[15] == pytest.approx(16 * (3.0 - 1.5) / 8)       # beyond 16
    assert cost_curve({1: 1.0}) == [float(n) for n in range(1, MOST_POSITIONS + 1)]
    extended = cost_of([1.0, 1.5])
    assert extended(4) == pytest.approx(2.5)


@pytest.mark.parametrize("cost", [STEEP, FLAT], ids=["steep", "flat"])
def test_a_lone_row_gets_the_best_length_or_none(cost):
    for rate in (0.0, 0.3, 0.6, 0.8, 0.9, 0.97, 1.0):
        (k,) = plan_lengths([12], [rate], 1, cost)
        best = max(range(13), key=lambda n: value([n], [rate], 1, cost))
        if value([best], [rate], 1, cost) > (1 + MARGIN) * value([0], [rate], 1, cost):
            assert k == best
        else:
            assert k == 0


def test_verifying_is_worth_more_where_it_costs_less():
    assert plan_lengths([8], [0.6], 1, STEEP) == [0]
    assert plan_lengths([8], [0.6], 1, FLAT)[0] > 0
    assert plan_lengths([8], [0.97], 1, STEEP)[0] >= 6


def test_a_batch_plan_is_never_worse_than_no_drafts_and_near_the_best():
    rng = random.Random(3)
    for _ in range(60):
        rows = rng.randint(1, 5)
        most = [rng.choice([0, 2, 4]) for _ in range(rng.randint(1, min(rows, 4)))]
        rates = [rng.random() for _ in range(rows)]
        cost = rng.choice([STEEP, FLAT])
        ks = plan_lengths(most, rates, rows, cost)
        assert all(0 <= k <= m for k, m in zip(ks, most))
        got = value(ks, rates, rows, cost)
        assert got >= value([0] * len(most), rates, rows, cost)
        best = max(value(list(c), rates, rows, cost)
                   for c in itertools.product(*(range(m + 1) for m in most)))
        assert got >= 0.97 * best


def test_a_full_batch_on_a_steep_curve_drafts_nothing_unless_nearly_sure():
    assert plan_lengths([8] * 32, [0.8] * 32, 32, STEEP) == [0] * 32
    assert plan_lengths([8] * 2, [0.9] * 2, 2, FLAT) != [0, 0]


def test_one_drafting_row_pays_for_the_whole_batch_width():
    """Its draft widens every row's forward: alone it drafts long, among many rows
    that do not it drafts less or not at all."""
    (alone,) = plan_lengths([8], [0.9], 1, STEEP)
    among = plan_lengths([8] + [0] * 7, [0.9] + [0.0] * 7, 8, STEEP)
    assert alone > 0 and among[0] < alone and among[1:] == [0] * 7


def test_losing_the_chained_decode_raises_the_bar():
    """A drafting Step is not chained: on a worker that overlaps, a draft must pay for
    the overlap too."""
    cheap = cost_of(cost_curve({1: 1.0, 2: 1.27, 8: 2.8}))
    assert plan_lengths([1], [0.4], 1, cheap) == [1]
    assert plan_lengths([1], [0.4], 1, cheap, unchained=0.1) == [0]
    assert plan_lengths([8], [0.95], 1, cheap, unchained=0.1) == [8]


def test_a_replaying_model_pays_for_its_second_forward():
    """A model with recurrent state replays a verify whose rows drop positions: a
    draft must pay for that forward too, which twice a steep curve's verify never
    does; where verifying is nearly free, drafts still pay."""
    assert plan_lengths([4], [0.7], 1, STEEP) == [4]
    for rate in (0.7, 0.99):
        assert plan_lengths([4], [rate], 1, STEEP, replays=True) == [0]
    assert plan_lengths([8], [0.9], 1, FLAT, replays=True) == [8]
    assert plan_lengths([4], [0.0], 1, FLAT, replays=True) == [0]


def test_acceptance_starts_optimistic_and_follows_recent_verifies():
    a = Acceptance()
    assert a.rate == pytest.approx(Acceptance.PRIOR)
    a.record(8, 0)
    low = a.rate
    assert low < Acceptance.PRIOR
    for _ in range(5):
        a.record(8, 8)
    assert a.rate > 0.95
    for _ in range(5):   # one refused token a verify: the recent ones weigh most
        a.record(8, 0)
    assert a.rate < 0.7
    stopped = a.rate
    for _ in range(30):   # proposals held back: the misses fade, drafts are tried again
        a.held()
    assert a.rate > stopped + 0.05
