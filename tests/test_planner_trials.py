"""What the planner's per-depth acceptance estimate learns from a step: the levels of the tree as
drafted that the target accepted, with the level below the accepted path judged by the target's
bonus token (a failure there counts), not only the levels the selector kept (where every step
whose kept levels were all accepted would count no failure)."""

from __future__ import annotations

from shared.scheduling.core_types import StepResult
from shared.scheduling.learning import depth_trial
from shared.scheduling.speculation import AcceptanceEstimate
from shared.values.tree import STOP_LEAF, STOP_REJECTED, STOP_UNKNOWN, TokenTree, levels_accepted

# root 0 -> 5 -> 6 -> 7, and 0 -> 9 (a leaf)
DRAFTED = TokenTree.build([0, 5, 6, 7, 9], [-1, 0, 1, 2, 0], [0.0, -0.1, -0.5, -1.5, -2.0])
KEPT = TokenTree.build([0, 5], [-1, 0], [0.0, -0.1])  # the selector kept one level


def step(tokens: list[int], accepted: int) -> StepResult:
    return StepResult("r", 1, tokens=tokens, num_accepted=accepted)


def test_levels_accepted_tells_a_rejection_from_a_leaf_and_from_tokens_running_out():
    assert levels_accepted(DRAFTED, [5, 6, 8]) == (2, STOP_REJECTED)  # 8 is none of 6's children
    assert levels_accepted(DRAFTED, [9, 1]) == (1, STOP_LEAF)  # 9: nothing deeper drafted
    assert levels_accepted(DRAFTED, [4]) == (0, STOP_REJECTED)
    assert levels_accepted(DRAFTED, [5, 6]) == (2, STOP_UNKNOWN)  # 7 might have been accepted
    assert levels_accepted(DRAFTED, [5, 6, 7, 3]) == (3, STOP_LEAF)  # past the deepest leaf


def test_a_pruned_level_the_target_rejects_counts_as_a_failure():
    # kept level accepted, the bonus (8) is not the drafted level-2 token (6): a failure there
    assert depth_trial(DRAFTED, KEPT, 1, step([5, 8], 1)) == (1, 2)
    # from the kept tree alone the same step looked like a full success
    assert depth_trial(None, KEPT, 1, step([5, 8], 1)) == (1, 1)


def test_a_pruned_level_the_target_would_accept_counts_as_accepted():
    assert depth_trial(DRAFTED, KEPT, 1, step([5, 6], 1)) == (2, 2)


def test_the_estimate_no_longer_runs_high_where_the_selector_cuts():
    """A draft accepted at level 1 always and at level 2 never, the selector keeping level 1:
    learned from the kept nodes the rate climbs toward 1 (the prior of 1/2 decaying away), from
    the drafted tree it stays at 1/2."""
    kept, drafted = AcceptanceEstimate(), AcceptanceEstimate()
    for _ in range(50):
        result = step([5, 8], 1)
        kept.observe(*depth_trial(None, KEPT, 1, result))
        drafted.observe(*depth_trial(DRAFTED, KEPT, 1, result))
    assert kept.rate() > 0.85
    assert abs(drafted.rate() - 0.5) < 0.02


def test_a_leaf_above_the_asked_depth_is_a_rejection():
    assert depth_trial(DRAFTED, KEPT, 1, step([9, 1], 1), asked_depth=3) == (1, 2)  # short
    assert depth_trial(DRAFTED, KEPT, 1, step([9, 1], 1), asked_depth=1) == (1, 1)  # as asked
    assert depth_trial(DRAFTED, KEPT, 1, step([5, 6, 7, 3], 1), asked_depth=3) == (3, 3)
    assert depth_trial(DRAFTED, KEPT, 1, step([5, 6], 1), asked_depth=5) == (2, 2)  # ran out


def test_a_draft_that_stops_short_is_not_read_as_one_that_accepts_deep():
    """Asked for 3 levels, a draft whose accepted path always ends at a leaf after level 1 (a
    flat draft's dynamic tree spends its nodes on width) delivers 1 token a step: censored at
    the leaf, its per-depth rate would climb toward 1 and promise 3; counted, it falls toward
    1/2, which promises what it delivers at the depth asked (1/2 + 1/4 + 1/8 below 1)."""
    censored, counted = AcceptanceEstimate(), AcceptanceEstimate()
    for _ in range(50):
        result = step([9, 1], 1)
        censored.observe(*depth_trial(DRAFTED, DRAFTED, 1, result))
        counted.observe(*depth_trial(DRAFTED, DRAFTED, 1, result, asked_depth=3))
    assert censored.rate() > 0.85
    assert abs(counted.rate() - 0.5) < 0.02
