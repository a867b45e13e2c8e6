"""Model-free drafts: token trees proposed from text the request (or its application) already has.

No model and no accelerator: each proposes from counts of what followed a match of the
request's last tokens, so copied text (code to edit, a passage to quote, a tool output that
recurs) is proposed in long runs at no drafting cost.

- `ngram` (prompt lookup): the longest n (from `max_n` down to `min_n`) for which the request's
  last n tokens occurred earlier in its own prompt and output; what followed the most recent
  `max_matches` of those occurrences, merged into a trie. Several matches that go on differently
  make branches.
- `suffix`: a suffix index (`SuffixIndex`: a suffix trie truncated at depth `max_n + 1`, kept as
  a map from each context of up to `max_n` tokens to the counts of the tokens that followed it)
  over the request's tokens, plus a bounded cache of recent sequences shared by the requests
  that name the same application key (`DraftRequest.app`), least recently used evicted. The tree
  grows best-first: at each node the longest context with counts picks the children.

Path probabilities come from the match statistics: a child's probability given its parent is its
count over the parent's count plus `1 / n` (n the matched context's length: one occurrence of a
long match is trusted more than one of a short match). They are the draft's estimate only; the
goodput planner calibrates them per request by what the target accepts, as for a model draft.

Every node is a deterministic choice (`DETERMINISTIC`): sampled verification treats it as a draw
from a point mass, accepted with the target's probability of the token, which keeps multi-step
speculative sampling lossless (`shared.engine.verification`).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

import numpy as np

from shared.engine.constraints import NodeConstraints
from shared.values.methods import DraftMethod
from shared.values.steps import DraftRequest
from shared.values.tree import TokenTree

ModelFreeKind = Literal["ngram", "suffix"]
MODEL_FREE_KINDS: tuple[ModelFreeKind, ...] = ("ngram", "suffix")


@dataclass(frozen=True)
class TreeLimits:
    """How large one proposed tree may be."""

    max_depth: int
    max_nodes: int  # draft tokens, the root excluded
    max_children: int  # children of one node
    min_path_logprob: float = -math.inf

    @classmethod
    def of(cls, method: DraftMethod, request: DraftRequest) -> TreeLimits:
        depth = method.num_layers
        if request.max_depth:
            depth = min(depth, request.max_depth)
        nodes = method.max_draft_tokens
        if request.max_nodes:
            nodes = min(nodes, request.max_nodes)
        match method.kind:
            case "chain":
                children = 1
            case "static":
                children = max(method.expansion)
            case "beam":
                children = method.width
            case _:
                children = method.top_children
        return cls(depth, nodes, children, method.min_path_logprob)


# A node's children as (token, count, recency): more recent continuations rank first on ties.
Continuations = list[tuple[int, int, int]]


def grow_tree(
    root: int,
    children_of: Callable[[tuple[int, ...]], tuple[Continuations, float]],
    limits: TreeLimits,
) -> TokenTree:
    """Best-first by path probability: `children_of(path)` gives the continuations after the
    root's path of draft tokens and the smoothing added to their total (`1 / n`)."""
    tokens, parents, logq, path_lp = [root], [-1], [0.0], [0.0]
    paths: list[tuple[int, ...]] = [()]
    depth = [0]
    # (-path logprob, order, parent, token, logq): the order breaks ties by rank, then age
    frontier: list[tuple[float, int, int, int, float]] = []
    order = 0

    def expand(node: int) -> None:
        nonlocal order
        if depth[node] >= limits.max_depth:
            return
        options, smoothing = children_of(paths[node])
        total = sum(count for _, count, _ in options) + smoothing
        ranked = sorted(options, key=lambda c: (-c[1], -c[2], c[0]))[: limits.max_children]
        base = path_lp[node]
        for token, count, _ in ranked:
            lq = math.log(count / total)
            if base + lq < limits.min_path_logprob:
                continue
            heapq.heappush(frontier, (-(base + lq), order, node, token, lq))
            order += 1

    expand(0)
    while frontier and len(tokens) - 1 < limits.max_nodes:
        _, _, parent, token, lq = heapq.heappop(frontier)
        tokens.append(token)
        parents.append(parent)
        logq.append(lq)
        path_lp.append(path_lp[parent] + lq)
        paths.append((*paths[parent], token))
        depth.append(depth[parent] + 1)
        expand(len(tokens) - 1)
    return TokenTree.build(tokens, parents, logq)  # a node comes after its parent


# ---- ngram: prompt lookup -----------------------------------------------------------------------


@dataclass(frozen=True)
class NgramSettings:
    max_n: int = 4
    min_n: int = 1
    max_matches: int = 8  # the most recent occurrences of the matched n-gram


