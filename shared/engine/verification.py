"""Accepting draft tokens: greedy tree verification and lossless speculative sampling.

Both walk the tree from the root. At node u the target's distribution over u's children is
known (one tree forward gave logits at every node); we either descend into a child or stop and
emit one token from the target (the bonus token). The tokens emitted are always distributed
exactly as plain decoding of the target would emit them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared.values.sampling import SamplingParams, processed_probs, sample
from shared.values.tree import DETERMINISTIC, TokenTree

RESIDUAL_FLOOR = 1e-12


@dataclass(frozen=True)
class Verdict:
    accepted_nodes: list[int]  # tree nodes accepted, root-first, root excluded
    accepted_tokens: list[int]
    bonus_token: int

    @property
    def kv_path(self) -> list[int]:
        """Tree nodes whose KV is kept: the root and every accepted node."""
        return [0, *self.accepted_nodes]

    @property
    def emitted(self) -> list[int]:
        return [*self.accepted_tokens, self.bonus_token]


def verify_greedy(tree: TokenTree, target_logits: torch.Tensor) -> Verdict:
    """SpecInfer §4 greedy: follow the child that equals the target's argmax, as far as it goes.

    target_logits: [num_nodes, V], row i = the target's next-token logits after node i's path.
    """
    best = target_logits.argmax(-1).tolist()
    children = tree.children()
    node, nodes, tokens = 0, [], []
    while True:
        want = best[node]
        match = next((c for c in children[node] if tree.tokens[c] == want), None)
        if match is None:
            return Verdict(nodes, tokens, want)
        nodes.append(match)
        tokens.append(want)
        node = match


def verify_stochastic(
    tree: TokenTree,
    target_logits: torch.Tensor,  # [num_nodes, V]
    params: SamplingParams,
    rng: np.random.Generator,
) -> Verdict:
    """Multi-step speculative sampling (SpecInfer §4), exactly lossless.

    At node u with target distribution p, children are tried in order. A child x *sampled* from
    proposal q is accepted with probability min(1, p(x)/q(x)); on rejection p becomes
    norm(max(0, p - q)). A child *chosen deterministically* is a draw from the point mass at x:
    it is accepted with probability p(x) and on rejection p loses x (recursive rejection; only
    the target's probabilities are needed). If every child is rejected the bonus token is drawn
    from what is left of p.
    """
    probs = processed_probs(target_logits, params)  # [num_nodes, V] float64
    children = tree.children()
    node, nodes, tokens = 0, [], []
    while True:
        p = probs[node].clone()
        accepted = None
        for child in children[node]:
            x = int(tree.tokens[child])
            proposal = int(tree.proposal_of[child])
            if proposal == DETERMINISTIC:
                if rng.random() < float(p[x]):
                    accepted = child
                    break
                p[x] = 0.0
            else:
                q = tree.proposals[proposal]
                qx = q.prob(x)
                if qx > 0 and rng.random() * qx < float(p[x]):
                    accepted = child
                    break
                ids = torch.from_numpy(q.ids)
                p[ids] = (p[ids] - torch.from_numpy(q.probs)).clamp_min(0.0)
            total = float(p.sum())
            if total <= RESIDUAL_FLOOR:  # round-off only: p was (numerically) fully covered
                p = probs[node].clone()
            else:
                p /= total
        if accepted is None:
            return Verdict(nodes, tokens, sample(p, rng.random()))
        nodes.append(accepted)
        tokens.append(int(tree.tokens[accepted]))
        node = accepted


def verify(
    tree: TokenTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    rng: np.random.Generator,
) -> Verdict:
    if params.is_greedy:
        return verify_greedy(tree, target_logits)
    return verify_stochastic(tree, target_logits, params, rng)
