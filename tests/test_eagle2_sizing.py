"""Tree sizing by step costs (eagle2/sizing.py): expected accepted length from the draft's scores, the
size with the most expected tokens per second, and a generation's pace (when to draft, what a
lookup branch lands)."""
from __future__ import annotations

import numpy as np
import pytest

from eagle2 import Pace, best_tree_size, expected_tokens
from eagle2.sizing import FIRST_WAIT, LONGEST_WAIT, LOOKUP_PRIOR, PAYING_PRIOR


def test_expected_tokens_sums_path_probabilities_best_first():
    scores = np.log([0.25, 0.5, 0.125])
    np.testing.assert_allclose(expected_tokens(scores), [1.0, 1.5, 1.75, 1.875])
    np.testing.assert_allclose(expected_tokens(scores, calibration=2.0), [1.0, 2.0, 2.5, 2.75])


def test_free_rows_take_the_whole_tree_and_dear_rows_none():
    scores = np.log([0.9, 0.5, 0.1])
    assert best_tree_size(scores, [1.0] * 4, 0.0) == 4
    assert best_tree_size(scores, [1.0, 10.0, 20.0, 30.0], 0.0) == 1


def test_size_where_a_node_is_worth_its_row():
    # Expected tokens 1, 1.9, 2.4, 2.5; a row costs 0.2 over a step of 1 and a draft of 0.2:
    # rates 1/1.2, 1.9/1.4, 2.4/1.6, 2.5/1.8 -> the third size wins.
    scores = np.log([0.9, 0.5, 0.1])
    assert best_tree_size(scores, [1.0, 1.2, 1.4, 1.6], 0.2) == 3
    # A lookup branch expected to land 2 more tokens changes what the rows are worth.
    assert best_tree_size(scores, [1.0, 1.2, 1.4, 1.6], 0.2, extra_tokens=2.0) == 2
    # Equal rates: the smaller tree.
    assert best_tree_size(np.log([1.0]), [1.0, 2.0], 0.0) == 1


def test_pace_waits_longer_each_time_drafting_does_not_pay():
    pace = Pace()
    assert pace.speculate() and pace.drafting == PAYING_PRIOR
    # Cycles landing one token at twice a plain step's cost: drafting pays half as much as plain steps.
    losing = 0
    while pace.plain_left == 0:
        pace.drafted(expected_nodes=1.0, accepted_nodes=0, tokens=1, plain_steps=2.0)
        losing += 1
    assert losing > 1, "one unlucky cycle must not stop drafting"
    waits = [pace.plain_left]
    for _ in range(5):
        while not pace.speculate():
            pass
        pace.drafted(1.0, 0, 1, 2.0)
        waits.append(pace.plain_left)
    assert waits == [FIRST_WAIT, 2 * FIRST_WAIT, 4 * FIRST_WAIT, 8 * FIRST_WAIT, LONGEST_WAIT, LONGEST_WAIT]
    # Drafting that pays again: no wait, and the next wait starts short.
    for _ in range(8):
        while not pace.speculate():
            pass
        pace.drafted(1.0, 2, 3, 1.5)
    assert pace.plain_left == 0 and pace.wait == FIRST_WAIT and pace.drafting > 1
    assert pace.calibration > 1


def test_pace_averages_tokens_and_costs_apart():
    """A ratio of averages: alternating one- and three-token cycles at 1.5 plain steps pay 2 / 1.5,
    and a run of three one-token cycles after a fair start does not stop drafting."""
    pace = Pace()
    for tokens in [1, 3] * 20:
        pace.drafted(1.0, tokens - 1, tokens, 1.5)
    assert pace.drafting == pytest.approx(2 / 1.5, rel=0.15)
    for _ in range(3):
        pace.drafted(1.0, 0, 1, 1.5)
    assert pace.plain_left == 0 and pace.drafting > 1


def test_lookup_offers_settle_on_the_tokens_that_come():
    pace = Pace()
    sequence = [1, 2, 3]
    pace.offered(3, [7, 8, 9], own=1)       # the branch for indices 3..5
    pace.settle(sequence + [7])           # 7 matches, 8 and 9 not known yet
    assert pace.offers and pace.lookup_gain == LOOKUP_PRIOR
    pace.settle(sequence + [7, 8, 5])     # lands 2, of which the tree landed 1 itself
    assert not pace.offers
    assert pace.lookup_gain == pytest.approx(LOOKUP_PRIOR + 0.25 * (1 - LOOKUP_PRIOR))
    pace.offered(6, [4, 4], own=0)
    pace.settle(sequence + [7, 8, 5, 3])  # the first token differs: lands nothing
    assert pace.lookup_gain < LOOKUP_PRIOR + 0.25 * (1 - LOOKUP_PRIOR)
    assert pace.lookup_pays(1.0, 2.0, 1.0) == (1.0 + pace.lookup_gain >= 2.0)