def ngram_matches(tokens: np.ndarray, n: int) -> np.ndarray:
    """Start positions i (ascending) with tokens[i:i+n] equal to the last n tokens and at least
    one token after the occurrence (so never the last n tokens themselves)."""
    length = len(tokens)
    if n < 1 or length <= n:
        return np.zeros(0, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
    return np.flatnonzero((windows == tokens[length - n :]).all(axis=1))


@dataclass
class _Trie:
    """Continuations of the matches, merged: counts and the latest match through each node."""

    children: dict[tuple[int, ...], dict[int, list[int]]] = field(default_factory=dict)

    def add(self, continuation: Sequence[int], recency: int) -> None:
        path: tuple[int, ...] = ()
        for token in continuation:
            entry = self.children.setdefault(path, {}).setdefault(int(token), [0, recency])
            entry[0] += 1
            entry[1] = max(entry[1], recency)
            path = (*path, int(token))

    def options(self, path: tuple[int, ...]) -> Continuations:
        return [(tok, c, r) for tok, (c, r) in self.children.get(path, {}).items()]


def propose_ngram(tokens: Sequence[int], limits: TreeLimits, settings: NgramSettings) -> TokenTree:
    """Prompt lookup over the request's own tokens (the last one is the root)."""
    arr = np.asarray(tokens, dtype=np.int64)
    root = int(arr[-1])
    for n in range(min(settings.max_n, len(arr) - 1), settings.min_n - 1, -1):
        starts = ngram_matches(arr, n)
        if not starts.size:
            continue
        trie = _Trie()
        for start in starts[::-1][: settings.max_matches]:
            begin = int(start) + n
            trie.add(arr[begin : begin + limits.max_depth].tolist(), recency=begin)
        return _grow_trie(root, trie, 1.0 / n, limits)
    return TokenTree.root_only(root)


def _grow_trie(root: int, trie: _Trie, smoothing: float, limits: TreeLimits) -> TokenTree:
    return grow_tree(root, lambda path: (trie.options(path), smoothing), limits)


# ---- suffix: an index over the request and its application's recent sequences -------------------


@dataclass(frozen=True)
class SuffixSettings:
    max_n: int = 8  # longest context looked up
    cache_sequences: int = 64  # per application key, least recently used evicted
    cache_tokens: int = 1 << 16  # per application key, oldest sequences evicted past it
    max_apps: int = 64  # application keys with a cache, least recently used evicted


class SuffixIndex:
    """Counts of the token after every context of 1..max_n tokens, over whole sequences that can
    be added and removed (a suffix trie truncated at depth max_n + 1, as a map from context to
    next-token counts); `last` keeps, per context, the latest position seen, for recency."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.counts: dict[tuple[int, ...], Counter[int]] = {}
        self.last: dict[tuple[int, ...], dict[int, int]] = {}
        self.num_tokens = 0

    def _contexts(self, tokens: Sequence[int], end: int) -> list[tuple[int, ...]]:
        """The contexts ending just before position `end` (the next token is tokens[end])."""
        return [tuple(tokens[end - n : end]) for n in range(1, min(self.max_n, end) + 1)]

    def add_positions(self, tokens: Sequence[int], start: int, stamp: int = 0) -> None:
        """Index the token at each position from `start` on after its contexts."""
        for end in range(max(start, 1), len(tokens)):
            token = int(tokens[end])
            for context in self._contexts(tokens, end):
                self.counts.setdefault(context, Counter())[token] += 1
                self.last.setdefault(context, {})[token] = stamp + end
        self.num_tokens += max(0, len(tokens) - max(start, 1))

    def remove(self, tokens: Sequence[int]) -> None:
        """Take a whole sequence added before back out."""
        for end in range(1, len(tokens)):
            token = int(tokens[end])
            for context in self._contexts(tokens, end):
                counter = self.counts[context]
                counter[token] -= 1
                if counter[token] <= 0:
                    del counter[token]
                    self.last[context].pop(token, None)
                if not counter:
                    del self.counts[context]
                    del self.last[context]
        self.num_tokens -= max(0, len(tokens) - 1)

    def lookup(self, context: Sequence[int]) -> tuple[int, Continuations]:
        """(n, continuations) for the longest suffix of `context` with counts; (0, [])."""
        for n in range(min(self.max_n, len(context)), 0, -1):
            key = tuple(context[len(context) - n :])
            counter = self.counts.get(key)
            if counter:
                last = self.last[key]
                return n, [(tok, c, last.get(tok, 0)) for tok, c in counter.items()]
        return 0, []


class SequenceCache:
    """One application's recent sequences in one index: at most `max_sequences` of them and
    `max_tokens` tokens, the least recently added evicted first. A sequence added again under
    the same key (a request whose draft state was freed twice) replaces its earlier copy."""

    def __init__(self, settings: SuffixSettings) -> None:
        self.settings = settings
        self.index = SuffixIndex(settings.max_n)
        self.sequences: OrderedDict[str, list[int]] = OrderedDict()
        self._stamp = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences.values())

    def add(self, key: str, tokens: Sequence[int]) -> None:
        self.discard(key)
        tokens = list(tokens)[-self.settings.cache_tokens :]
        if len(tokens) < 2:
            return
        self.sequences[key] = tokens
        self._stamp += 1 << 32  # later sequences are more recent than any position of earlier
        self.index.add_positions(tokens, 1, stamp=self._stamp)
        while len(self.sequences) > self.settings.cache_sequences or (
            self.num_tokens > self.settings.cache_tokens
        ):
            _, evicted = self.sequences.popitem(last=False)
            self.index.remove(evicted)

    def discard(self, key: str) -> None:
        old = self.sequences.pop(key, None)
        if old is not None:
            self.index.remove(old)


class AppCaches:
    """The caches of recent sequences by application key, least recently used keys evicted."""

    def __init__(self, settings: SuffixSettings) -> None:
        self.settings = settings
        self.caches: OrderedDict[str, SequenceCache] = OrderedDict()

    def get(self, app: str) -> SequenceCache | None:
        cache = self.caches.get(app)
        if cache is not None:
            self.caches.move_to_end(app)
        return cache

    def add(self, app: str, key: str, tokens: Sequence[int]) -> None:
        cache = self.get(app)
        if cache is None:
            cache = self.caches[app] = SequenceCache(self.settings)
            while len(self.caches) > self.settings.max_apps:
                self.caches.popitem(last=False)
        cache.add(key, tokens)


def propose_suffix(
    tokens: Sequence[int],
    own: SuffixIndex,
    shared: SuffixIndex | None,
    limits: TreeLimits,
) -> TokenTree:
    """Grow from the request's own index and its application's cache: at each node the longest
    context either has counts for, their counts summed where both match that long."""
    root = int(tokens[-1])
    tail = list(tokens[-own.max_n :])

    def children_of(path: tuple[int, ...]) -> tuple[Continuations, float]:
        context = [*tail, *path]
        n_own, mine = own.lookup(context)
        n_shared, theirs = shared.lookup(context) if shared is not None else (0, [])
        n = max(n_own, n_shared)
        if n == 0:
            return [], 1.0
        merged: dict[int, list[int]] = {}
        for used, options in ((n_own, mine), (n_shared, theirs)):
            if used != n:
                continue
            for tok, count, recency in options:
                entry = merged.setdefault(tok, [0, recency])
                entry[0] += count
                entry[1] = max(entry[1], recency)
        return [(tok, c, r) for tok, (c, r) in merged.items()], 1.0 / n

    return grow_tree(root, children_of, limits)


# ---- the drafter --------------------------------------------------------------------------------


class Proposer(Protocol):
    def propose(self, request_id: str, tokens: Sequence[int], limits: TreeLimits) -> TokenTree:
        """A tree rooted at the last of the request's committed `tokens`."""
        ...

    def appended(self, request_id: str, tokens: Sequence[int], start: int, app: str) -> None:
        """The request's committed tokens are now `tokens`, new from `start` on."""
        ...

    def free(self, request_id: str, tokens: Sequence[int], app: str) -> None:
        """The request's draft state goes (its tokens may feed its application's cache)."""
        ...


class NgramProposer:
    def __init__(self, settings: NgramSettings | None = None) -> None:
        self.settings = settings or NgramSettings()

    def propose(self, request_id: str, tokens: Sequence[int], limits: TreeLimits) -> TokenTree:
        return propose_ngram(tokens, limits, self.settings)

    def appended(self, request_id: str, tokens: Sequence[int], start: int, app: str) -> None:
        pass

    def free(self, request_id: str, tokens: Sequence[int], app: str) -> None:
        pass


class SuffixProposer:
    def __init__(self, settings: SuffixSettings | None = None) -> None:
        self.settings = settings or SuffixSettings()
        self.own: dict[str, SuffixIndex] = {}
        self.apps = AppCaches(self.settings)
        self._app_of: dict[str, str] = {}

    def propose(self, request_id: str, tokens: Sequence[int], limits: TreeLimits) -> TokenTree:
        app = self._app_of.get(request_id, "")
        cache = self.apps.get(app) if app else None
        shared = cache.index if cache is not None else None
        return propose_suffix(tokens, self.own[request_id], shared, limits)

    def appended(self, request_id: str, tokens: Sequence[int], start: int, app: str) -> None:
        index = self.own.get(request_id)
        if index is None or start == 0:
            index = self.own[request_id] = SuffixIndex(self.settings.max_n)
        index.add_positions(tokens, start)
        if app:
            self._app_of[request_id] = app

    def free(self, request_id: str, tokens: Sequence[int], app: str) -> None:
        self.own.pop(request_id, None)
        app = self._app_of.pop(request_id, app)
        if app and tokens:
            self.apps.add(app, request_id, tokens)


def make_proposer(kind: str) -> Proposer:
    match kind:
        case "ngram":
            return NgramProposer()
        case "suffix":
            return SuffixProposer()
    raise ValueError(f"unknown model-free draft {kind!r}; known: {list(MODEL_FREE_KINDS)}")


class ModelFreeDrafter:
    """A draft that loads no model: the engine's `Drafter` interface over a `Proposer`, keeping
    each request's committed tokens (its whole draft state)."""

    is_feature_level = False
    is_model_free = True

    def __init__(self, kind: str, name: str | None = None, proposer: Proposer | None = None):
        self.kind = kind
        self.name = name or kind
        self.proposer = proposer or make_proposer(kind)
        self.grammar: NodeConstraints | None = None  # structured output's forced runs
        self._tokens: dict[str, list[int]] = {}
        self._app: dict[str, str] = {}

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tokens

    def num_committed(self, request_id: str) -> int:
        return len(self._tokens.get(request_id, ()))

    def tokens(self, request_id: str) -> list[int]:
        return self._tokens.get(request_id, [])

    def free(self, request_id: str) -> None:
        tokens = self._tokens.pop(request_id, None)
        app = self._app.pop(request_id, "")
        if tokens is not None:
            self.proposer.free(request_id, tokens, app)

    def feature_problem(self, req: DraftRequest) -> str | None:
        return None

    def sync_problem(self, req: DraftRequest) -> str | None:
        """Why the request's job does not follow from what this drafter holds (None: it does)."""
        have = 0 if req.base_len == 0 else self.num_committed(req.request_id)
        if have != req.base_len:
            return f"out_of_sync: holds {have} tokens, job says {req.base_len}"
        if not req.new_tokens:
            return "out_of_sync: no new tokens to root a tree at"
        return None

    def _append(self, req: DraftRequest) -> None:
        if req.base_len == 0 and req.request_id in self._tokens:
            self.free(req.request_id)
        tokens = self._tokens.setdefault(req.request_id, [])
        start = len(tokens)
        tokens.extend(int(t) for t in req.new_tokens)
        if req.app:
            self._app[req.request_id] = req.app
        self.proposer.appended(req.request_id, tokens, start, req.app)

    def draft(self, requests: Sequence[DraftRequest], method: DraftMethod) -> dict[str, TokenTree]:
        out = {}
        for req in requests:
            problem = self.sync_problem(req)
            if problem is not None:
                raise ValueError(f"request {req.request_id}: {problem}")
            self._append(req)
            tokens = self._tokens[req.request_id]
            limits = TreeLimits.of(method, req)
            run = self._forced_run(req, limits)
            if not run:
                out[req.request_id] = self.proposer.propose(req.request_id, tokens, limits)
                continue
            rest = replace(
                limits, max_depth=limits.max_depth - len(run), max_nodes=limits.max_nodes - len(run)
            )
            after = self.proposer.propose(req.request_id, [*tokens, *run], rest)
            out[req.request_id] = after_chain(tokens[-1], run, after)
        return out

    def _forced_run(self, req: DraftRequest, limits: TreeLimits) -> list[int]:
        """The tokens a structured request's grammar forces after its committed output: certain
        draft tokens that no lookup needs to find (JSON keys and punctuation)."""
        structured = req.sampling.structured
        if structured is None or self.grammar is None or req.history is None:
            return []
        limit = min(limits.max_depth, limits.max_nodes)
        return self.grammar.forced(req.request_id, structured, req.history.output, [], limit)

    def release(self, request_id: str) -> None:
        """The request is done here: its tokens and its grammar state go."""
        self.free(request_id)
        if self.grammar is not None:
            self.grammar.free(request_id)


def after_chain(root: int, run: Sequence[int], tree: TokenTree) -> TokenTree:
    """`root`, then the certain chain `run` (probability 1), then `tree` (rooted at run[-1])."""
    k = len(run)
    parents = [-1, *range(k), *(int(p) + k for p in tree.parents[1:])]
    logq = [0.0] * (k + 1) + [float(q) for q in tree.logq[1:]]
    return TokenTree.build([root, *run, *(int(t) for t in tree.tokens[1:])], parents, logq)


def model_free_names(drafters: Mapping[str, object]) -> frozenset[str]:
    """The names of the model-free drafts among an engine's drafters."""
    return frozenset(n for n, d in drafters.items() if getattr(d, "is_model_free", False))
