"""Model-free drafts (`ngram`, `suffix`): proposals on hand-made token sequences, the caches'
bounds, and through the engine: greedy output equal to plain decoding with an acceptance floor,
alone and merged with a model draft; the counterfactual acceptance of a tree equal to what
verifying it gave; the counterfactual chooser."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shared.engine.model_free import (
    MODEL_FREE_KINDS,
    AppCaches,
    ModelFreeDrafter,
    NgramSettings,
    SequenceCache,
    SuffixIndex,
    SuffixProposer,
    SuffixSettings,
    TreeLimits,
    ngram_matches,
    propose_ngram,
)
from shared.model.model_set import MODEL_FREE_DRAFT_NAMES
from shared.values.methods import MODEL_FREE_METHOD
from shared.values.sampling import SamplingParams as Params
from shared.values.tree import DETERMINISTIC, TokenTree, counterfactual_accepted
from shared.wire.steps import DraftRequest

WIDE = TreeLimits(max_depth=8, max_nodes=32, max_children=4)


def children_tokens(tree: TokenTree, node: int = 0) -> list[int]:
    return [int(tree.tokens[c]) for c in tree.children()[node]]


def chain_tokens(tree: TokenTree) -> list[int]:
    """The tokens along the first child at every level."""
    kids, node, out = tree.children(), 0, []
    while kids[node]:
        node = kids[node][0]
        out.append(int(tree.tokens[node]))
    return out


# ---- ngram ------------------------------------------------------------------------------------


def test_ngram_matches_find_earlier_occurrences_only():
    tokens = np.array([1, 2, 3, 1, 2, 9, 1, 2])
    assert ngram_matches(tokens, 2).tolist() == [0, 3]
    assert ngram_matches(tokens, 3).tolist() == []  # (9, 1, 2) occurs only at the end
    assert ngram_matches(np.array([4, 4, 4]), 1).tolist() == [0, 1]


def test_ngram_takes_the_longest_match():
    # the last 3 tokens (5, 6, 7) occurred once, followed by 8 8; the last token 7 alone also
    # occurred followed by 1: the 3-gram wins and its continuation alone is proposed
    tokens = [7, 1, 0, 5, 6, 7, 8, 8, 2, 5, 6, 7]
    tree = propose_ngram(tokens, WIDE, NgramSettings(max_n=4))
    assert tree.root_token == 7
    assert children_tokens(tree) == [8]
    assert chain_tokens(tree) == [8, 8, 2, 5, 6, 7]  # what followed, up to the text's end
    # one occurrence of a 3-gram: each token count 1 over 1 + 1/3
    assert math.isclose(tree.logq[1], math.log(1 / (1 + 1 / 3)))


def test_ngram_branches_where_matches_go_on_differently_most_recent_first_on_ties():
    tokens = [3, 4, 10, 11, 3, 4, 20, 21, 3, 4]
    tree = propose_ngram(tokens, WIDE, NgramSettings(max_n=2))
    assert children_tokens(tree) == [20, 10]  # one match each: the more recent first
    first = tree.children()[0]
    assert [children_tokens(tree, c) for c in first] == [[21], [11]]
    assert math.isclose(tree.logq[first[0]], math.log(1 / (2 + 1 / 2)))
    # a continuation seen twice outranks a more recent one seen once
    tokens = [3, 4, 10, 3, 4, 10, 3, 4, 20, 3, 4]
    tree = propose_ngram(tokens, WIDE, NgramSettings(max_n=2))
    assert children_tokens(tree)[:2] == [10, 20]


def test_ngram_respects_limits_and_keeps_the_most_recent_matches():
    tokens = [3, 4, 10, 11, 3, 4, 20, 21, 3, 4]
    chain = propose_ngram(tokens, TreeLimits(8, 32, max_children=1), NgramSettings(max_n=2))
    assert [c for c in chain.children() if len(c) > 1] == []
    assert chain_tokens(chain)[:2] == [20, 21]
    small = propose_ngram(tokens, TreeLimits(2, 3, 4), NgramSettings(max_n=2))
    assert small.num_nodes - 1 == 3 and small.depths().max() <= 2
    recent = propose_ngram(tokens, WIDE, NgramSettings(max_n=2, max_matches=1))
    assert children_tokens(recent) == [20]
    floor = TreeLimits(8, 32, 4, min_path_logprob=math.log(0.3))
    assert np.exp(propose_ngram(tokens, floor, NgramSettings(max_n=2)).path_logprob()).min() >= 0.3


def test_ngram_without_a_match_proposes_nothing():
    tree = propose_ngram([1, 2, 3, 4], WIDE, NgramSettings())
    assert tree.num_nodes == 1 and tree.root_token == 4
    assert propose_ngram([5], WIDE, NgramSettings()).num_nodes == 1


def test_model_free_nodes_are_deterministic():
    tree = propose_ngram([3, 4, 10, 3, 4, 20, 3, 4], WIDE, NgramSettings(max_n=2))
    assert (tree.proposal_of == DETERMINISTIC).all()


# ---- suffix -----------------------------------------------------------------------------------


def test_suffix_index_counts_contexts_and_removes_exactly():
    index = SuffixIndex(max_n=3)
    index.add_positions([1, 2, 3, 1, 2, 4], 1)
    n, options = index.lookup([9, 1, 2])
    assert n == 2 and sorted((t, c) for t, c, _ in options) == [(3, 1), (4, 1)]
    n, options = index.lookup([2, 3, 1, 2])  # the 3-gram (3, 1, 2) was followed by 4
    assert n == 3 and [(t, c) for t, c, _ in options] == [(4, 1)]
    assert index.lookup([7]) == (0, [])
    index.add_positions([5, 1, 2, 3], 1)
    assert sorted((t, c) for t, c, _ in index.lookup([1, 2])[1]) == [(3, 2), (4, 1)]
    index.remove([5, 1, 2, 3])
    index.remove([1, 2, 3, 1, 2, 4])
    assert index.counts == {} and index.last == {} and index.num_tokens == 0


def test_sequence_cache_is_bounded_and_evicts_the_least_recent():
    settings = SuffixSettings(max_n=2, cache_sequences=2, cache_tokens=12)
    cache = SequenceCache(settings)
    cache.add("a", [1, 2, 3])
    cache.add("b", [4, 5, 6])
    cache.add("c", [7, 8, 9])
    assert list(cache.sequences) == ["b", "c"]
    assert cache.index.lookup([1]) == (0, [])  # a's counts are gone with it
    cache.add("d", [10, 11, 12, 13, 14, 15, 16])  # 3 + 7 tokens fit, 3 + 3 + 7 do not
    assert list(cache.sequences) == ["c", "d"] and cache.num_tokens <= 12
    cache.add("c", [7, 8, 30])  # the same key again replaces its copy and counts as recent
    assert list(cache.sequences) == ["d", "c"]
    assert [t for t, _, _ in cache.index.lookup([8])[1]] == [30]
    apps = AppCaches(SuffixSettings(max_apps=2))
    for app in ("x", "y", "z"):
        apps.add(app, "r", [1, 2])
    assert list(apps.caches) == ["y", "z"]


def _draft_request(rid: str, step: int, base: int, tokens: list[int], app: str = "", **kw):
    return DraftRequest(
        rid, step, base, tuple(tokens), MODEL_FREE_METHOD, Params(), seed=0, app=app, **kw
    )


def test_suffix_cache_is_shared_only_within_an_application():
    drafter = ModelFreeDrafter("suffix")
    answer = [40, 41, 42, 43, 44]
    drafter.draft([_draft_request("a", 0, 0, [1, 2, 3, *answer], app="sql")], MODEL_FREE_METHOD)
    drafter.free("a")  # its tokens go to the "sql" cache
    asked = [
        _draft_request(rid, 0, 0, [9, 8, 40, 41], app=app) for rid, app in [("b", "sql"), ("c", "")]
    ]
    trees = drafter.draft(asked, MODEL_FREE_METHOD)
    assert chain_tokens(trees["b"])[:3] == [42, 43, 44]
    assert trees["c"].num_nodes == 1  # no application: its own tokens only
    other = drafter.draft([_draft_request("d", 0, 0, [9, 40, 41], app="web")], MODEL_FREE_METHOD)
    assert other["d"].num_nodes == 1


def test_suffix_grows_from_the_request_own_tokens_incrementally():
    drafter = ModelFreeDrafter("suffix")
    first = drafter.draft([_draft_request("r", 0, 0, [5, 6, 7, 8, 5])], MODEL_FREE_METHOD)["r"]
    assert chain_tokens(first)[:3] == [6, 7, 8]
    later = drafter.draft([_draft_request("r", 1, 5, [6, 7])], MODEL_FREE_METHOD)["r"]
    assert later.root_token == 7 and chain_tokens(later)[:2] == [8, 5]
    assert isinstance(drafter.proposer, SuffixProposer)
    assert drafter.proposer.own["r"].num_tokens == 6


def test_model_free_drafter_refuses_a_job_out_of_step():
    drafter = ModelFreeDrafter("ngram")
    drafter.draft([_draft_request("r", 0, 0, [1, 2, 3])], MODEL_FREE_METHOD)
    with pytest.raises(ValueError, match="out_of_sync"):
        drafter.draft([_draft_request("r", 1, 7, [4])], MODEL_FREE_METHOD)
    drafter.draft([_draft_request("r", 1, 0, [1, 2])], MODEL_FREE_METHOD)  # 0 starts over
    assert drafter.num_committed("r") == 2
    drafter.free("r")
    assert not drafter.has_request("r")


def test_plan_limits_bound_the_tree():
    drafter = ModelFreeDrafter("ngram")
    tokens = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1]
    job = _draft_request("r", 0, 0, tokens, max_depth=3, max_nodes=2)
    tree = drafter.draft([job], MODEL_FREE_METHOD)["r"]
    assert tree.num_nodes == 3 and tree.depths().max() <= 2


def test_model_set_names_the_model_free_drafts():
    assert MODEL_FREE_DRAFT_NAMES == MODEL_FREE_KINDS


# ---- counterfactual acceptance ----------------------------------------------------------------


def test_counterfactual_accepted_follows_the_committed_tokens():
    tree = TokenTree.build([0, 5, 6, 7, 9], [-1, 0, 1, 2, 0], [0.0] * 5)
    assert counterfactual_accepted(tree, [5, 6, 8]) == (2, True)
    assert counterfactual_accepted(tree, [9, 1]) == (1, True)  # 9 is a leaf
    assert counterfactual_accepted(tree, [4]) == (0, True)
    assert counterfactual_accepted(tree, [5, 6]) == (2, False)  # 7 might still come
    assert counterfactual_accepted(tree, [5, 6, 7]) == (3, True)


# ---- the counterfactual chooser ------------------------------------------------------------------


def test_counterfactual_chooser_takes_the_copy_while_it_scores_at_least_the_model():
    from shared.scheduling.draft_choice import DraftOutcome
    from shared.scheduling.factory import make_chooser
    from shared.scheduling.request import RequestState

    chooser = make_chooser("counterfactual", ["m", "ngram"], model_free=["ngram"])
    request = RequestState("r", [1, 2], Params(), 0)
    live = ["m", "ngram"]
    assert chooser.assign([request], live, None) == {"r": "m"}  # nothing scored yet
    chooser.observe(DraftOutcome("r", "m", 4, 1, 10.0, 10.0))  # 2 tokens in 10 ms
    chooser.observe(DraftOutcome("r", "ngram", 8, 5, 10.0, 7.0, counterfactual=True))
    assert chooser.assign([request], live, None) == {"r": "ngram"}
    for _ in range(6):  # the copy runs out: its recent goodput falls below the model's
        chooser.observe(DraftOutcome("r", "ngram", 0, 0, 10.0, 10.0))
    assert chooser.assign([request], live, None) == {"r": "m"}
    # a model outcome reaches LBSS; a model-free one does not
    assert chooser.lbss.table.mean("r", "m") is not None
    assert chooser.lbss.table.mean("r", "ngram") is None
    chooser.forget("r")
    assert not chooser.recent


def test_counterfactual_chooser_retries_a_model_draft_it_ran_little_or_long_ago_on_a_miss():
    from shared.scheduling.counterfactual import RETRY_AFTER
    from shared.scheduling.draft_choice import DraftOutcome
    from shared.scheduling.factory import make_chooser
    from shared.scheduling.request import RequestState

    chooser = make_chooser("counterfactual", ["m", "ngram"], model_free=["ngram"])
    request = RequestState("r", [1, 2], Params(), 0)
    live = ["m", "ngram"]
    chooser.observe(DraftOutcome("r", "m", 6, 2, 50.0, 50.0))  # one unlucky step: 0.06/ms
    chooser.observe(DraftOutcome("r", "ngram", 4, 0, 10.0, 10.0))  # a miss at 0.1/ms
    assert chooser.assign([request], live, None) == {"r": "m"}  # tried again despite its score
    for _ in range(2):
        chooser.observe(DraftOutcome("r", "m", 6, 2, 50.0, 50.0))
    # three steps run: the model's estimate stands, and plain-rate steps beat it
    for _ in range(RETRY_AFTER):
        assert chooser.assign([request], live, None) == {"r": "ngram"}
        chooser.observe(DraftOutcome("r", "ngram", 4, 0, 10.0, 10.0))
    # until the model has not run for RETRY_AFTER steps: then it is tried again, once
    assert chooser.assign([request], live, None) == {"r": "m"}
    assert chooser.assign([request], live, None) == {"r": "ngram"}
    # a hit clears the miss: the copy goes on whatever the model's age
    chooser.observe(DraftOutcome("r", "ngram", 16, 12, 10.0, 10.0, counterfactual=True))
    assert ("r", "ngram") not in chooser.missed


def test_counterfactual_chooser_does_not_retry_a_model_draft_far_behind():
    from shared.scheduling.draft_choice import DraftOutcome
    from shared.scheduling.factory import make_chooser
    from shared.scheduling.request import RequestState

    chooser = make_chooser("counterfactual", ["m", "ngram"], model_free=["ngram"])
    request = RequestState("r", [1, 2], Params(), 0)
    live = ["m", "ngram"]
    chooser.observe(DraftOutcome("r", "m", 6, 0, 50.0, 50.0))  # 0.02/ms
    chooser.observe(DraftOutcome("r", "ngram", 4, 0, 10.0, 10.0))  # a miss, still 0.1/ms
    assert chooser.assign([request], live, None) == {"r": "ngram"}  # below half: not worth it


def test_counterfactual_chooser_does_not_write_a_model_off_after_one_unlucky_step():
    """A model draft's estimate for a request leans on its mean over all requests until the
    request has run it a few steps: one step that accepted nothing is no verdict."""
    from shared.scheduling.draft_choice import DraftOutcome
    from shared.scheduling.factory import make_chooser
    from shared.scheduling.request import RequestState

    chooser = make_chooser("counterfactual", ["m", "ngram"], model_free=["ngram"])
    live = ["m", "ngram"]
    for other in ("a", "b", "c"):  # elsewhere the model commits 5 tokens in 50 ms
        chooser.observe(DraftOutcome(other, "m", 6, 4, 50.0, 50.0))
    request = RequestState("r", [1, 2], Params(), 0)
    chooser.observe(DraftOutcome("r", "m", 6, 0, 50.0, 50.0))  # here: nothing accepted
    for _ in range(3):  # the copy commits 1.2 tokens in 15 ms, scored on every step
        chooser.observe(DraftOutcome("r", "ngram", 4, 0, 10.0, 12.5, counterfactual=True))
    assert chooser.assign([request], live, None) == {"r": "m"}
    for _ in range(8):  # the model keeps missing here: its own steps outweigh the others'
        chooser.observe(DraftOutcome("r", "m", 6, 0, 50.0, 50.0))
    assert chooser.assign([request], live, None) == {"r": "ngram"}


def test_a_counterfactual_step_is_priced_as_the_share_it_would_have_had():
    """Alone, a request pays the whole forward however few nodes it verifies; beside others,
    its nodes' share of the larger forward."""
    from types import SimpleNamespace

    from shared.scheduling.core_types import OtherLoad, PendingCounterfactual
    from shared.scheduling.learning import Learner

    class FlatCost:  # a memory-bound target: 100 ms plus 1 ms a token
        def verify_ms(self, num_tokens: int, context: float, num_requests: int | None) -> float:
            return 100.0 + num_tokens

    learner = Learner(SimpleNamespace(cost=FlatCost()))  # type: ignore[arg-type]
    tree = TokenTree.root_only(1)
    alone = PendingCounterfactual("ngram", tree, 0, 150.0, OtherLoad(0, 64, 1))
    assert learner._counterfactual_share(alone, 0) == pytest.approx(102.0)
    assert learner._counterfactual_share(alone, 14) == pytest.approx(116.0)
    beside = PendingCounterfactual("ngram", tree, 0, 150.0, OtherLoad(30, 64, 4))
    assert learner._counterfactual_share(beside, 0) == pytest.approx(132.0 * 2 / 32)
    assert (
        learner._counterfactual_share(PendingCounterfactual("ngram", tree, 0, 150.0, None), 3)
        is None
    )
