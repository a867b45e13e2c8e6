"""The load-test report: metrics on hand-computed records, the files it writes, the comparison."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tools.load.compare import compare
from tools.load.plots import throughput_series
from tools.load.records import RequestRecord, itls_ms
from tools.load.report import load_records, stats, summarize, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def five_records() -> list[RequestRecord]:
    """Five requests whose numbers the tests below work out by hand.

    A misses its SLO, B meets it, C has one token (no TPOT), D fails after one token, E has no SLO.
    """
    a = RequestRecord(
        index=0, arrival_s=0.0, num_prompt_tokens=10, kind="chat", slo_class="tight",
        tpot_slo_ms=400.0, first_token_s=0.5, finish_s=2.5, num_output_tokens=5,
        finish_reason="length", chunks=[(0.5, 1), (1.0, 2), (2.5, 2)],
        drafts=2, draft_tokens=6, accepted_tokens=3, steps_by_draft={"d1": 2},
    )  # fmt: skip
    b = RequestRecord(
        index=1, arrival_s=1.0, num_prompt_tokens=20, kind="chat", slo_class="loose",
        tpot_slo_ms=200.0, first_token_s=1.2, finish_s=2.2, num_output_tokens=11,
        finish_reason="stop", chunks=[(1.2, 1), (2.2, 10)],
        drafts=3, draft_tokens=9, accepted_tokens=6, steps_by_draft={"d1": 1, "d2": 2},
    )  # fmt: skip
    c = RequestRecord(
        index=2, arrival_s=2.0, num_prompt_tokens=30, kind="math", slo_class="tight",
        tpot_slo_ms=400.0, first_token_s=2.1, finish_s=2.1, num_output_tokens=1,
        finish_reason="length", chunks=[(2.1, 1)],
    )  # fmt: skip
    d = RequestRecord(
        index=3, arrival_s=3.0, num_prompt_tokens=40, first_token_s=3.5, finish_s=4.0,
        num_output_tokens=1, error="connection reset", chunks=[(3.5, 1)],
    )  # fmt: skip
    e = RequestRecord(
        index=4, arrival_s=0.5, num_prompt_tokens=50, kind="code", first_token_s=1.0,
        finish_s=3.0, num_output_tokens=3, finish_reason="stop",
        chunks=[(1.0, 1), (2.0, 1), (3.0, 1)],
    )  # fmt: skip
    return [a, b, c, d, e]


# By hand: TTFT (completed A B C E) 0.5 0.2 0.1 0.5; TPOT A 2.0 s/4 = 500 ms (> 400: miss),
# B 1.0 s/10 = 100 ms (met), E 2.0 s/2 = 1000 ms (no SLO: met); E2E 2.5 1.2 0.1 2.5.
# Duration: first arrival 0.0 to last finish 4.0 (D's failure) = 4 s.


def test_counts_and_duration() -> None:
    s = summarize(five_records())
    assert (s["requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["duration_s"] == pytest.approx(4.0)
    assert s["total_output_tokens"] == 5 + 11 + 1 + 3  # D's token is not counted
    assert s["total_prompt_tokens"] == 10 + 20 + 30 + 50


def test_latencies_over_completed_requests() -> None:
    s = summarize(five_records())
    assert s["ttft_s"]["count"] == 4  # D streamed a token but failed: not measured
    assert s["ttft_s"]["mean"] == pytest.approx((0.5 + 0.2 + 0.1 + 0.5) / 4)
    assert s["ttft_s"]["p50"] == pytest.approx(0.35)
    assert s["tpot_ms"]["count"] == 3  # C has a single token: no TPOT
    assert s["tpot_ms"]["mean"] == pytest.approx((500 + 100 + 1000) / 3)
    assert s["tpot_ms"]["p50"] == pytest.approx(500.0)
    assert s["e2e_s"]["mean"] == pytest.approx((2.5 + 1.2 + 0.1 + 2.5) / 4)


def test_itl_counts_each_gap_once_per_token() -> None:
    s = summarize(five_records())
    # A: 0.5 s over 2 tokens, 1.5 s over 2; B: 1.0 s over 10; E: 1.0 s, 1.0 s
    expected = [250.0] * 2 + [750.0] * 2 + [100.0] * 10 + [1000.0] * 2
    assert s["itl_ms"]["count"] == len(expected)
    assert s["itl_ms"]["mean"] == pytest.approx(sum(expected) / len(expected))
    assert s["itl_ms"]["p50"] == pytest.approx(100.0)


def test_itl_skips_empty_chunks() -> None:
    r = RequestRecord(
        index=0, arrival_s=0.0, num_prompt_tokens=1, first_token_s=1.0, finish_s=3.0,
        num_output_tokens=3, chunks=[(1.0, 1), (1.5, 0), (2.0, 2), (3.0, 0)],
    )  # fmt: skip
    assert itls_ms(r) == pytest.approx([500.0, 500.0])


def test_slo_attainment_goodput_and_throughput() -> None:
    s = summarize(five_records())
    # met: B (100 <= 200), C (one token), E (no SLO); missed: A (500 > 400), D (failed)
    assert s["slo_met"] == 3
    assert s["slo_attainment"] == pytest.approx(3 / 5)
    assert s["goodput_tok_s"] == pytest.approx((11 + 1 + 3) / 4.0)
    assert s["throughput_tok_s"] == pytest.approx((5 + 11 + 1 + 3) / 4.0)
    assert s["request_throughput"] == pytest.approx(4 / 4.0)


def test_explicit_duration_sets_the_rates() -> None:
    s = summarize(five_records(), duration_s=8.0)
    assert s["duration_s"] == 8.0
    assert s["throughput_tok_s"] == pytest.approx(20 / 8.0)
    assert s["goodput_tok_s"] == pytest.approx(15 / 8.0)


def test_slo_edge_cases_one_by_one() -> None:
    a, b, c, d, e = five_records()
    assert summarize([d])["slo_attainment"] == 0.0  # failed: a miss
    assert summarize([e])["slo_attainment"] == 1.0  # no SLO: met when completed
    assert summarize([c])["slo_attainment"] == 1.0  # one token: no TPOT, met
    assert summarize([a])["slo_attainment"] == 0.0
    exact = RequestRecord(
        index=0, arrival_s=0.0, num_prompt_tokens=1, tpot_slo_ms=100.0, first_token_s=0.0,
        finish_s=0.2, num_output_tokens=3,
    )  # fmt: skip
    assert summarize([exact])["slo_attainment"] == 1.0  # TPOT exactly at the SLO meets it


def test_speculation_counters() -> None:
    s = summarize(five_records())
    assert s["mean_accepted_length"] == pytest.approx(1 + (3 + 6) / (2 + 3))
    assert s["acceptance_rate"] == pytest.approx((3 + 6) / (6 + 9))
    assert s["steps_by_draft"] == {"d1": 3, "d2": 2}
    no_spec = summarize(five_records()[2:])
    assert no_spec["mean_accepted_length"] is None
    assert no_spec["acceptance_rate"] is None


def test_per_class_and_per_kind() -> None:
    s = summarize(five_records())
    assert set(s["per_class"]) == {"tight", "loose", "none"}
    tight = s["per_class"]["tight"]  # A (miss) and C (met)
    assert (tight["requests"], tight["slo_met"]) == (2, 1)
    assert tight["slo_attainment"] == pytest.approx(0.5)
    assert tight["tpot_slos_ms"] == [400.0]
    assert tight["tpot_ms"]["mean"] == pytest.approx(500.0)
    assert tight["goodput_tok_s"] == pytest.approx(1 / 4.0)
    assert s["per_class"]["loose"]["slo_attainment"] == 1.0
    none = s["per_class"]["none"]  # D (failed) and E (no SLO)
    assert (none["requests"], none["failed"], none["slo_attainment"]) == (2, 1, 0.5)
    assert set(s["per_kind"]) == {"chat", "math", "code", "none"}
    chat = s["per_kind"]["chat"]  # A and B
    assert chat["tpot_ms"]["mean"] == pytest.approx(300.0)
    assert chat["e2e_s"]["mean"] == pytest.approx((2.5 + 1.2) / 2)
    assert chat["slo_attainment"] == pytest.approx(0.5)


def test_percentiles_on_a_known_list() -> None:
    st = stats([float(v) for v in range(10, 0, -1)])  # 1..10, unsorted
    assert st == {
        "count": 10,
        "mean": pytest.approx(5.5),
        "p50": pytest.approx(5.5),
        "p90": pytest.approx(9.1),
        "p99": pytest.approx(9.91),
    }


def test_empty_input_gives_nones() -> None:
    s = summarize([])
    assert (s["requests"], s["completed"], s["failed"]) == (0, 0, 0)
    for key in ("duration_s", "slo_attainment", "goodput_tok_s", "throughput_tok_s"):
        assert s[key] is None, key
    assert s["mean_accepted_length"] is None
    for key in ("ttft_s", "tpot_ms", "itl_ms", "e2e_s"):
        assert s[key] == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    assert s["per_class"] == {} and s["per_kind"] == {}


def test_only_failures_have_no_latencies_but_a_duration() -> None:
    d = five_records()[3]
    s = summarize([d])
    assert s["duration_s"] == pytest.approx(1.0)
    assert s["ttft_s"]["mean"] is None
    assert s["throughput_tok_s"] == 0.0 and s["goodput_tok_s"] == 0.0


def test_throughput_series_bins_the_chunks() -> None:
    edges, through, good = throughput_series(five_records(), bin_s=1.0)
    assert list(edges) == pytest.approx([0.0, 1.0, 2.0, 3.0, 4.0])
    assert list(through) == pytest.approx([1.0, 4.0, 14.0, 1.0])  # D's token is left out
    assert list(good) == pytest.approx([0.0, 2.0, 12.0, 1.0])  # A's tokens are left out
    assert [len(x) for x in throughput_series([])] == [0, 0, 0]


def _strict_json(path: Path) -> dict[str, Any]:
    def no_nan(token: str) -> None:
        raise AssertionError(f"{path} holds {token}")

    return json.loads(path.read_text(), parse_constant=no_nan)


REPORT_KEYS = {
    "requests", "completed", "failed", "duration_s", "total_prompt_tokens",
    "total_output_tokens", "request_throughput", "tpot_slos_ms", "slo_met", "slo_attainment",
    "goodput_tok_s", "throughput_tok_s", "ttft_s", "tpot_ms", "itl_ms", "e2e_s", "drafts",
    "draft_tokens", "accepted_tokens", "mean_accepted_length", "acceptance_rate",
    "steps_by_draft", "per_class", "per_kind", "meta", "failures_by_reason",
}  # fmt: skip


def test_write_report_writes_every_file(tmp_path: Path) -> None:
    meta = {"command": "augury load replay", "trace": "t.jsonl", "label": "run-a"}
    summary = write_report(tmp_path / "run", five_records(), meta=meta)
    run = tmp_path / "run"
    report = _strict_json(run / "report.json")
    assert set(report) == REPORT_KEYS
    assert report["meta"] == meta
    assert {k: v for k, v in report.items() if k != "meta"} == summary
    for name in ("latency_cdfs.png", "tpot_slo.png", "throughput.png"):
        assert (run / name).read_bytes().startswith(PNG_MAGIC), name
    md = (run / "report.md").read_text()
    assert "# Load test: run-a" in md
    assert "| SLO attainment | 60.0% |" in md
    assert "| goodput (tok/s) | 3.8 |" in md
    assert "| TPOT (ms) | 3 | 533.33 | 500.00 |" in md
    assert "| tight |" in md and "| loose |" in md
    assert "![latency_cdfs.png](latency_cdfs.png)" in md


def test_write_report_on_nothing(tmp_path: Path) -> None:
    write_report(tmp_path, [])
    report = _strict_json(tmp_path / "report.json")
    assert report["slo_attainment"] is None and report["meta"] == {}
    for name in ("latency_cdfs.png", "tpot_slo.png", "throughput.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC), name
    assert load_records(tmp_path) == []


def test_write_report_replaces_non_finite_meta(tmp_path: Path) -> None:
    write_report(tmp_path, five_records(), meta={"rate": float("inf")}, plots=False)
    assert _strict_json(tmp_path / "report.json")["meta"] == {"rate": None}
    assert not (tmp_path / "throughput.png").exists()


def test_load_records_round_trips(tmp_path: Path) -> None:
    records = five_records()
    write_report(tmp_path, records, plots=False)
    loaded = load_records(tmp_path)
    assert loaded == records
    assert summarize(loaded) == summarize(records)


def _run(tmp_path: Path, name: str, records: list[RequestRecord], label: str | None) -> Path:
    meta = {"label": label} if label else {}
    write_report(tmp_path / name, records, meta=meta, plots=False)
    return tmp_path / name


def test_compare_side_by_side(tmp_path: Path) -> None:
    first = _run(tmp_path, "baseline", five_records(), None)
    second = _run(tmp_path, "dir-b", five_records()[1:2], "only-b")
    text = compare([first, second], out=tmp_path / "cmp")
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()}
    assert rows["metric"] == "| metric | baseline | only-b |"
    assert rows["requests"] == "| requests | 5 | 1 |"
    assert rows["failed"] == "| failed | 1 | 0 |"
    assert rows["mean TTFT (ms)"] == "| mean TTFT (ms) | 325.00 | 200.00 |"
    assert rows["mean TPOT (ms)"] == "| mean TPOT (ms) | 533.33 | 100.00 |"
    assert rows["SLO attainment"] == "| SLO attainment | 60.0% | 100.0% |"
    # B alone: 11 tokens from its arrival (1.0) to its finish (2.2)
    assert rows["goodput (tok/s)"] == f"| goodput (tok/s) | 3.8 | {11 / 1.2:.1f} |"
    assert rows["mean accepted length"] == "| mean accepted length | 2.800 | 3.000 |"
    assert (tmp_path / "cmp" / "compare.md").read_text().endswith(text)
    assert (tmp_path / "cmp" / "compare.png").read_bytes().startswith(PNG_MAGIC)


def test_compare_without_records_still_plots(tmp_path: Path) -> None:
    run = _run(tmp_path, "a", five_records(), None)
    (run / "records.jsonl").unlink()
    empty = _run(tmp_path, "b", [], None)
    compare([run, empty], out=tmp_path / "cmp")
    assert (tmp_path / "cmp" / "compare.png").read_bytes().startswith(PNG_MAGIC)


def test_compare_names_a_directory_without_report(tmp_path: Path) -> None:
    good = _run(tmp_path, "good", five_records(), None)
    missing = tmp_path / "not-a-run"
    missing.mkdir()
    with pytest.raises(ValueError, match="not-a-run"):
        compare([good, missing])
    (missing / "report.json").write_text("{truncated")
    with pytest.raises(ValueError, match="not-a-run"):
        compare([good, missing])


def test_failures_are_counted_by_reason() -> None:
    records = five_records()
    long = "HTTP 503: " + "overloaded " * 40
    for index, error in ((5, "HTTP 400: unknown SLO class 'x'"), (6, long), (7, long)):
        records.append(RequestRecord(index=index, arrival_s=1.0, num_prompt_tokens=1, error=error))
    reasons = summarize(records)["failures_by_reason"]
    assert list(reasons.values()) == [2, 1, 1]  # the most frequent first
    [cut, *_] = reasons
    assert cut.startswith("HTTP 503: overloaded") and cut.endswith("...") and len(cut) == 200
    assert set(list(reasons)[1:]) == {"HTTP 400: unknown SLO class 'x'", "connection reset"}
    assert summarize(five_records()[:3])["failures_by_reason"] == {}


def test_throughput_plot_marks_every_arrival() -> None:
    import matplotlib.pyplot as plt

    from tools.load.plots import mark_arrivals

    fig, ax = plt.subplots()
    mark_arrivals(ax, five_records())
    ticks = {
        label: sorted(float(seg[0][0]) for seg in coll.get_segments())
        for coll in ax.collections
        if (label := coll.get_label())
    }
    plt.close(fig)
    assert ticks == {"arrival": [0.0, 0.5, 1.0, 2.0], "arrival (failed)": [3.0]}
