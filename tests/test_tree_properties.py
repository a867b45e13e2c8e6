"""Property tests: trees, ancestor masks, merge, subtrees and KV compaction."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention_metadata import unpack_mask_bits
from kernels.reference import commit_kv_reference
from shared.values.tree import DETERMINISTIC, SparseDist, TokenTree, ancestor_bitmask, merge_trees


@st.composite
def trees(draw, max_nodes: int = 150, vocab: int = 6, root: int = 0, sampled: bool = True):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [root] + [draw(st.integers(0, vocab - 1)) for _ in range(n - 1)]
    logq = [0.0] + [draw(st.floats(-5.0, 0.0)) for _ in range(n - 1)]
    proposals = [SparseDist(np.arange(vocab), np.full(vocab, 1.0 / vocab))]
    is_sampled = [False] + [sampled and draw(st.booleans()) for _ in range(n - 1)]
    proposal_of = [0 if s else DETERMINISTIC for s in is_sampled]
    return TokenTree.build(tokens, parents, logq, proposal_of, proposals)


def paths(tree: TokenTree) -> list[tuple[int, ...]]:
    return [tuple(int(tree.tokens[j]) for j in tree.path_to(i)) for i in range(tree.num_nodes)]


@settings(max_examples=80, deadline=None)
@given(trees())
def test_bitmask_marks_exactly_self_and_ancestors(tree):
    mask = unpack_mask_bits(torch.from_numpy(ancestor_bitmask(tree.parents)), tree.num_nodes)
    for i in range(tree.num_nodes):
        assert set(np.flatnonzero(mask[i].numpy())) == set(tree.path_to(i))


@settings(max_examples=80, deadline=None)
@given(trees())
def test_path_probability_and_depths(tree):
    lp, depth = tree.path_logprob(), tree.depths()
    for i in range(tree.num_nodes):
        path = tree.path_to(i)
        assert depth[i] == len(path) - 1
        assert np.isclose(lp[i], sum(tree.logq[j] for j in path[1:]))
    assert np.isclose(tree.expected_accepted(), np.exp(lp[1:]).sum())


@settings(max_examples=60, deadline=None)
@given(st.lists(trees(max_nodes=25), min_size=1, max_size=4))
def test_merge_is_union_with_deterministic_paths_deduplicated(tree_list):
    merged = merge_trees(tree_list)
    merged.validate()
    assert {p for t in tree_list for p in paths(t)} == set(paths(merged))
    # deterministic siblings are unique; sampled nodes all survive
    kids = merged.children()
    for node in range(merged.num_nodes):
        det = [int(merged.tokens[c]) for c in kids[node] if merged.proposal_of[c] == -1]
        assert len(det) == len(set(det))
    sampled = sum(int((t.proposal_of != DETERMINISTIC).sum()) for t in tree_list)
    assert int((merged.proposal_of != DETERMINISTIC).sum()) == sampled
    for i in range(1, merged.num_nodes):
        if merged.proposal_of[i] != DETERMINISTIC:
            assert merged.proposals[merged.proposal_of[i]].probs.sum() > 0


@settings(max_examples=60, deadline=None)
@given(st.lists(trees(max_nodes=25), min_size=2, max_size=4))
def test_merged_sampled_nodes_keep_their_own_drafters_proposal(tree_list):
    """Each draft's proposals are its own: a sampled node must still point at the distribution
    its drafter sampled it from after the merge (verification divides by that q)."""
    tagged = []
    for index, tree in enumerate(tree_list):  # tree i proposes only token i, with probability 1
        proposal = SparseDist(np.array([index]), np.array([1.0]))
        tagged.append(
            TokenTree.build(tree.tokens, tree.parents, tree.logq, tree.proposal_of, [proposal])
        )
    merged = merge_trees(tagged)
    expected = [
        index
        for index, tree in enumerate(tagged)
        for i in range(1, tree.num_nodes)
        if tree.proposal_of[i] != DETERMINISTIC
    ]
    got = [
        int(merged.proposals[merged.proposal_of[i]].ids[0])
        for i in range(1, merged.num_nodes)
        if merged.proposal_of[i] != DETERMINISTIC
    ]
    assert got == expected


@settings(max_examples=60, deadline=None)
@given(trees(max_nodes=40), st.data())
def test_subtree_keeps_paths_of_kept_nodes(tree, data):
    keep = {0}
    for i in range(1, tree.num_nodes):
        if tree.parents[i] in keep and data.draw(st.booleans()):
            keep.add(i)
    sub = tree.subtree(sorted(keep))
    all_paths = paths(tree)
    assert sorted(paths(sub)) == sorted(all_paths[i] for i in keep)


@settings(max_examples=60, deadline=None)
@given(trees(max_nodes=40, sampled=False), st.data())
def test_kv_compaction_moves_the_accepted_path(tree, data):
    """Committing a root->leaf path leaves exactly that path's KV in the first slots."""
    node = data.draw(st.integers(0, tree.num_nodes - 1))
    path = tree.path_to(node)
    prefix, block = data.draw(st.integers(0, 9)), 4
    num_slots = prefix + tree.num_nodes
    num_blocks = (num_slots + block - 1) // block + 1
    k = torch.randn(2, num_blocks, block, 1, 3)
    v = torch.randn(2, num_blocks, block, 1, 3)
    perm = torch.randperm(num_blocks)  # block table: logical block b -> physical perm[b]
    slot = lambda i: int(perm[i // block]) * block + i % block  # noqa: E731
    before_k, before_v = k.clone(), v.clone()
    src = torch.tensor([slot(prefix + j) for j in path])
    dst = torch.tensor([slot(prefix + i) for i in range(len(path))])
    commit_kv_reference(k, v, src, dst)
    flat_k, flat_v = k.flatten(1, 2), v.flatten(1, 2)
    for i, j in enumerate(path):
        assert torch.equal(flat_k[:, slot(prefix + i)], before_k.flatten(1, 2)[:, slot(prefix + j)])
        assert torch.equal(flat_v[:, slot(prefix + i)], before_v.flatten(1, 2)[:, slot(prefix + j)])
    for i in range(prefix):
        assert torch.equal(flat_k[:, slot(i)], before_k.flatten(1, 2)[:, slot(i)])
