"""The target's features of one request, kept for its feature-level draft.

A feature-level draft (EAGLE-style) reads, beside each committed token, the target's feature (its
last layer's output after the final norm) at the position before it. Only the target computes
them, in the verify step that commits a position, so the core keeps what the verifier returned
and hands each draft job the rows it needs. It keeps every position of a live request (about
1.2 KB per token for a 576-wide target, fp16): a drafter that restarted, or a request that
switches to a feature-level draft, gets its features from here. A request whose KV is recomputed
(preemption, a scheduler taking over) gets them again from the recomputation, which overwrites
what it covers.
"""

from __future__ import annotations

import numpy as np


class FeatureLog:
    """Feature rows for positions [start, end) of one request, fp16 [end - start, width]."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.start = 0
        self._chunks: list[np.ndarray] = []
        self._num_rows = 0

    @property
    def end(self) -> int:
        return self.start + self._num_rows

    def put(self, position: int, rows: np.ndarray) -> None:
        """Record rows for positions position, position + 1, ...; they replace what they overlap,
        and whatever lies after them (a recomputation starts over from its first position). A
        gap before them starts the log over at `position`."""
        if rows.ndim != 2 or rows.shape[1] != self.width:
            raise ValueError(f"feature rows must be [n, {self.width}], got {list(rows.shape)}")
        if len(rows) == 0:
            return
        if not self.start <= position <= self.end:
            self._chunks, self.start, self._num_rows = [], position, 0
        if position < self.end:
            kept = self.take(self.start, position) if position > self.start else None
            self._chunks = [] if kept is None else [kept]
            self._num_rows = position - self.start
        self._chunks.append(rows)
        self._num_rows += len(rows)

    def covers(self, lo: int, hi: int) -> bool:
        return self.start <= lo <= hi <= self.end

    def take(self, lo: int, hi: int) -> np.ndarray:
        """Rows for positions [lo, hi) (they must be covered)."""
        if not self.covers(lo, hi):
            raise KeyError(
                f"features for [{lo}, {hi}) not held (holding [{self.start}, {self.end}))"
            )
        if lo == hi:
            return np.zeros((0, self.width), dtype=np.float16)
        if len(self._chunks) > 1:
            self._chunks = [np.concatenate(self._chunks)]
        return self._chunks[0][lo - self.start : hi - self.start]
