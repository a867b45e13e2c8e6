"""The processor-cost benchmark's bounded form: both versions agree and a table comes out."""

from __future__ import annotations

import pytest

from bench import bench_processor_cost


def test_the_dense_and_the_seen_column_penalties_agree_and_are_tabled(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench_processor_cost.main(["--vocab", "500", "--rows", "1", "6", "--repeats", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line for line in lines[2:] if line.startswith("| 500 |")]
    assert len(rows) == len(bench_processor_cost.VARIANTS) * 2
