"""Building candidate token trees with a draft model, batched across requests.

The drafter's cache holds every committed token of a request, the root included (unlike the
target's, whose root KV is computed by the verify forward). A draft step

1. appends the tokens committed since the last step (the last of them is the new root) in one
   chain forward, whose last logits give the root's children;
2. grows each request's tree one layer per forward: the new nodes attend to the prefix and to
   their ancestors in the tree region;
3. discards the tree region, so the cache again holds exactly the committed tokens.

A feature-level draft (EAGLE-style, `ModelConfig.feature_size`) reads, beside each token, the
target's feature at the position before it (`DraftRequest.features`, sent by the verifier). Its
cache holds one entry per committed token after the first, so it can only root a tree once the
target has computed the feature before the root. Tree nodes read their parent's *predicted*
feature, the draft's own output at the parent.

Every frontier row's logits go through the request's logits processors with the counts of that
node's own path (`shared.engine.processors`), as the target's do when verifying; a seeded request
scores them with its Gumbel noise (`coupled_scores`) and drafts as greedy does on the scores.

Under a grammar (`SamplingParams.structured`, `self.grammar` set) every frontier row is masked
with its node's grammar state, so the draft proposes only allowed tokens; and where the grammar
forces a run of tokens after a node (the root included), the run is added as certain children
(log q = 0) with no draft forward: the node is not forwarded, and the draft model neither reads
nor proposes a forced token. Its next step appends them with the other committed tokens.

Four ways to pick children, all batched: a chain of k; SpecInfer's static expansion <k1..km>;
AdaServe's beam of depth d and width w (§4.3 step 1); and the CMU thesis's throughput-optimal
dynamic tree under a token budget with size, depth and width limits across the batch (§3.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from shared.engine.constraints import NodeConstraints
from shared.engine.processors import coupled_scores, process_logits
from shared.model.runner import ForwardItem, ModelRunner
from shared.values.methods import DraftMethod
from shared.values.sampling import DRAFT_STREAM, processed_probs, sample, step_rng
from shared.values.steps import DraftRequest
from shared.values.tree import DETERMINISTIC, SparseDist, TokenTree


@dataclass
class _Growing:
    """One request's tree while it grows; `region` maps forwarded nodes to tree-region slots."""

    req: DraftRequest
    max_depth: int  # no deeper: the plan's depth, the method's, and the room in the context
    rng: np.random.Generator
    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    logq: list[float] = field(default_factory=lambda: [0.0])
    path_lp: list[float] = field(default_factory=lambda: [0.0])
    proposal_of: list[int] = field(default_factory=lambda: [DETERMINISTIC])
    proposals: list[SparseDist] = field(default_factory=list)
    depth: list[int] = field(default_factory=lambda: [0])
    pruned: set[int] = field(default_factory=set)
    region: dict[int, int] = field(default_factory=lambda: {0: -1})  # the root is in the prefix
    frontier: list[int] = field(default_factory=lambda: [0])  # nodes whose logits we hold
    frontier_logits: torch.Tensor | None = None  # [len(frontier), num_out]
    # feature-level drafts: each forwarded node's output feature, read by its children
    feature_of: dict[int, torch.Tensor] = field(default_factory=dict)

    def add(self, parent: int, token: int, logq: float, proposal: int = DETERMINISTIC) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.logq.append(logq)
        self.path_lp.append(self.path_lp[parent] + logq)
        self.proposal_of.append(proposal)
        self.depth.append(self.depth[parent] + 1)
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """The node's draft tokens after the root."""
        tokens = []
        while node > 0:
            tokens.append(self.tokens[node])
            node = self.parents[node]
        return tokens[::-1]

    @property
    def num_draft_tokens(self) -> int:
        return len(self.tokens) - 1 - len(self.pruned)

    def room(self, method: DraftMethod) -> int:
        """Draft tokens this tree may still add (the method's and the request's limits)."""
        cap = method.max_draft_tokens
        if self.req.max_nodes:
            cap = min(cap, self.req.max_nodes)
        return cap - self.num_draft_tokens

    def result(self) -> TokenTree:
        tree = TokenTree.build(
            self.tokens, self.parents, self.logq, self.proposal_of, self.proposals
        )
        if not self.pruned:
            return tree
        return tree.subtree([i for i in range(len(self.tokens)) if i not in self.pruned])


