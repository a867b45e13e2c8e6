"""The scheduler's picture of a verifier's prefix cache: block names only, no KV.

A verifier names a full block of committed tokens by a hash chained over the blocks before it
(`shared/model/prefix_cache.py`); the names depend on token ids alone, so the scheduler can
compute them too. `PrefixIndex` holds the names of the blocks the scheduler saw the verifier
commit (least recently used first out, at most `max_blocks`) and those a prompt chunk in flight
is computing (pending). It is an estimate: the verifier evicts on its own, so a predicted hit may
be gone, and the verifier's answers (`cached_tokens`) correct it (`forget`). Charging too little
is harmless: the verifier computes whatever it does not find.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from shared.values.blocks import BlockHash, block_hashes

DEFAULT_MAX_BLOCKS = 1 << 16
MEMO_SIZE = 1024  # sequences whose names are kept


class PrefixIndex:
    def __init__(
        self, block_size: int, *, max_blocks: int = DEFAULT_MAX_BLOCKS, salt: bytes = b""
    ) -> None:
        if block_size < 1 or max_blocks < 1:
            raise ValueError("block_size and max_blocks must be positive")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.salt = salt
        self._cached: OrderedDict[BlockHash, None] = OrderedDict()
        self._pending: dict[BlockHash, int] = {}  # name -> the micro-batch computing it
        self._names: dict[int, tuple[Sequence[int], list[BlockHash]]] = {}

    def __len__(self) -> int:
        return len(self._cached)

    def names(self, tokens: Sequence[int], num_blocks: int) -> list[BlockHash]:
        """The names of the first `num_blocks` full blocks of `tokens`, memoised per sequence
        object (a prompt is looked up on each of its chunks; sequences are not mutated)."""
        memo = self._names.get(id(tokens))
        if memo is None or memo[0] is not tokens:
            if len(self._names) >= MEMO_SIZE:
                self._names.clear()
            memo = (tokens, [])
            self._names[id(tokens)] = memo
        names = memo[1]
        if len(names) < num_blocks:
            parent = names[-1] if names else None
            end = num_blocks * self.block_size
            names += block_hashes(
                tokens[:end], self.block_size, salt=self.salt, first=len(names), parent=parent
            )
        return names[:num_blocks]

    def cached_tokens(self, tokens: Sequence[int], start: int, end: int) -> int:
        """Tokens from `start` that a verifier holding `tokens[:start]` would find cached, as
        the verifier looks up a chunk `tokens[start:end]`: only from a block boundary, whole
        blocks, never the chunk's last token."""
        if start % self.block_size or end <= start:
            return 0
        names = self.names(tokens, (end - 1) // self.block_size)
        hit = 0
        for name in names[start // self.block_size :]:
            if name not in self._cached:
                break
            self._cached.move_to_end(name)
            hit += self.block_size
        return hit

    def pending_at(self, tokens: Sequence[int], position: int) -> bool:
        """Whether the full block starting at `position` is being computed by a chunk in
        flight (its owner's result will make it cached)."""
        if position % self.block_size or position + self.block_size > len(tokens):
            return False
        block = position // self.block_size
        return self.names(tokens, block + 1)[block] in self._pending

    def mark_pending(self, batch_id: int, tokens: Sequence[int], start: int, end: int) -> None:
        """The full blocks of `tokens[start:end]` (from a block boundary on) that micro-batch
        `batch_id` computes."""
        first = -(-start // self.block_size)
        names = self.names(tokens, end // self.block_size)
        for name in names[first:]:
            if name not in self._cached:
                self._pending.setdefault(name, batch_id)

    def clear_pending(self, batch_id: int) -> None:
        for name in [n for n, b in self._pending.items() if b == batch_id]:
            del self._pending[name]

    def insert(self, tokens: Sequence[int], end: int) -> None:
        """The verifier committed `tokens[:end]`: their full blocks are cached."""
        for name in self.names(tokens, end // self.block_size):
            self._cached[name] = None
            self._cached.move_to_end(name)
        while len(self._cached) > self.max_blocks:
            self._cached.popitem(last=False)

    def forget(self, tokens: Sequence[int], start: int, end: int) -> None:
        """The verifier did not find the blocks of `tokens[start:end]`: evicted there."""
        first = start // self.block_size
        for name in self.names(tokens, end // self.block_size)[first:]:
            self._cached.pop(name, None)
