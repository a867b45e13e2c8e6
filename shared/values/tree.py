"""The token tree: flat arrays in topological order, node 0 the root.

The root is the request's last committed token (its target KV is not computed yet). Every other
node is a drafted token; `logq[i]` is the draft's log-probability of it given the path to its
parent, so the path probability f(i) = exp(sum of logq along root->i) estimates the chance the
target accepts the path, and E[accepted tokens] = sum over non-root nodes of f(i) (AdaServe
Theorem 3.1).

A node's children are either picked deterministically (top-k, beam, dynamic tree) or *sampled*
from a proposal distribution; sampled nodes record which proposal (`proposal_of[i]`, an index
into `proposals`) they were drawn from, so multi-step speculative sampling stays exactly lossless.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kernels.attention_metadata import MASK_WORD_BITS, num_mask_words

DETERMINISTIC = -1


@dataclass(frozen=True)
class SparseDist:
    """A distribution over a few token ids (e.g. a renormalized top-k); probs sum to 1."""

    ids: np.ndarray  # [k] int64, distinct
    probs: np.ndarray  # [k] float64

    def prob(self, token: int) -> float:
        hit = np.flatnonzero(self.ids == token)
        return float(self.probs[hit[0]]) if hit.size else 0.0


@dataclass
class TokenTree:
    tokens: np.ndarray  # [n] int64
    parents: np.ndarray  # [n] int32, parents[0] == -1, parents[i] < i
    logq: np.ndarray  # [n] float64, logq[0] == 0
    proposal_of: np.ndarray  # [n] int32, index into proposals or DETERMINISTIC
    proposals: list[SparseDist] = field(default_factory=list)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def root_only(cls, token: int) -> TokenTree:
        return cls.build([token], [-1], [0.0])

    @classmethod
    def build(
        cls,
        tokens: Sequence[int],
        parents: Sequence[int],
        logq: Sequence[float],
        proposal_of: Sequence[int] | None = None,
        proposals: Sequence[SparseDist] = (),
    ) -> TokenTree:
        n = len(tokens)
        tree = cls(
            tokens=np.asarray(tokens, dtype=np.int64),
            parents=np.asarray(parents, dtype=np.int32),
            logq=np.asarray(logq, dtype=np.float64),
            proposal_of=np.asarray(
                proposal_of if proposal_of is not None else [DETERMINISTIC] * n, dtype=np.int32
            ),
            proposals=list(proposals),
        )
        tree.validate()
        return tree

    @classmethod
    def chain(cls, root: int, tokens: Sequence[int], logq: Sequence[float]) -> TokenTree:
        n = len(tokens)
        return cls.build([root, *tokens], list(range(-1, n)), [0.0, *logq])

    def validate(self) -> None:
        n = len(self.tokens)
        if n == 0:
            raise ValueError("a token tree has at least its root")
        shapes = {len(self.parents), len(self.logq), len(self.proposal_of)}
        if shapes != {n}:
            raise ValueError("token tree arrays differ in length")
        if self.parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        idx = np.arange(1, n)
        if np.any(self.parents[1:] < 0) or np.any(self.parents[1:] >= idx):
            raise ValueError("parents must precede their children (topological order)")
        if np.any(self.proposal_of >= len(self.proposals)) or self.proposal_of[0] != -1:
            raise ValueError("proposal_of points past the proposals list")

    # ---- derived quantities --------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @property
    def root_token(self) -> int:
        return int(self.tokens[0])

    def depths(self) -> np.ndarray:
        d = np.zeros(self.num_nodes, dtype=np.int32)
        for i in range(1, self.num_nodes):
            d[i] = d[self.parents[i]] + 1
        return d

    def path_logprob(self) -> np.ndarray:
        """log f(i): sum of logq along root -> i."""
        lp = self.logq.copy()
        lp[0] = 0.0
        for i in range(1, self.num_nodes):
            lp[i] += lp[self.parents[i]]
        return lp

    def expected_accepted(self) -> float:
        """E[accepted draft tokens] under the draft's own distribution (bonus token excluded)."""
        return float(np.exp(self.path_logprob()[1:]).sum())

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i in range(1, self.num_nodes):
            kids[self.parents[i]].append(i)
        return kids

    def path_to(self, node: int) -> list[int]:
        """Node indices root -> node, inclusive."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]

    def subtree(self, keep: Sequence[int]) -> TokenTree:
        """The tree restricted to `keep` (must contain the root and every kept node's parent)."""
        keep_sorted = sorted(set(int(k) for k in keep))
        if not keep_sorted or keep_sorted[0] != 0:
            raise ValueError("a subtree keeps the root")
        remap = {old: new for new, old in enumerate(keep_sorted)}
        parents = []
        for old in keep_sorted:
            p = int(self.parents[old])
            if p >= 0 and p not in remap:
                raise ValueError(f"node {old} kept without its parent {p}")
            parents.append(remap[p] if p >= 0 else -1)
        used = sorted({int(self.proposal_of[o]) for o in keep_sorted} - {DETERMINISTIC})
        prop_remap = {old: new for new, old in enumerate(used)}
        return TokenTree.build(
            self.tokens[keep_sorted].tolist(),
            parents,
            self.logq[keep_sorted].tolist(),
            [prop_remap.get(int(self.proposal_of[o]), DETERMINISTIC) for o in keep_sorted],
            [self.proposals[p] for p in used],
        )


def ancestor_bitmask(parents: Sequence[int] | np.ndarray) -> np.ndarray:
    """[n] parents -> [n, W] int64: bit j of row i set when j is i or an ancestor of i."""
    parents = np.asarray(parents, dtype=np.int64)
    n = len(parents)
    words = np.zeros((n, num_mask_words(n)), dtype=np.uint64)
    for i in range(n):
        if parents[i] >= 0:
            words[i] = words[parents[i]]
        words[i, i // MASK_WORD_BITS] |= np.uint64(1) << np.uint64(i % MASK_WORD_BITS)
    return words.view(np.int64)


def merge_trees(trees: Sequence[TokenTree]) -> TokenTree:
    """SpecInfer's merge: the union of all root->node paths, identical paths deduplicated.

    Deterministically chosen nodes with the same token under the same parent are one node (the
    larger logq kept). Sampled nodes are never deduplicated: each is an independent draw from its
    own proposal, and multi-step speculative sampling is lossless only if every draw stays.
    """
    if not trees:
        raise ValueError("merge_trees needs at least one tree")
    root = trees[0].root_token
    if any(t.root_token != root for t in trees):
        raise ValueError("merged trees must share their root token")
    tokens, parents, logq, proposal_of = [root], [-1], [0.0], [DETERMINISTIC]
    proposals: list[SparseDist] = []
    det_child: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    for tree in trees:
        prop_base = len(proposals)
        proposals.extend(tree.proposals)
        where = [0]
        for i in range(1, tree.num_nodes):
            parent = where[tree.parents[i]]
            tok = int(tree.tokens[i])
            is_sampled = tree.proposal_of[i] != DETERMINISTIC
            key = (parent, tok)
            if not is_sampled and key in det_child:
                node = det_child[key]
                logq[node] = max(logq[node], float(tree.logq[i]))
            else:
                node = len(tokens)
                tokens.append(tok)
                parents.append(parent)
                logq.append(float(tree.logq[i]))
                proposal_of.append(
                    prop_base + int(tree.proposal_of[i]) if is_sampled else DETERMINISTIC
                )
                if not is_sampled:
                    det_child[key] = node
            where.append(node)
    return TokenTree.build(tokens, parents, logq, proposal_of, proposals)


def counterfactual_accepted(tree: TokenTree, committed: Sequence[int]) -> tuple[int, bool]:
    """Draft tokens of `tree` that verification would have accepted, given the tokens the target
    committed after its root (the longest root path whose tokens are a prefix of `committed`),
    and whether that is final: the path stopped at a committed token none of its children has,
    or at a leaf. Otherwise more of the tree might match the tokens still to come, and the
    count is a lower bound.

    Exact for greedy verification. For sampled verification of deterministic nodes (a model-free
    tree) it is what running the tree would have given with the same emitted tokens: a
    deterministic child is accepted exactly when the token the target emits at its parent is
    that child's token (on rejection the token is removed from what the target samples), and
    the committed tokens are distributed as the target's own."""
    accepted, stop = levels_accepted(tree, committed)
    return accepted, stop != STOP_UNKNOWN


STOP_REJECTED = "rejected"  # a committed token matched none of the node's children
STOP_LEAF = "leaf"  # the path reached a leaf: the tree says nothing deeper
STOP_UNKNOWN = "unknown"  # the committed tokens ran out at a node with children


def levels_accepted(tree: TokenTree, committed: Sequence[int]) -> tuple[int, str]:
    """How many levels of `tree` the committed tokens accept, and where the path stopped:
    `STOP_REJECTED` (the target's next token is none of the drafted children), `STOP_LEAF` (the
    tree says nothing deeper) or `STOP_UNKNOWN` (the tokens ran out at a node with children)."""
    children = tree.children()
    node, accepted = 0, 0
    for token in committed:
        if not children[node]:
            return accepted, STOP_LEAF
        match = next((c for c in children[node] if int(tree.tokens[c]) == int(token)), None)
        if match is None:
            return accepted, STOP_REJECTED
        node, accepted = match, accepted + 1
    return accepted, STOP_LEAF if not children[node] else STOP_UNKNOWN
