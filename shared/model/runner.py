"""The model runner: owns the model, its paged KV cache and every tensor built from a batch.

Callers describe work per request in plain Python (`ForwardItem`): which new tokens, and for each
its parent inside the request's *tree region* (the uncommitted slots after the committed prefix).
A prompt chunk is a chain whose nodes are committed right after the forward; a verifier tree is
committed along its accepted path; a drafter's tree is discarded once the tree is built.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import takewhile
from typing import Literal

import numpy as np
import torch

from kernels.attention_metadata import AttentionMetadata, num_mask_words
from kernels.cpu_tree_attention import EXACT_ROWS, CpuTreeAttention
from kernels.reference import commit_kv_reference
from shared.errors import ContextLengthError, InvalidRequestError
from shared.model.cuda_graphs import (
    DEFAULT_MAX_REQUESTS,
    DEFAULT_MAX_TOKENS,
    GraphedForward,
    PackedBatch,
)
from shared.model.kv_cache import PagedKVCache, SwappedKV
from shared.model.llama import AttentionFn, LlamaModel
from shared.values.blocks import BlockHash, block_hashes

LogitsRows = Literal["all", "last", "none"]


@dataclass
class ForwardItem:
    request_id: str
    tokens: Sequence[int]
    # Parent of each new token inside the request's tree region: an index of a node cached by an
    # earlier forward, or of an earlier token of this item; -1 attaches it to the prefix end.
    parents: Sequence[int]
    logits: LogitsRows = "all"
    # A feature-level model's input features, one row per token ([n, feature_size]).
    features: torch.Tensor | None = None
    # Rows whose output features (`LlamaModel.output_features`) to return.
    feature_rows: LogitsRows = "none"

    @classmethod
    def chain(
        cls,
        request_id: str,
        tokens: Sequence[int],
        logits: LogitsRows = "last",
        *,
        features: torch.Tensor | None = None,
        feature_rows: LogitsRows = "none",
    ) -> ForwardItem:
        parents = list(range(-1, len(tokens) - 1))
        return cls(request_id, tokens, parents, logits, features, feature_rows)


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # [rows asked by `ForwardItem.logits`, num_output_tokens], fp32
    features: torch.Tensor  # [rows asked by `ForwardItem.feature_rows`, hidden]


@dataclass(frozen=True)
class _OutputRows:
    """Packed rows whose logits and output features a forward returns, and how many per item."""

    logits: list[int]
    logit_counts: list[int]
    features: list[int]
    feature_counts: list[int]


@dataclass
class _Sequence:
    num_cached: int = 0  # committed tokens whose KV is in the cache
    # prefix caching: those tokens (a full block of them is named once committed), the salt of
    # the names (None: this request's blocks are not named), how many blocks are named and the
    # last one's name
    tokens: list[int] = field(default_factory=list)
    salt: bytes | None = b""
    num_named: int = 0
    last_name: BlockHash | None = None
    # a feature-level draft's target: features of committed positions [feature_start,
    # feature_start + len), not yet kept with a named block (`PrefixCache.set_features`)
    feature_rows: np.ndarray | None = None
    feature_start: int = 0
    tree_tokens: list[int] = field(default_factory=list)  # the tree region's tokens
    # The tree region, one entry per node: parent, depth (0 = attached to the prefix) and the
    # ancestor bitmask over tree-region indices, as a Python int.
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    masks: list[int] = field(default_factory=list)

    def clear_tree(self) -> None:
        self.tree_tokens.clear()
        self.parents.clear()
        self.depths.clear()
        self.masks.clear()


def mask_words(masks: Sequence[int], num_words: int) -> np.ndarray:
    """Python-int bitmasks -> [N, num_words] int64 (bit j of row i in word j // 64)."""
    nbytes = 8 * num_words
    raw = b"".join(m.to_bytes(nbytes, "little") for m in masks)
    return np.frombuffer(raw, dtype=np.int64).reshape(len(masks), num_words).copy()


def select_attention(device: torch.device, *, exact: bool = False) -> tuple[AttentionFn, object]:
    """Chosen once per runner: the Triton kernels on CUDA, the planned CPU implementation
    elsewhere (`kernels.cpu_tree_attention`; the PyTorch reference is what both are tested
    against). `exact`: on a CPU, trees attend row by row (bitwise as plain decoding)."""
    if device.type == "cuda":
        try:
            from kernels.triton_tree_attention import commit_kv_triton, tree_attention_triton
        except ImportError:
            pass
        else:
            return tree_attention_triton, commit_kv_triton
    return CpuTreeAttention(exact_rows=EXACT_ROWS if exact else 0), commit_kv_reference


def is_triton_attention(attention: AttentionFn) -> bool:
    """Whether `attention` is the Triton kernel (only it can be recorded in a CUDA graph); the
    module is not imported for the question: if it is not loaded, `attention` is not from it."""
    module = sys.modules.get("kernels.triton_tree_attention")
    return module is not None and attention is module.tree_attention_triton


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        *,
        block_size: int = 16,
        kv_memory_bytes: int = 256 << 20,
        attention: AttentionFn | None = None,
        cuda_graph_max_tokens: int = DEFAULT_MAX_TOKENS,
        cuda_graph_max_requests: int = DEFAULT_MAX_REQUESTS,
        record_graphs: bool = True,
        prefix_caching: bool = True,
        max_kept_fraction: float = 1.0,
        exact_attention: bool = False,
    ) -> None:
        """`cuda_graph_max_tokens`: on CUDA with the Triton attention, forwards of up to this
        many tokens over up to `cuda_graph_max_requests` requests replay CUDA graphs
        (`shared.model.cuda_graphs`); 0 runs every forward eagerly. `record_graphs=False` runs
        those forwards through the graphs' padded static buffers without recording them, on any
        device with the Triton attention (interpreted on a CPU): the graphs' inputs can then be
        checked where no GPU is. `prefix_caching`: full blocks of committed tokens are shared
        between requests and kept after them, up to `max_kept_fraction` of the cache
        (`docs/prefix-caching.md`). `exact_attention`: on a CPU, trees attend row by row, so a
        tree's tokens round as plain decoding's (`kernels.cpu_tree_attention`)."""
        self.model = model
        self.cfg = model.cfg
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        default_attention, self._commit_kv = select_attention(self.device, exact=exact_attention)
        self.attention = attention or default_attention
        use_graphs = (
            cuda_graph_max_tokens > 0
            and is_triton_attention(self.attention)
            and (self.device.type == "cuda" or not record_graphs)
        )
        self.cache = PagedKVCache(
            self.cfg,
            block_size=block_size,
            memory_bytes=kv_memory_bytes,
            dtype=self.dtype,
            device=self.device,
            scratch_block=use_graphs,
            prefix_caching=prefix_caching,
            max_kept_fraction=max_kept_fraction,
        )
        self.graphs = (
            self._graphed_forward(
                cuda_graph_max_tokens, cuda_graph_max_requests, capture=record_graphs
            )
            if use_graphs
            else None
        )
        self._seqs: dict[str, _Sequence] = {}
        self._swapped_salts: dict[str, bytes | None] = {}
        self.num_tokens_forwarded = 0  # every forward's new tokens, prompt chunks and tree nodes

    def _graphed_forward(
        self, max_tokens: int, max_requests: int, *, capture: bool
    ) -> GraphedForward:
        cache = self.cache
        if cache.scratch_slot is None:
            raise ValueError("a graphed forward needs a KV cache with a scratch block")
        context_blocks = cache.num_blocks_for(self.max_context)
        return GraphedForward(
            self.model,
            cache.k,
            cache.v,
            self.attention,
            scratch_slot=cache.scratch_slot,
            max_blocks_per_request=min(cache.num_blocks, context_blocks),
            max_tokens=max_tokens,
            max_requests=max_requests,
            capture=capture,
        )

    def capture_graphs(self) -> int:
        """Record the CUDA graphs of every token count now (else each on first use); returns how
        many there are (0 without graphs)."""
        if self.graphs is None or not self.graphs.is_capturing:
            return 0
        with torch.inference_mode():
            self.graphs.capture_all()
        return self.graphs.num_graphs

    # ---- request lifecycle -------------------------------------------------------------------
    @property
    def max_context(self) -> int:
        return self.cfg.max_position_embeddings

    def add_request(self, request_id: str, salt: bytes | None = b"") -> None:
        """`salt` goes into the names of the request's cached blocks: what, beside the tokens,
        their KV depends on (None: its blocks are neither named nor looked up)."""
        self.cache.add(request_id)
        self._seqs[request_id] = _Sequence(salt=salt)

    def free_request(self, request_id: str) -> None:
        self._swapped_salts.pop(request_id, None)
        if request_id in self._seqs:
            del self._seqs[request_id]
            self.cache.free(request_id)

    def swap_out(self, request_id: str) -> SwappedKV:
        """Move a request's committed KV to host memory and free its blocks (preemption)."""
        seq = self._seqs.pop(request_id)
        swapped = self.cache.swap_out(request_id, seq.num_cached)
        swapped.token_ids = tuple(seq.tokens) if seq.salt is not None else ()
        self._swapped_salts[request_id] = seq.salt
        return swapped

    def swap_in(self, request_id: str, swapped: SwappedKV) -> None:
        self.cache.swap_in(request_id, swapped)
        salt = self._swapped_salts.pop(request_id, None)
        if len(swapped.token_ids) != swapped.num_tokens:
            salt = None  # the tokens are not known: its blocks stay unnamed
        seq = _Sequence(num_cached=swapped.num_tokens, tokens=list(swapped.token_ids), salt=salt)
        self._seqs[request_id] = seq
        self._name_blocks(request_id, seq)

    # ---- prefix caching ------------------------------------------------------------------------
    @property
    def prefix_caching(self) -> bool:
        return self.cache.prefix is not None

    def attach_prefix(
        self, request_id: str, tokens: Sequence[int], limit: int, *, with_features: bool = False
    ) -> int:
        """Extend the request's committed KV by the cached blocks of its next `tokens` (those after
        what it holds), at most `limit` of them (a forward must still compute the token whose
        logits it needs); returns how many of `tokens` it now holds, which the caller does not
        forward. Only a request that holds whole blocks, every one named, and no tree can be
        extended (a new one, or one whose chunks ended on block boundaries); 0 otherwise and
        with prefix caching off. `with_features`: only blocks whose features are kept too
        (`prefix_features` reads them)."""
        seq = self._seqs[request_id]
        prefix = self.cache.prefix
        block_size = self.cache.block_size
        full = seq.num_cached // block_size
        if (
            prefix is None
            or seq.salt is None
            or seq.parents
            or seq.num_cached % block_size
            or seq.num_named != full
            or len(self.cache.blocks(request_id)) != full
        ):
            return 0
        usable = max(0, min(limit, len(tokens)))
        names = block_hashes(tokens[:usable], block_size, salt=seq.salt, parent=seq.last_name)
        if not names:
            return 0
        blocks = prefix.lookup(names)
        if with_features:  # up to the first block without features
            blocks = list(takewhile(lambda b: prefix.features_of(b) is not None, blocks))
        prefix.count(len(names) * block_size, len(blocks) * block_size)
        if not blocks:
            return 0
        self.cache.extend(request_id, blocks)
        hit = len(blocks) * block_size
        seq.num_cached += hit
        seq.tokens.extend(tokens[:hit])
        seq.num_named += len(blocks)
        seq.last_name = names[len(blocks) - 1]
        seq.feature_rows = None  # the attached blocks' features are kept with them
        return hit

    def prefix_features(self, request_id: str, start: int, end: int) -> np.ndarray:
        """The kept features of positions [start, end), block-aligned, of the request's blocks
        attached `with_features`."""
        prefix, block_size = self.cache.prefix, self.cache.block_size
        if prefix is None or start % block_size or end % block_size:
            raise ValueError(f"features of [{start}, {end}): not whole blocks of a prefix cache")
        blocks = self.cache.blocks(request_id)[start // block_size : end // block_size]
        rows = [prefix.features_of(block) for block in blocks]
        if any(r is None for r in rows):
            raise KeyError(f"request {request_id}: no features kept for [{start}, {end})")
        return np.concatenate(rows)

    def _keep_features(self, seq: _Sequence, start: int, rows: np.ndarray) -> None:
        """Record committed positions' features (from `start`) until their blocks are named;
        only where blocks are named at all."""
        if self.cache.prefix is None or seq.salt is None:
            return
        held = seq.feature_rows
        if held is None or seq.feature_start + len(held) != start:  # a gap: start over
            seq.feature_rows, seq.feature_start = rows, start
        else:
            seq.feature_rows = np.concatenate([held, rows])

    def _name_blocks(self, request_id: str, seq: _Sequence) -> None:
        """Name the request's full blocks of committed tokens not named yet (a block whose name
        another block already has stays unnamed: the request's own, freed with it)."""
        prefix = self.cache.prefix
        if prefix is None or seq.salt is None:
            return
        block_size = self.cache.block_size
        full = seq.num_cached // block_size
        if full <= seq.num_named:
            return
        names = block_hashes(
            seq.tokens[: full * block_size],
            block_size,
            salt=seq.salt,
            first=seq.num_named,
            parent=seq.last_name,
        )
        blocks = self.cache.blocks(request_id)
        for index, name in enumerate(names, start=seq.num_named):
            prefix.insert(name, blocks[index])
        if seq.feature_rows is not None:
            self._name_features(seq, names, full)
        seq.num_named = full
        seq.last_name = names[-1]

    def _name_features(self, seq: _Sequence, names: Sequence[BlockHash], full: int) -> None:
        """Keep the recorded features of the blocks just named with them; drop the rows
        before the first block not full yet."""
        prefix, block_size = self.cache.prefix, self.cache.block_size
        assert prefix is not None and seq.feature_rows is not None
        rows = seq.feature_rows
        for index, name in enumerate(names, start=seq.num_named):
            lo = index * block_size - seq.feature_start
            if lo >= 0 and lo + block_size <= len(rows):
                prefix.set_features(name, rows[lo : lo + block_size])
        cut = max(0, full * block_size - seq.feature_start)
        seq.feature_rows = rows[cut:] if cut < len(rows) else None
        seq.feature_start += cut

    def blocks_needed(self, request_id: str | None, num_new_tokens: int) -> int:
        """Blocks a forward of `num_new_tokens` more tokens would have to allocate."""
        have = len(self.cache.blocks(request_id)) if request_id in self._seqs else 0
        used = self.num_cached(request_id) if request_id in self._seqs else 0
        return max(0, self.cache.num_blocks_for(used + num_new_tokens) - have)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._seqs

    def num_cached(self, request_id: str) -> int:
        return self._seqs[request_id].num_cached

    def tree_size(self, request_id: str) -> int:
        return len(self._seqs[request_id].parents)

    # ---- the forward ---------------------------------------------------------------------------
    def _validate(self, item: ForwardItem, seq: _Sequence) -> None:
        n = len(item.tokens)
        if n == 0 or len(item.parents) != n:
            raise InvalidRequestError(
                f"request {item.request_id}: {n} tokens with {len(item.parents)} parents"
            )
        vocab = self.cfg.vocab_size
        bad = [t for t in item.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} out of range [0, {vocab})", param="prompt"
            )
        base = len(seq.parents)
        for i, p in enumerate(item.parents):
            if not -1 <= p < base + i:
                raise InvalidRequestError(f"node {base + i} has parent {p}: not an earlier node")

    def forward(self, items: Sequence[ForwardItem]) -> list[torch.Tensor]:
        """One packed forward; returns each item's logits [rows, num_output_tokens]."""
        return [out.logits for out in self.forward_full(items)]

    @torch.inference_mode()
    def forward_full(self, items: Sequence[ForwardItem]) -> list[ForwardOutput]:
        """One packed forward; each item's logits and, where asked, output features."""
        seqs = [self._seqs[item.request_id] for item in items]
        if self.cfg.feature_size:
            missing = [item.request_id for item in items if item.features is None]
            if missing:
                raise InvalidRequestError(f"feature-level model: no features for {missing[0]}")
        plans = []
        for item, seq in zip(items, seqs, strict=True):
            self._validate(item, seq)
            base = len(seq.parents)
            depths = list(seq.depths)
            for p in item.parents:
                depths.append(0 if p < 0 else depths[p] + 1)
            new_depths = depths[base:]
            last_position = seq.num_cached + max(new_depths)
            if last_position >= self.max_context:
                raise ContextLengthError(
                    f"request {item.request_id} would reach position {last_position}, past the "
                    f"model's context of {self.max_context} tokens",
                    param="max_tokens",
                )
            plans.append((base, new_depths))
        for item, seq, (base, _) in zip(items, seqs, plans, strict=True):
            self.cache.reserve(item.request_id, seq.num_cached + base + len(item.tokens))
        self.num_tokens_forwarded += sum(len(item.tokens) for item in items)

        batch, rows = self._pack(items, seqs, plans)
        hidden = self._hidden_states(batch)
        logit_rows, row_counts = rows.logits, rows.logit_counts
        feature_rows, feature_counts = rows.features, rows.feature_counts
        features = hidden.new_empty(0, hidden.shape[1])
        if feature_rows:
            features = self.model.output_features(hidden[feature_rows])
        if not logit_rows:
            logits = hidden.new_empty(0, 0)
        elif logit_rows == feature_rows:  # a verified tree: the head reads the same features
            logits = self.model.head_logits(features)
        else:
            logits = self.model.logits(hidden[logit_rows])
        per_item_logits = logits.split(row_counts) if logit_rows else [logits] * len(items)
        per_item_features = (
            features.split(feature_counts) if feature_rows else [features] * len(items)
        )
        return [
            ForwardOutput(lg, ft) for lg, ft in zip(per_item_logits, per_item_features, strict=True)
        ]

    def _pack(
        self,
        items: Sequence[ForwardItem],
        seqs: list[_Sequence],
        plans: list[tuple[int, list[int]]],
    ) -> tuple[PackedBatch, _OutputRows]:
        """Lay the items out as one packed batch (their nodes join each request's tree region)
        and say which rows each item wants logits and features of."""
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[np.ndarray] = []
        new_masks: list[int] = []
        query_start = [0]
        logit_rows: list[int] = []
        row_counts: list[int] = []
        feature_rows: list[int] = []
        feature_counts: list[int] = []
        for item, seq, (base, new_depths) in zip(items, seqs, plans, strict=True):
            n = len(item.tokens)
            start = query_start[-1]
            tokens.extend(item.tokens)
            positions.extend(seq.num_cached + d for d in new_depths)
            lo = seq.num_cached + base
            slots.append(self.cache.slots(item.request_id, lo, lo + n))
            for i, p in enumerate(item.parents):
                m = (seq.masks[p] if p >= 0 else 0) | (1 << (base + i))
                seq.masks.append(m)
                new_masks.append(m)
            seq.tree_tokens.extend(item.tokens)
            seq.parents.extend(item.parents)
            seq.depths.extend(new_depths)
            query_start.append(start + n)
            rows = {"all": range(start, start + n), "last": [start + n - 1], "none": []}
            chosen = rows[item.logits]
            logit_rows.extend(chosen)
            row_counts.append(len(chosen))
            chosen = rows[item.feature_rows]
            feature_rows.extend(chosen)
            feature_counts.append(len(chosen))

        tree_lens = [len(seq.parents) for seq in seqs]
        max_blocks = max(len(self.cache.blocks(item.request_id)) for item in items)
        table = np.full((len(items), max_blocks), -1, dtype=np.int32)
        for r, item in enumerate(items):
            blocks = self.cache.blocks(item.request_id)
            table[r, : len(blocks)] = blocks
        features = None
        if self.cfg.feature_size:
            features = torch.cat([item.features for item in items])  # all present: checked
        batch = PackedBatch(
            tokens=tokens,
            positions=positions,
            slots=np.concatenate(slots),
            tree_mask=mask_words(new_masks, num_mask_words(max(tree_lens))),
            query_start=query_start,
            prefix_lens=[seq.num_cached for seq in seqs],
            tree_lens=tree_lens,
            block_table=table,
            features=features,
        )
        return batch, _OutputRows(logit_rows, row_counts, feature_rows, feature_counts)

    def _hidden_states(self, batch: PackedBatch) -> torch.Tensor:
        """[T, hidden]: a CUDA graph's replay when the batch fits one, else the eager forward."""
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.hidden_states(batch)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(batch.query_start, dtype=torch.int32, device=dev),
            prefix_lens=torch.tensor(batch.prefix_lens, dtype=torch.int32, device=dev),
            tree_lens=torch.tensor(batch.tree_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(batch.block_table).to(dev),
            slot_mapping=torch.from_numpy(batch.slots).to(dev),
            tree_mask=torch.from_numpy(batch.tree_mask).to(dev),
            query_start_host=batch.query_start,
            prefix_lens_host=batch.prefix_lens,
            tree_lens_host=batch.tree_lens,
        )
        features = None if batch.features is None else batch.features.to(dev)
        return self.model.hidden_states(
            torch.tensor(batch.tokens, dtype=torch.long, device=dev),
            torch.tensor(batch.positions, dtype=torch.long, device=dev),
            meta,
            self.cache.k,
            self.cache.v,
            self.attention,
            features,
        )

    # ---- after the forward --------------------------------------------------------------------
    def commit(
        self,
        paths: Mapping[str, Sequence[int]],
        features: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Keep only each request's accepted path of tree nodes, compacted after its prefix.

        `paths[rid]` lists tree-region nodes root-first, each the parent of the next (empty keeps
        nothing). Their KV moves to the committed slots; the rest of the tree region is dropped.
        `features[rid]`: the target's features of those nodes, kept with the blocks they fill.
        """
        src: list[np.ndarray] = []
        dst: list[np.ndarray] = []
        for rid, path in paths.items():
            seq = self._seqs[rid]
            for k, node in enumerate(path):
                expected = -1 if k == 0 else path[k - 1]
                if not 0 <= node < len(seq.parents) or seq.parents[node] != expected:
                    raise ValueError(f"request {rid}: {list(path)} is not a root-first path")
            if path:
                offsets = np.asarray(path, dtype=np.int64)
                moved = offsets != np.arange(len(path))
                if moved.any():
                    lo = seq.num_cached
                    all_slots = self.cache.slots(rid, lo, lo + len(seq.parents))
                    src.append(all_slots[offsets[moved]])
                    dst.append(all_slots[np.arange(len(path))[moved]])
            seq.tokens.extend(seq.tree_tokens[node] for node in path)
            if features is not None and rid in features and path:
                self._keep_features(seq, seq.num_cached, features[rid])
            seq.num_cached += len(path)
            seq.clear_tree()
            self.cache.shrink(rid, seq.num_cached)
            self._name_blocks(rid, seq)
        if src:
            self._commit_kv(
                self.cache.k,
                self.cache.v,
                torch.from_numpy(np.concatenate(src)).to(self.device),
                torch.from_numpy(np.concatenate(dst)).to(self.device),
            )

    def discard_tree(self, request_id: str) -> None:
        self.commit({request_id: []})

    def prefill(self, items: Mapping[str, Sequence[int]]) -> list[torch.Tensor]:
        """Forward prompt chunks (chains) and commit them; returns logits of each last token."""
        forward_items = [ForwardItem.chain(rid, toks) for rid, toks in items.items()]
        logits = self.forward(forward_items)
        self.commit({rid: range(len(toks)) for rid, toks in items.items()})
        return logits
