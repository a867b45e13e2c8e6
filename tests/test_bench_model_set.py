"""`bench.bench_model_set --draft NAME=DIR`: a bad value is refused before any model loads."""

from __future__ import annotations

import pytest

from bench import bench_model_set


@pytest.mark.parametrize("value", ["new", "new=/nonexistent", "=/tmp"])
def test_a_bad_extra_draft_is_refused_before_anything_loads(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        bench_model_set.main(["--model-set", "smollm2", "--draft", value])
    assert "want NAME=DIR" in capsys.readouterr().err
