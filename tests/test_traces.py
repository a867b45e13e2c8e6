"""Load-test traces: the three readers, the JSONL writer, arrival processes, prompt building,
synthetic traces and the `tools.traces` command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tools.load.arrivals import arrival_times
from tools.load.prompts import PromptBuilder, synthesize
from tools.load.readers import read_trace, write_trace
from tools.load.trace import TraceError, TraceRequest
from tools.traces import main

# ---- our JSONL ---------------------------------------------------------------------------------


def _jsonl(path: Path, *lines: Any) -> Path:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    path.write_text(text, encoding="utf-8")
    return path


def test_jsonl_reads_mooncake_lines_and_our_fields(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "t.jsonl",
        {"timestamp": 1500, "input_length": 700, "output_length": 30, "hash_ids": [1, 2, 3]},
        "",
        {"timestamp": 250.5, "prompt": "Hi", "max_tokens": 8, "temperature": 0.7, "x": "?"},
        {
            "timestamp": 3000,
            "messages": [{"role": "user", "content": "Why?"}],
            "output_length": 12,
            "kind": "chat",
            "tpot_slo_ms": 60,
            "slo_class": "tight",
            "priority": -2,
        },
    )
    requests = read_trace(path)
    assert requests == [  # sorted by arrival: the file's timestamps go backwards once
        TraceRequest(arrival_s=0.2505, prompt="Hi", max_tokens=8, temperature=0.7),
        TraceRequest(arrival_s=1.5, input_length=700, output_length=30, hash_ids=(1, 2, 3)),
        TraceRequest(
            arrival_s=3.0,
            messages=(("user", "Why?"),),
            output_length=12,
            kind="chat",
            tpot_slo_ms=60.0,
            slo_class="tight",
            priority=-2,
        ),
    ]


def test_jsonl_limit_keeps_the_first_requests_of_the_file(tmp_path: Path) -> None:
    lines = [{"timestamp": t, "input_length": 5, "output_length": 5} for t in (30, 10, 20, 0)]
    requests = read_trace(_jsonl(tmp_path / "t.jsonl", *lines), limit=3)
    assert [r.arrival_s for r in requests] == [0.01, 0.02, 0.03]


GOOD = {"timestamp": 0, "input_length": 10, "output_length": 5}


@pytest.mark.parametrize(
    ("line", "complaint"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"input_length": 10, "output_length": 5}, "missing timestamp"),
        ({**GOOD, "timestamp": "12"}, "timestamp must be a number"),
        ({**GOOD, "timestamp": -1}, "timestamp must be >= 0"),
        ({**GOOD, "input_length": -3}, "input_length must be a positive integer"),
        ({**GOOD, "input_length": 2.5}, "input_length must be a positive integer"),
        ({**GOOD, "output_length": True}, "output_length must be a positive integer"),
        ({"timestamp": 0, "output_length": 5}, "needs input_length, prompt or messages"),
        ({"timestamp": 0, "input_length": 10}, "needs output_length or max_tokens"),
        ({**GOOD, "prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "not both"),
        ({**GOOD, "messages": [{"role": "user"}]}, "messages[0].content must be a string"),
        ({**GOOD, "messages": "hello"}, "messages must be a non-empty list"),
        ({**GOOD, "tpot_slo_ms": 0}, "tpot_slo_ms must be > 0"),
        ({**GOOD, "priority": "high"}, "priority must be an integer"),
        ({**GOOD, "kind": 3}, "kind must be a non-empty string"),
    ],
)
def test_jsonl_malformed_line_names_file_and_line(
    tmp_path: Path, line: Any, complaint: str
) -> None:
    path = _jsonl(tmp_path / "bad.jsonl", GOOD, "", GOOD, line, GOOD)
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    assert str(caught.value).startswith(f"{path}:4: ")
    assert complaint in str(caught.value)


def test_jsonl_undecodable_bytes_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b'\n{"timestamp": "\xff"}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl:2: "):
        read_trace(path)


def test_round_trip_gives_back_equal_requests(tmp_path: Path) -> None:
    arrivals = arrival_times(3.0, count=40, seed=5)  # arbitrary floats: exact ms needed
    variants = [
        {"input_length": 900, "output_length": 64},
        {"prompt": "Tell me a story.", "max_tokens": 20, "temperature": 0.8},
        {"messages": (("system", "Be brief."), ("user", "Hi ✓")), "output_length": 3},
        {"input_length": 33, "output_length": 1, "kind": "math", "priority": 1},
        {"input_length": 7, "max_tokens": 9, "tpot_slo_ms": 62.5, "slo_class": "tight"},
    ]
    requests = [
        TraceRequest(arrival_s=float(t), **variants[i % len(variants)])
        for i, t in enumerate(arrivals)
    ]
    path = tmp_path / "out" / "trace.jsonl"
    write_trace(path, requests)
    assert read_trace(path) == requests
    first = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
    assert first == {"timestamp": 0, "input_length": 900, "output_length": 64}


def test_write_refuses_a_request_it_could_not_read_back(tmp_path: Path) -> None:
    ok = TraceRequest(arrival_s=0.0, input_length=4, output_length=4)
    with pytest.raises(TraceError, match="request 1: needs output_length or max_tokens"):
        write_trace(tmp_path / "t.jsonl", [ok, TraceRequest(arrival_s=1.0, input_length=4)])


def test_format_is_chosen_by_suffix_and_rate_only_for_sharegpt(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="unknown trace format"):
        read_trace(tmp_path / "trace.txt")
    path = _jsonl(tmp_path / "t.jsonl", GOOD)
    with pytest.raises(TraceError, match="rate applies to ShareGPT"):
        read_trace(path, rate=2.0)


# ---- Azure CSV ---------------------------------------------------------------------------------


def _csv(path: Path, *rows: str) -> Path:
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(r + "\n" for r in rows))
    return path


def test_azure_csv_arrivals_from_the_first_row(tmp_path: Path) -> None:
    path = _csv(
        tmp_path / "azure.csv",
        "2023-11-16 18:15:46.6805900,374,44",
        "2023-11-16 18:15:50.9951690,396,109",
        "2023-11-16 18:16:01.0000001,879,19",
        "2023-11-17 00:00:00,100,1",
    )
    requests = read_trace(path)
    assert [(r.input_length, r.output_length) for r in requests] == [
        (374, 44),
        (396, 109),
        (879, 19),
        (100, 1),
    ]
    arrivals = [r.arrival_s for r in requests]
    expected = [0.0, 4.314579, 14.3194101, 20653.31941]
    assert arrivals == pytest.approx(expected, abs=1e-9)


def test_azure_csv_numeric_and_zoned_timestamps(tmp_path: Path) -> None:
    numeric = read_trace(_csv(tmp_path / "n.csv", "100.5,10,2", "101,20,3"))
    assert [r.arrival_s for r in numeric] == [0.0, 0.5]
    zoned = _csv(
        tmp_path / "z.csv",
        "2024-05-10 00:00:00.009930+00:00,10,2",
        "2024-05-10 02:00:01.009930+02:00,10,2",  # 00:00:01 UTC
    )
    assert [r.arrival_s for r in read_trace(zoned)] == pytest.approx([0.0, 1.0], abs=1e-9)


@pytest.mark.parametrize(
    ("row", "complaint"),
    [
        ("yesterday,10,2", "neither a date-time nor a number"),
        ("2023-11-16 25:00:00,10,2", "not a valid date-time"),
        ("2023-11-16 18:15:46,ten,2", "ContextTokens must be a positive integer"),
        ("2023-11-16 18:15:46,10,-2", "GeneratedTokens must be a positive integer"),
        ("2023-11-16 18:15:46,10", "expected 3 fields"),
        ("17.5,10,2", "mixes date-times and numbers"),
    ],
)
def test_azure_csv_bad_row_names_its_line(tmp_path: Path, row: str, complaint: str) -> None:
    path = _csv(tmp_path / "azure.csv", "2023-11-16 18:15:45.1234567,10,2", "", row)
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    assert str(caught.value).startswith(f"{path}:4: ")
    assert complaint in str(caught.value)


def test_azure_csv_bad_header(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text("time,prompt,answer\n1,2,3\n")
    with pytest.raises(TraceError, match=r"azure\.csv:1: expected the header"):
        read_trace(path)


# ---- ShareGPT JSON -----------------------------------------------------------------------------


def _conversation(*turns: tuple[str, str]) -> dict[str, Any]:
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}


SHAREGPT = [
    _conversation(("human", "What is a monad?"), ("gpt", "a" * 400)),
    _conversation(("gpt", "Hello!")),  # no human turn: skipped
    _conversation(("system", "Be nice."), ("human", "Hi there"), ("gpt", "Hello, friend")),
    _conversation(("human", "Unanswered question")),
    _conversation(("human", "One more"), ("gpt", "b" * 40)),
]


def test_sharegpt_first_human_turn_and_answer_length(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(SHAREGPT))
    requests = read_trace(path, rate=5.0, seed=1)
    assert [r.messages for r in requests] == [
        (("user", "What is a monad?"),),
        (("user", "Hi there"),),
        (("user", "Unanswered question"),),
        (("user", "One more"),),
    ]
    assert [r.output_length for r in requests] == [100, 3, 128, 10]  # characters / 4
    assert {r.kind for r in requests} == {"chat"}
    assert [r.arrival_s for r in requests] == list(arrival_times(5.0, count=4, seed=1))
    words = read_trace(path, rate=5.0, count_tokens=lambda text: len(text.split()))
    assert [r.output_length for r in words] == [1, 2, 128, 1]


def test_sharegpt_truncated_file_and_limit(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    text = json.dumps(SHAREGPT)
    path.write_text(text[: text.index("One more") + 3])  # cut inside the last conversation
    assert len(read_trace(path, rate=1.0)) == 3
    assert len(read_trace(path, rate=1.0, limit=2)) == 2


def test_sharegpt_needs_a_rate_and_an_array(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(SHAREGPT))
    with pytest.raises(TraceError, match="give a rate"):
        read_trace(path)
    path.write_text(json.dumps({"conversations": []}))
    with pytest.raises(TraceError, match="expected a JSON array"):
        read_trace(path, rate=1.0)


# ---- arrivals ----------------------------------------------------------------------------------


def _cv(times: np.ndarray) -> float:
    gaps = np.diff(times)
    return float(gaps.std() / gaps.mean())


def test_poisson_arrivals_have_the_rate_and_exponential_gaps() -> None:
    times = arrival_times(8.0, count=20_000, seed=3)
    assert len(times) == 20_000 and times[0] == 0.0 and np.all(np.diff(times) >= 0)
    assert np.diff(times).mean() == pytest.approx(1 / 8.0, rel=0.03)
    assert _cv(times) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("cv", [2.0, 0.5])
def test_gamma_arrivals_have_the_asked_burstiness(cv: float) -> None:
    times = arrival_times(5.0, count=200_000, process="gamma", cv=cv, seed=4)
    assert np.diff(times).mean() == pytest.approx(1 / 5.0, rel=0.03)
    assert _cv(times) == pytest.approx(cv, rel=0.05)


def test_arrivals_stop_before_the_duration() -> None:
    times = arrival_times(100.0, duration_s=200.0, seed=6)
    assert times.max() < 200.0 and times.max() > 199.0
    assert len(times) == pytest.approx(20_000, rel=0.03)


def test_arrivals_follow_the_seed() -> None:
    a, b = arrival_times(2.0, count=50, seed=1), arrival_times(2.0, count=50, seed=1)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, arrival_times(2.0, count=50, seed=2))


@pytest.mark.parametrize(
    ("kwargs", "complaint"),
    [
        ({"rate": 1.0}, "exactly one of duration_s and count"),
        ({"rate": 1.0, "count": 5, "duration_s": 5.0}, "exactly one of duration_s and count"),
        ({"rate": 0.0, "count": 5}, "rate must be > 0"),
        ({"rate": 1.0, "count": 5, "process": "gamma", "cv": 0.0}, "cv must be > 0"),
        ({"rate": 1.0, "count": 5, "cv": 2.0}, "needs process='gamma'"),
        ({"rate": 1.0, "count": 5, "process": "uniform"}, "process must be one of"),
        ({"rate": 1.0, "duration_s": -1.0}, "duration_s must be > 0"),
    ],
)
def test_arrivals_reject_bad_arguments(kwargs: dict[str, Any], complaint: str) -> None:
    rate = kwargs.pop("rate")
    with pytest.raises(ValueError, match=complaint):
        arrival_times(rate, **kwargs)


# ---- prompts -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from shared.model.smollm2 import ensure_smollm2

    return AutoTokenizer.from_pretrained(ensure_smollm2())


def _templated_length(tokenizer: Any, request: TraceRequest) -> int:
    assert request.messages is not None
    messages = [{"role": role, "content": text} for role, text in request.messages]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return len(ids)


@pytest.mark.smollm2
def test_prompt_builder_fills_to_the_input_length(tokenizer: Any) -> None:
    lengths = [48, 200, 513, 1500, 97, 333]
    kinds = [None, None, None, "math", "code", "chat"]
    requests = [
        TraceRequest(arrival_s=float(i), input_length=n, output_length=8, kind=k)
        for i, (n, k) in enumerate(zip(lengths, kinds, strict=True))
    ]
    filled = PromptBuilder(tokenizer, seed=7).fill(requests)
    assert [r.kind for r in filled] == ["chat", "code", "math", "math", "code", "chat"]
    for request, n in zip(filled, lengths, strict=True):
        assert abs(_templated_length(tokenizer, request) - n) <= 2
        assert request.input_length == n and request.output_length == 8
    texts = [r.messages[0][1] for r in filled if r.messages]
    assert filled[1].messages and "Complete the following Python function" in texts[1]
    assert len(set(texts)) == len(texts)
    again = PromptBuilder(tokenizer, seed=7).fill(requests)
    assert again == filled


@pytest.mark.smollm2
def test_prompt_builder_leaves_requests_with_text_alone(tokenizer: Any) -> None:
    requests = [
        TraceRequest(arrival_s=0.0, input_length=500, prompt="Short.", output_length=4),
        TraceRequest(arrival_s=1.0, messages=(("user", "Hi"),), output_length=4),
        TraceRequest(arrival_s=2.0, prompt="No length given.", output_length=4),
    ]
    assert PromptBuilder(tokenizer).fill(requests) == requests


# ---- synthetic traces --------------------------------------------------------------------------


def test_synthesize_gives_the_asked_kinds_lengths_and_classes() -> None:
    classes = [("tight", 60.0), ("loose", 200.0), ("batch", 1000.0)]
    requests = synthesize(
        4.0, count=12, kinds=["code", "math"], output_length=50, slo_classes=classes, seed=2
    )
    assert [r.kind for r in requests] == ["code", "math"] * 6
    assert [r.slo_class for r in requests] == ["tight", "loose", "batch"] * 4
    assert [r.tpot_slo_ms for r in requests] == [60.0, 200.0, 1000.0] * 4
    assert {r.output_length for r in requests} == {50}
    assert [r.arrival_s for r in requests] == list(arrival_times(4.0, count=12, seed=2))
    for request in requests:
        assert request.messages is not None and request.input_length is None
        text = request.messages[0][1]
        start = "Complete the following" if request.kind == "code" else "Solve this problem"
        assert text.startswith(start)
    assert len({r.messages for r in requests}) == 12  # no prompt repeats before all are used


def test_synthesize_random_classes_ranges_and_dataset_lengths() -> None:
    classes = [("tight", 60.0), ("loose", 200.0)]
    requests = synthesize(
        10.0,
        duration_s=20.0,
        kinds=["chat"],
        output_range=(10, 20),
        slo_classes=classes,
        slo_assignment="random",
        seed=3,
    )
    assert {r.kind for r in requests} == {"chat"}
    outputs = [r.output_length or 0 for r in requests]
    assert min(outputs) >= 10 and max(outputs) <= 20 and len(set(outputs)) > 5
    names = [r.slo_class for r in requests]
    assert {"tight", "loose"} == set(names)
    assert names != ["tight", "loose"] * (len(names) // 2)  # not round robin
    assert synthesize(10.0, duration_s=20.0, kinds=["chat"], seed=3) == synthesize(
        10.0, duration_s=20.0, kinds=["chat"], seed=3
    )
    natural = synthesize(1.0, count=30, kinds=["chat"], seed=3)
    assert len({r.output_length for r in natural}) > 10  # reference answer lengths


def test_synthesize_with_input_lengths_leaves_text_to_the_builder() -> None:
    requests = synthesize(1.0, count=6, input_range=(100, 300), output_length=5, seed=1)
    assert all(r.messages is None and 100 <= (r.input_length or 0) <= 300 for r in requests)


@pytest.mark.parametrize(
    ("kwargs", "complaint"),
    [
        ({"output_length": 5, "output_range": (1, 9)}, "not both"),
        ({"output_range": (9, 1)}, "1 <= low <= high"),
        ({"kinds": ["poetry"]}, "kinds must be"),
        ({"slo_classes": [("a", 60.0), ("a", 80.0)]}, "names must differ"),
        ({"slo_classes": [("a", 0.0)]}, "TPOT > 0"),
    ],
)
def test_synthesize_rejects_bad_options(kwargs: dict[str, Any], complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        synthesize(1.0, count=3, **kwargs)


# ---- command line ------------------------------------------------------------------------------


def test_cli_synth_then_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.jsonl"
    argv = ["synth", "--rate", "3", "--count", "9", "--slo", "tight=60", "loose=200"]
    assert main([*argv, "--arrivals", "gamma", "--cv", "2", "--out", str(out)]) == 0
    assert len(read_trace(out)) == 9
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "9 requests over" in shown
    assert "tight (TPOT 60 ms) 5, loose (TPOT 200 ms) 4" in shown
    assert "kinds: chat 3, code 3, math 3" in shown


def test_cli_convert_azure(tmp_path: Path) -> None:
    src = _csv(tmp_path / "azure.csv", "2023-11-16 18:15:46.6805900,374,44", "5,1,1")
    out = tmp_path / "azure.jsonl"
    assert main(["convert", str(src), "--out", str(out), "--limit", "1"]) == 0
    assert read_trace(out) == [TraceRequest(arrival_s=0.0, input_length=374, output_length=44)]


@pytest.mark.parametrize(
    "argv",
    [
        ["show", "missing.jsonl"],
        ["convert", "t.json", "--out", "t.jsonl"],  # ShareGPT without a rate
        ["synth", "--rate", "1", "--count", "3", "--cv", "2", "--out", "t.jsonl"],
        ["synth", "--rate", "1", "--count", "3", "--out", "t.csv"],
    ],
)
def test_cli_errors_are_one_line_and_exit_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.json").write_text(json.dumps(SHAREGPT))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
