"""The cells benchmark's quick form (bench/bench_cells.py) with 1 and 2 cells: it runs end to
end over real processes and Redis, and its report has every field the results note reads
(no timing assertions: throughput on a shared CI machine means nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.bench_cells import CLUSTER_NODES, main


@pytest.mark.slow
def test_the_quick_cells_benchmark_reports_throughput_and_redis_ops_per_step(
    tmp_path: Path,
) -> None:
    out = tmp_path / "cells.json"
    result = main(["--quick", "--cells", "1", "2", "--workdir", str(tmp_path), "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["requests_per_cell"] == 4 and result["max_tokens"] == 8
    runs = result["runs"]
    assert [run["cells"] for run in runs] == [1, 2]
    for run in runs:
        n = run["cells"]
        assert run["requests"] == 4 * n
        assert run["completion_tokens"] == 4 * n * 8  # ignore_eos: every request runs out
        assert run["seconds"] > 0 and run["tokens_per_s"] > 0
        # at least one verification per generated token batch of each request
        assert run["steps"] >= 8
        assert sum(run["steps_by_cell"].values()) == run["steps"]
        assert len(run["steps_by_cell"]) == n and min(run["steps_by_cell"].values()) > 0
        assert run["redis_commands"] > run["steps"]  # a step is several Redis commands
        assert run["ops_per_step"] == pytest.approx(run["redis_commands"] / run["steps"])
        assert {"xadd", "xreadgroup", "xack"} <= set(run["top_commands"])
        assert run["outputs_equal_to_first"]  # greedy: the same text at every cell count
        capacity = run["capacity"]
        assert capacity["documented_node_ops_per_s"] == 80_000
        assert capacity["cells_one_node_documented_rate"] > 0
        assert capacity["cells_3_node_cluster_documented_rate"] == pytest.approx(
            CLUSTER_NODES * capacity["cells_one_node_documented_rate"]
        )
        assert capacity["cells_3_node_cluster_measured_cpu"] == pytest.approx(
            CLUSTER_NODES * capacity["cells_one_node_measured_cpu"]
        )