class Drafter:
    """One draft model and the per-request draft KV it keeps in step with committed tokens."""

    def __init__(self, runner: ModelRunner, name: str = "draft") -> None:
        self.runner = runner
        self.name = name
        self.output_ids = runner.model.output_token_ids  # [num_out] full-vocab ids
        self.is_feature_level = bool(runner.cfg.feature_size)
        self.column_of = _column_of(self.output_ids)  # [V] full id -> column; None: the same
        self.grammar: NodeConstraints | None = None  # structured output's masks and forced runs

    def free(self, request_id: str) -> None:
        """The request's draft KV goes (a restart drafts it again from its committed tokens)."""
        self.runner.free_request(request_id)

    def release(self, request_id: str) -> None:
        """The request is done here: its draft KV and its grammar state go."""
        self.free(request_id)
        if self.grammar is not None:
            self.grammar.free(request_id)

    def has_request(self, request_id: str) -> bool:
        return self.runner.has_request(request_id)

    def num_committed(self, request_id: str) -> int:
        """Committed tokens of the request this drafter holds (0 if none): its cached entries,
        plus the first token for a feature-level draft (which caches none for it)."""
        if not self.runner.has_request(request_id):
            return 0
        return self.runner.num_cached(request_id) + int(self.is_feature_level)

    def feature_problem(self, req: DraftRequest) -> str | None:
        """Why a feature-level draft cannot take this request's features (None: it can). The
        row count is the wire type's to check; the width is the model's."""
        if not self.is_feature_level:
            return None
        width = self.runner.cfg.feature_size
        if req.features is None:
            return "missing_features: a feature-level draft needs the target's features"
        if req.features.shape[1] != width:
            return f"missing_features: need {width} columns, got {req.features.shape[1]}"
        return None

    def _prefix_salt(self, req: DraftRequest) -> bytes | None:
        """What this drafter's cached KV of the request depends on beside its entries' tokens:
        nothing for a token-level draft; for a feature-level one, the request's first token
        (entry i reads token i + 1 and the target's feature at i, which depends on every token
        up to i). None (not cached) when that token is not in hand."""
        if not self.is_feature_level:
            return b""
        if req.base_len != 0 or not req.new_tokens:
            return None
        return np.int64(req.new_tokens[0]).tobytes()

    def _append_committed(self, requests: Sequence[DraftRequest]) -> list[tuple[torch.Tensor, ...]]:
        """Append each request's new committed tokens; the root's logits (and, feature-level,
        its predicted feature), or () where no tree can be rooted yet."""
        items, rooted = [], []
        for r in requests:
            if not self.is_feature_level:
                # a prefix of a request new here may be cached: only the rest is forwarded
                skip = self.runner.attach_prefix(r.request_id, r.new_tokens, len(r.new_tokens) - 1)
                items.append(ForwardItem.chain(r.request_id, r.new_tokens[skip:]))
                rooted.append(r)
                continue
            tokens = r.feature_tokens
            if tokens:  # the first token of a request has no feature before it: no entry
                assert r.features is not None
                feats = torch.from_numpy(r.features).to(self.runner.device, self.runner.dtype)
                skip = self.runner.attach_prefix(r.request_id, tokens, len(tokens) - 1)
                items.append(
                    ForwardItem.chain(
                        r.request_id, tokens[skip:], features=feats[skip:], feature_rows="last"
                    )
                )
                rooted.append(r)
        outputs = self.runner.forward_full(items) if items else []
        self.runner.commit({item.request_id: range(len(item.tokens)) for item in items})
        by_id = {
            r.request_id: (out.logits, out.features) for r, out in zip(rooted, outputs, strict=True)
        }
        return [by_id.get(r.request_id, ()) for r in requests]

    # ---- the draft step ----------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, requests: Sequence[DraftRequest], method: DraftMethod) -> dict[str, TokenTree]:
        if not requests:
            return {}
        for req in requests:
            problem = self.feature_problem(req)
            if problem is not None:
                raise ValueError(f"request {req.request_id}: {problem}")
            if not self.runner.has_request(req.request_id):
                self.runner.add_request(req.request_id, self._prefix_salt(req))
        roots = self._append_committed(requests)
        trees = [
            _Growing(
                r,
                self._max_depth(r, method),
                step_rng(r.seed, r.step, DRAFT_STREAM),
                [int(r.new_tokens[-1])],
            )
            for r in requests
        ]
        for tree, root in zip(trees, roots, strict=True):
            if not root or self._add_forced(tree, 0, method):
                tree.frontier = []  # nothing to grow from (or forced): no draft proposal
                continue
            self._take_logits(tree, root[0])
            if self.is_feature_level:
                tree.feature_of[0] = root[1][0]
        for layer in range(1, method.num_layers + 1):
            active = [t for t in trees if t.frontier and layer <= t.max_depth]
            if method.kind == "dynamic":
                added = self._grow_dynamic(trees, active, method)
            else:
                added = {id(t): self._grow_layer(t, method, layer) for t in active}
            for t in trees:
                kept = [n for n in added.get(id(t), []) if n not in t.pruned]
                t.frontier = [n for n in kept if not self._add_forced(t, n, method)]
            if layer == method.num_layers:
                break
            self._forward_frontier([t for t in trees if t.frontier and layer < t.max_depth])
        for req in requests:
            self.runner.discard_tree(req.request_id)
        return {t.req.request_id: t.result() for t in trees}

    def _max_depth(self, req: DraftRequest, method: DraftMethod) -> int:
        """The plan's depth (0: none), the method's, and what the context leaves after the
        committed tokens (the root included, whose KV this drafter now holds)."""
        room = self.runner.max_context - self.num_committed(req.request_id)
        depth = min(method.num_layers, max(room, 0))
        return min(depth, req.max_depth) if req.max_depth else depth

    def _add_forced(self, t: _Growing, node: int, method: DraftMethod) -> bool:
        """Add the run of tokens the grammar forces after `node` as its certain children;
        whether there was one (the node is then not grown by the draft model).

        A drafted (not sampled) node and its run are retokenized as the tokenizer would write
        their text: a draft's '"' before a forced ',' becomes the '",' the target writes."""
        structured = t.req.sampling.structured
        if structured is None or self.grammar is None or t.req.history is None:
            return False
        context_room = self.runner.max_context - self.num_committed(t.req.request_id)
        limit = min(t.room(method), context_room - t.depth[node] - 1)
        run = self.grammar.forced(
            t.req.request_id, structured, t.req.history.output, t.path(node), limit
        )
        if run and node > 0 and t.proposal_of[node] == DETERMINISTIC:
            merged = self.grammar.canonical([t.tokens[node], *run])
            if merged[0] != t.tokens[node] and len(merged) <= len(run) + 1:
                t.tokens[node], run = merged[0], merged[1:]
        for token in run:
            node = t.add(node, token, 0.0)
        return bool(run)

    def _forward_frontier(self, trees: list[_Growing]) -> None:
        if not trees:
            return
        items = []
        for t in trees:
            base = self.runner.tree_size(t.req.request_id)
            parents = [t.region[t.parents[n]] for n in t.frontier]
            t.region.update({n: base + i for i, n in enumerate(t.frontier)})
            item = ForwardItem(t.req.request_id, [t.tokens[n] for n in t.frontier], parents)
            if self.is_feature_level:
                item.features = torch.stack([t.feature_of[t.parents[n]] for n in t.frontier])
                item.feature_rows = "all"
            items.append(item)
        for t, out in zip(trees, self.runner.forward_full(items), strict=True):
            self._take_logits(t, out.logits)
            if self.is_feature_level:
                t.feature_of.update(zip(t.frontier, out.features, strict=True))

    def _take_logits(self, t: _Growing, logits: torch.Tensor) -> None:
        """Hold the frontier's [len(frontier), num_out] logits, processed per node's path (a
        seeded request's: its Gumbel-perturbed scores)."""
        params = t.req.sampling
        if params.has_processors or params.structured is not None:
            paths = [t.path(node) for node in t.frontier]
            allowed = self._allowed(t, paths)
            logits = process_logits(logits, params, t.req.history, paths, self.column_of, allowed)
        if params.is_coupled:
            if t.req.history is None:
                raise ValueError(f"request {t.req.request_id}: a seeded draft needs its history")
            positions = [t.req.history.output_len + t.depth[node] for node in t.frontier]
            logits = coupled_scores(logits, params, positions, self.output_ids)
        t.frontier_logits = logits

    def _allowed(self, t: _Growing, paths: list[list[int]]) -> torch.Tensor | None:
        structured = t.req.sampling.structured
        if structured is None or self.grammar is None or t.req.history is None:
            return None
        width = int(self.output_ids.max()) + 1
        output = t.req.history.output
        return self.grammar.allowed(t.req.request_id, structured, output, paths, width)

    # ---- child selection -----------------------------------------------------------------------
    def _log_q(self, t: _Growing) -> torch.Tensor:
        """[len(frontier), num_out] log-probabilities used as acceptance estimates (a seeded
        request's: of its perturbed scores, whose argmax is the token it proposes)."""
        assert t.frontier_logits is not None
        params = t.req.sampling
        temperature = 1.0 if params.is_coupled else params.temperature or 1.0
        return torch.log_softmax(t.frontier_logits.double() / temperature, dim=-1)

    def _is_sampled(self, t: _Growing, method: DraftMethod) -> bool:
        params = t.req.sampling
        return not params.is_greedy and not params.is_coupled and method.kind in ("chain", "static")

    def _grow_layer(self, t: _Growing, method: DraftMethod, layer: int) -> list[int]:
        """Chain, static expansion and beam: every kept node of the last layer gets children."""
        if self._is_sampled(t, method):
            per_node = 1 if method.kind == "chain" else method.expansion[layer - 1]
            return self._sample_children(t, per_node, method)
        logq = self._log_q(t)
        if method.kind == "beam":
            width = min(method.width, t.room(method))
            return self._beam_layer(t, logq, width, method.min_path_logprob) if width > 0 else []
        per_node = 1 if method.kind == "chain" else method.expansion[layer - 1]
        top = logq.topk(per_node, dim=-1)
        added = []
        for row, node in enumerate(t.frontier):
            for lp, idx in zip(top.values[row].tolist(), top.indices[row].tolist(), strict=True):
                if t.path_lp[node] + lp >= method.min_path_logprob and t.room(method) > 0:
                    added.append(t.add(node, int(self.output_ids[idx]), lp))
        return added

    def _beam_layer(
        self, t: _Growing, logq: torch.Tensor, width: int, min_path_logprob: float
    ) -> list[int]:
        """AdaServe: the w children with the highest path probability among all w x |V|."""
        path_lps = [t.path_lp[n] for n in t.frontier]
        path = torch.tensor(path_lps, dtype=torch.float64, device=logq.device)
        scores = (logq + path[:, None]).flatten()
        top = scores.topk(min(width, scores.numel()))
        num_out = logq.shape[1]
        added = []
        for score, flat in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            if score < min_path_logprob:
                break
            row, idx = divmod(flat, num_out)
            added.append(t.add(t.frontier[row], int(self.output_ids[idx]), float(logq[row, idx])))
        return added

    def _sample_children(self, t: _Growing, per_node: int, method: DraftMethod) -> list[int]:
        """Draw children i.i.d. from a renormalized top-k of the processed draft distribution."""
        assert t.frontier_logits is not None
        probs = processed_probs(t.frontier_logits, t.req.sampling)  # [F, num_out]
        k = min(method.proposal_top_k, probs.shape[1])
        top = probs.topk(k, dim=-1)
        added = []
        for row, node in enumerate(t.frontier):
            if t.path_lp[node] < method.min_path_logprob or t.room(method) < per_node:
                continue  # not expanded; a drawn child is never dropped (losslessness)
            mass = top.values[row]
            keep = mass > 0
            q_probs = (mass[keep] / mass[keep].sum()).numpy()
            q_ids = self.output_ids[top.indices[row][keep]].numpy()
            t.proposals.append(SparseDist(ids=q_ids, probs=q_probs))
            proposal = len(t.proposals) - 1
            q_tensor = torch.from_numpy(q_probs)
            for _ in range(per_node):
                j = sample(q_tensor, t.rng.random())
                added.append(t.add(node, int(q_ids[j]), float(np.log(q_probs[j])), proposal))
        return added

    def _grow_dynamic(
        self, trees: list[_Growing], active: list[_Growing], method: DraftMethod
    ) -> dict[int, list[int]]:
        """Thesis Alg. 1, one layer for the whole batch.

        Each leaf of the last layer proposes its top children; per tree the best `max_width` by
        accumulated probability are candidates. Candidates are taken best-first across the batch:
        a child is added while its tree has room and the budget lasts; past a limit it replaces
        the lowest-probability node (of its own tree if the tree is full, of any tree if the
        budget is spent) when it beats it; a tree's first refused child ends that tree's layer.
        """
        candidates: list[tuple[float, int, int, int, float]] = []  # (path lp, tree, node, tok, lq)
        is_active = {id(t) for t in active}
        for ti, t in enumerate(trees):
            if id(t) not in is_active:
                continue
            logq = self._log_q(t)
            top = logq.topk(min(method.top_children, logq.shape[1]), dim=-1)
            mine = []
            for row, node in enumerate(t.frontier):
                for lq, idx in zip(
                    top.values[row].tolist(), top.indices[row].tolist(), strict=True
                ):
                    mine.append((t.path_lp[node] + lq, ti, node, int(self.output_ids[idx]), lq))
            mine = [c for c in mine if c[0] >= method.min_path_logprob]
            mine.sort(key=lambda c: -c[0])
            candidates.extend(mine[: method.max_width])
        candidates.sort(key=lambda c: -c[0])
        added: dict[int, list[int]] = {id(t): [] for t in trees}
        closed: set[int] = set()
        used = sum(t.num_draft_tokens for t in trees)
        for path_lp, ti, node, tok, lq in candidates:
            t = trees[ti]
            if ti in closed or node in t.pruned:
                continue
            if t.room(method) <= 0:
                victim = _lowest_leaf(trees, [ti])
            elif used >= method.budget:
                victim = _lowest_leaf(trees, range(len(trees)))
            else:
                victim = None
            if victim is not None:
                vt, vnode = victim
                if not path_lp > trees[vt].path_lp[vnode]:
                    closed.add(ti)
                    continue
                trees[vt].pruned.add(vnode)
                used -= 1
            added[id(t)].append(t.add(node, tok, lq))
            used += 1
        return added


def _column_of(output_ids: torch.Tensor) -> torch.Tensor | None:
    """[V] long: each full-vocabulary id's output column, -1 where the head has none (None when
    the head is the whole vocabulary in order)."""
    num_out = len(output_ids)
    positions = torch.arange(num_out, device=output_ids.device)
    if bool(torch.equal(output_ids, positions)):
        return None
    column_of = torch.full(
        (int(output_ids.max()) + 1,), -1, dtype=torch.long, device=output_ids.device
    )
    column_of[output_ids.long()] = positions
    return column_of


def _lowest_leaf(trees: list[_Growing], indices: Sequence[int]) -> tuple[int, int] | None:
    """The kept non-root leaf with the lowest path probability (deepest on ties)."""
    best: tuple[float, int, int, int] | None = None
    for ti in indices:
        t = trees[ti]
        has_kept_child = {t.parents[n] for n in range(1, len(t.tokens)) if n not in t.pruned}
        for n in range(1, len(t.tokens)):
            if n in t.pruned or n in has_kept_child:
                continue
            key = (t.path_lp[n], -t.depth[n], ti, n)
            if best is None or key < best:
                best = key
    return None if best is None else (best[2], best[3])
