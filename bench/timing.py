"""One timing helper the micro-benchmarks share."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(
    fn: Callable[[], object], repeats: int, sync: Callable[[], None] | None = None
) -> float:
    """Median wall time of `repeats` calls of `fn`, in ms; `sync` (e.g. `torch.cuda.synchronize`)
    runs before the clock starts and before it stops, so queued device work is counted."""
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
