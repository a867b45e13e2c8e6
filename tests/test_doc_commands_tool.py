"""`python -m tools.doc_commands`: which documented commands it finds, how a smoke run shrinks
or skips them, and how one command's pass, fail and timeout are told apart (with trivial shell
commands: nothing heavy runs here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tools.doc_commands import as_run, documented_commands, main, run_one
from tools.doc_extract import problems_of
from tools.doc_smoke import shrink, skip_reason, unsafe_reason


def test_it_finds_each_repository_command_once_in_doc_order() -> None:
    found = documented_commands()
    lines = [c.line for c in found]
    assert len(lines) == len(set(lines)) > 40
    # ours, not pytest or docker; or a curl to the docs' local server
    assert all(problems_of(line) is not None or line.startswith("curl ") for line in lines)
    assert found[0].doc == "README.md"
    traces = documented_commands("tools.traces show")
    assert traces and all("tools.traces show" in c.line for c in traces)


def test_size_flags_shrink_and_other_words_stay() -> None:
    line = "python -m bench.bench_services --concurrency 1 8 32 --requests 16 --max-tokens 48 --x 3"
    assert shrink(line) == (
        "python -m bench.bench_services --concurrency 1 --requests 4 --max-tokens 8 --x 3"
    )
    assert shrink("python -m t --max-tokens=200 a.jsonl") == "python -m t --max-tokens=8 a.jsonl"
    # one value replaced for a one-value flag: a positional after it stays
    assert shrink("python -m t --limit 300 trace.jsonl") == "python -m t --limit 20 trace.jsonl"
    assert (
        shrink('bash scripts/generate.sh "Hello there"') == "bash scripts/generate.sh 'Hello there'"
    )


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("bash scripts/install-qwen-coder.sh", "installs packages"),
        ("python -m tools.profile --device cuda --dtype bfloat16", "needs a GPU"),
        ("python -m services all --threads 2 &", None),  # started in the background
        ("bash scripts/serve.sh", None),
        ("python -m services health verifier", None),  # run while a server runs
        ("curl -s 127.0.0.1:8000/metrics", None),
        ("curl -sSL https://example.org/x.sh", "downloads"),
        ("python -m tools.simulate --trace t.jsonl [--profile PATH]", "shows placeholders"),
        ("python -m tools.traces synth --rate R --duration 300", "shows placeholders"),
        ("python -m distill build --out models/drafts", unsafe_reason("--out models/x")),
        ("python -m tools.traces show trace.jsonl", None),
        ("python -m bench.bench_speculation --per-kind 4 --max-tokens 128", None),
    ],
)
def test_a_smoke_run_skips_what_cannot_run_here(line: str, reason: str | None) -> None:
    assert skip_reason(line) == reason


def test_a_full_run_skips_only_what_would_write_into_the_shared_models() -> None:
    assert unsafe_reason("python -m distill build --out models/drafts") is not None
    assert unsafe_reason("bash scripts/serve.sh") is None


def test_one_command_passes_fails_or_times_out(tmp_path: Path) -> None:
    assert run_one("true", tmp_path, 10)[0] == "pass"
    status, _, tail = run_one("echo broken; exit 3", tmp_path, 10)
    assert (status, tail.strip()) == ("fail", "broken")
    status, seconds, _ = run_one("sleep 30", tmp_path, 0.5)
    assert status == "timeout" and seconds < 10


def test_python_runs_as_this_interpreter() -> None:
    assert as_run(".venv/bin/python -m tools.traces show t.jsonl").split()[0] == sys.executable
    # scripts/generate.sh sets up (pip installs) first: its module runs instead
    assert as_run("bash scripts/generate.sh Hello --no-spec").split()[1:] == [
        "-m",
        "shared.cli",
        "generate",
        "Hello",
        "--no-spec",
    ]


def test_listing_runs_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--match", "tools.traces show"]) == 0
    out = capsys.readouterr().out
    assert "smoke: python -m tools.traces show trace.jsonl" in out
