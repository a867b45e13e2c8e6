"""Lossless speculative sampling: emitted tokens follow the target's distribution exactly.

The target and draft here are synthetic next-token distributions that depend on the whole path
(so a verifier that conditions on the wrong node is caught). Every test is seeded, so its
statistic is fixed; the controls show the same check flags a 2% bias.
"""

from __future__ import annotations

import functools
import hashlib
import itertools

import numpy as np
import pytest
import torch

from shared.engine.verification import verify_stochastic
from shared.values.sampling import SamplingParams, processed_probs, sample
from shared.values.tree import SparseDist, TokenTree, merge_trees
from tests.stats import P_VALUE_FLOOR, fit_p_value

V = 5
NUM_TRIALS = 10_000
OUTCOME_LEN = 2


@functools.cache
def _dirichlet(tag: str, path: tuple[int, ...], alpha: float) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(f"{tag}{path}".encode()).digest()[:8], "little")
    return np.random.default_rng(seed).dirichlet([alpha] * V)


def target_p(path: tuple[int, ...]) -> np.ndarray:
    return _dirichlet("target", path, 0.8)


def draft_q(path: tuple[int, ...], tag: str = "draft") -> np.ndarray:
    return 0.6 * target_p(path) + 0.4 * _dirichlet(tag, path, 0.8)


@functools.cache
def processed(path: tuple[int, ...], params: SamplingParams) -> np.ndarray:
    logits = torch.tensor(np.log(target_p(path)))[None]
    return processed_probs(logits, params)[0].numpy()


class TreeBuilder:
    """Grows synthetic draft trees below a context path; children sampled or chosen by top-k."""

    def __init__(self, rng: np.random.Generator, tag: str = "draft") -> None:
        self.rng, self.tag = rng, tag

    def build(self, context: tuple[int, ...], expansion: tuple[int, ...], sampled: bool):
        tokens, parents, logq, prop_of = [context[-1]], [-1], [0.0], [-1]
        proposals: list[SparseDist] = []
        paths = {0: context}
        layer = [0]
        for k in expansion:
            nxt = []
            for node in layer:
                q = draft_q(paths[node], self.tag)
                if sampled:
                    proposals.append(SparseDist(np.arange(V), q))
                    picks = [int(self.rng.choice(V, p=q)) for _ in range(k)]
                    src = len(proposals) - 1
                else:
                    picks = list(np.argsort(-q)[:k])
                    src = -1
                for tok in picks:
                    tokens.append(int(tok))
                    parents.append(node)
                    logq.append(float(np.log(q[tok])))
                    prop_of.append(src)
                    paths[len(tokens) - 1] = paths[node] + (int(tok),)
                    nxt.append(len(tokens) - 1)
            layer = nxt
        tree = TokenTree.build(tokens, parents, logq, prop_of, proposals)
        return tree


def node_paths(tree: TokenTree, context: tuple[int, ...]) -> list[tuple[int, ...]]:
    paths = [context]
    for i in range(1, tree.num_nodes):
        paths.append(paths[tree.parents[i]] + (int(tree.tokens[i]),))
    return paths


def run_trials(make_tree, params: SamplingParams, verify=verify_stochastic) -> list[tuple]:
    context = (1, 3)
    rng = np.random.default_rng(1234)
    outcomes = []
    for _ in range(NUM_TRIALS):
        tree = make_tree(context)
        logits = torch.tensor(np.log(np.stack([target_p(p) for p in node_paths(tree, context)])))
        emitted = verify(tree, logits, params, rng).emitted
        seq = list(emitted)
        while len(seq) < OUTCOME_LEN:  # what the next plain decoding steps would do
            probs = torch.tensor(processed(context + tuple(seq), params))
            seq.append(sample(probs, rng.random()))
        outcomes.append(tuple(seq[:OUTCOME_LEN]))
    return outcomes


def exact_joint(params: SamplingParams) -> dict[tuple[int, ...], float]:
    context = (1, 3)
    joint = {}
    for seq in itertools.product(range(V), repeat=OUTCOME_LEN):
        prob = 1.0
        for i, tok in enumerate(seq):
            prob *= processed(context + seq[:i], params)[tok]
        joint[seq] = prob
    return joint


def _builder(kind: str, rng: np.random.Generator):
    b, b2 = TreeBuilder(rng), TreeBuilder(rng, tag="other-draft")
    return {
        "sampled_chain": lambda c: b.build(c, (1, 1, 1), sampled=True),
        "sampled_static": lambda c: b.build(c, (3, 2), sampled=True),
        "topk_static": lambda c: b.build(c, (2, 2), sampled=False),
        "merged_mixed": lambda c: merge_trees(
            [b.build(c, (2, 1), sampled=True), b2.build(c, (2, 1), sampled=False)]
        ),
        "merged_two_sampled": lambda c: merge_trees(
            [b.build(c, (2,), sampled=True), b2.build(c, (1, 1), sampled=True)]
        ),
    }[kind]


PARAMS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7_topk3_topp0.9": SamplingParams(temperature=0.7, top_k=3, top_p=0.9),
}


CASES = [
    (kind, "t1")
    for kind in ["sampled_chain", "sampled_static", "topk_static", "merged_mixed"]
    + ["merged_two_sampled"]
] + [("sampled_static", "t0.7_topk3_topp0.9"), ("merged_mixed", "t0.7_topk3_topp0.9")]


@pytest.mark.parametrize(("kind", "params_name"), CASES)
def test_tree_verification_is_lossless(kind, params_name):
    params = PARAMS[params_name]
    outcomes = run_trials(_builder(kind, np.random.default_rng(7)), params)
    assert fit_p_value(outcomes, exact_joint(params)) > P_VALUE_FLOOR


def test_check_catches_a_two_percent_bias():
    """Control: samples from a distribution with 2% of its mass moved are rejected."""
    params = PARAMS["t1"]
    joint = exact_joint(params)
    keys = sorted(joint, key=joint.get)
    biased = dict(joint)
    biased[keys[-1]] -= 0.02  # most likely outcome gives 2% of mass ...
    biased[keys[len(keys) // 2]] += 0.02  # ... to a middling one
    rng = np.random.default_rng(99)
    idx = rng.choice(len(keys), size=NUM_TRIALS, p=[biased[k] for k in keys])
    assert fit_p_value([keys[i] for i in idx], joint) < P_VALUE_FLOOR
    # the same draw from the exact distribution passes
    idx = rng.choice(len(keys), size=NUM_TRIALS, p=[joint[k] for k in keys])
    assert fit_p_value([keys[i] for i in idx], joint) > P_VALUE_FLOOR


def test_check_catches_a_naive_verifier():
    """Control: resampling from p (not the residual) after a rejection is biased and caught."""

    def naive(tree, logits, params, rng):
        probs = processed_probs(logits, params)[0]
        kids = tree.children()[0]
        x = int(tree.tokens[kids[0]])
        q = tree.proposals[tree.proposal_of[kids[0]]]
        if rng.random() < min(1.0, float(probs[x]) / q.prob(x)):
            return type("V", (), {"emitted": [x]})()
        return type("V", (), {"emitted": [sample(probs, rng.random())]})()

    params = PARAMS["t1"]
    outcomes = run_trials(_builder("sampled_chain", np.random.default_rng(7)), params, naive)
    assert fit_p_value(outcomes, exact_joint(params)) < P_VALUE_FLOOR
