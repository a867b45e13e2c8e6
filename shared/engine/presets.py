"""The default speculative configuration of the CLI and the benchmarks, in one place.

The drafting method is the upper bound of what a request may draft; with the goodput planner
(the default) the scheduler core decides every step how much of it pays on this machine, down to
plain decoding.
"""

from __future__ import annotations

from shared.engine.methods import DraftMethod

DEFAULT_DRAFT = "draft-s"
DEFAULT_METHOD = DraftMethod(
    "dynamic", budget=16, max_size=16, max_depth=6, max_width=4, min_path_prob=0.2
)
