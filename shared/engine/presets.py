"""The default speculative configuration of the CLI and the benchmarks, in one place.

The drafting method is the upper bound of what a request may draft; with the goodput planner
(the default) the scheduler core decides every step how much of it pays on this machine, down to
plain decoding.
"""

from __future__ import annotations

from shared.values.methods import DraftMethod

# The first of the independent drafts (services, simulator recordings, the SLO and scheduling
# benchmarks).
DEFAULT_DRAFT = "draft-s"
# `augury generate` and `bench.bench_speculation`: the feature-level draft, which reads the
# target's features and pays the most of the four on the CPUs measured (docs/benchmarks.md).
DEFAULT_GENERATE_DRAFT = "draft-e"
# A node the draft gives under 5% (path probability) is not drafted. 0.2 until 2026-11-27: at
# 0.05 the qwen2.5-coder 0.5B's trees gave 2.58x instead of 2.30x on code-edit and 1.57x
# instead of 1.45x on everyday; none at all drafted too much (docs/results/benchmarks/
# 2026-11-27-min-path-prob.md).
DEFAULT_METHOD = DraftMethod(
    "dynamic", budget=16, max_size=16, max_depth=6, max_width=4, min_path_prob=0.05
)
