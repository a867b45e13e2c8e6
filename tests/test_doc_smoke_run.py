"""What a smoke run of the documented commands adds around them (tools/doc_fixtures.py,
tools/doc_servers.py, tools/doc_smoke.py): the format fixtures read as the real traces do,
placeholders and implied sizes, export lines scoped to their block, and the order in which
background servers start and stop (with `sleep` as the server: no model loads here)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import redis

from tools.doc_commands import as_run, documented_commands, exported, smoke_form
from tools.doc_fixtures import NOTE_NAME, ROWS, write_fixtures
from tools.doc_servers import Servers
from tools.doc_smoke import fill_placeholders, needs_server, server_probe, starts_a_stack
from tools.load.readers import read_trace
from tools.redis_server import redis_node


def test_fixtures_read_as_the_traces_they_stand_for(tmp_path: Path) -> None:
    assert sorted(write_fixtures(tmp_path)) == [
        "AzureLLMInferenceTrace_conv.csv",
        "conversation_trace.jsonl",
    ]
    assert "Synthetic" in (tmp_path / NOTE_NAME).read_text()
    azure = read_trace(tmp_path / "AzureLLMInferenceTrace_conv.csv")
    assert len(azure) == ROWS and azure[0].arrival_s == 0.0
    assert [r.arrival_s for r in azure] == sorted(r.arrival_s for r in azure)
    mooncake = read_trace(tmp_path / "conversation_trace.jsonl")
    assert len(mooncake) == ROWS and all(r.hash_ids for r in mooncake)
    assert all(r.input_length > 512 * (len(r.hash_ids or ()) - 1) for r in mooncake)


def test_fixtures_never_replace_a_real_file(tmp_path: Path) -> None:
    (tmp_path / "conversation_trace.jsonl").write_text("real\n")
    assert write_fixtures(tmp_path) == ["AzureLLMInferenceTrace_conv.csv"]
    assert (tmp_path / "conversation_trace.jsonl").read_text() == "real\n"


def test_placeholders_are_filled_or_left_out() -> None:
    assert fill_placeholders("python -m t run --out a [--x X] [--label NAME]") == (
        "python -m t run --out a"
    )
    assert fill_placeholders("python -m tools.traces synth --rate R --duration 300") == (
        "python -m tools.traces synth --rate 1 --duration 300"
    )


def test_a_command_at_large_defaults_gets_small_sizes_added() -> None:
    assert smoke_form("python -m bench.bench_services --concurrency 1 8 32") == (
        "python -m bench.bench_services --concurrency 1 --requests 4 --max-tokens 8 --rounds 1"
    )
    assert smoke_form("python -m bench.drafters mixed --copies 4 [--profile PATH]") == (
        "python -m bench.drafters mixed --copies 1 --per-kind 1"
    )
    # a background server keeps its `&`, a curl pipeline stays as written
    assert smoke_form("python -m services all --threads 2 &") == (
        "python -m services all --threads 2 &"
    )
    curl = "curl -s 127.0.0.1:8000/metrics | grep prefix_cache"
    assert smoke_form(curl) == as_run(curl) == curl


def test_servers_and_what_needs_them() -> None:
    assert server_probe("python -m services all --threads 2 &") == "gateway"
    assert server_probe("python -m services all --no-gateway &") == "scheduler"
    assert server_probe("python -m services drafter --name draft-s") == "drafter"
    assert server_probe("python -m services health verifier") is None
    assert starts_a_stack("bash scripts/serve.sh")
    assert not starts_a_stack("python -m services verifier")
    assert needs_server("python -m services health --live verifier")
    assert needs_server("python -m tools.replay run --trace t.jsonl --base-url http://h:8000")
    assert not needs_server("python -m services all")


def test_exports_reach_the_later_commands_of_their_block_only() -> None:
    assert exported("export A=1 B='x y'") == {"A": "1", "B": "x y"}
    assert exported("python -m services all") == {}
    found = documented_commands()
    deployment = [c for c in found if c.doc == "docs/deployment.md"]
    served = [c for c in deployment if "-m services all --no-gateway" in c.line]
    assert served and all(dict(c.env).get("AUGURY_REDIS__CLUSTER") == "true" for c in served)
    later = [c for c in deployment if "bench.bench_cells" in c.line]
    assert later and all(c.env == () for c in later)  # a later block: not exported there


def test_an_env_assignment_in_front_stays_and_python_is_replaced() -> None:
    words = as_run("A=false python -m services all --threads 2 &").split()
    assert words[0] == "A=false" and words[1].endswith("python") and words[-1] == "&"


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    def flag_written(probe: str, cwd: Path, env: Mapping[str, str]) -> bool:
        return (cwd / "ready").exists()

    with redis_node(tmp_path) as url:
        running = Servers(tmp_path, url, 8000, tmp_path, ready=flag_written)
        yield running
        running.stop()


def started(servers: Servers, line: str) -> str:
    """Start `line` as a `sleep` that says it is ready at once: its status."""
    return servers.start(line, "touch ready; sleep 60", {}, timeout_s=30)[0]


def alive(servers: Servers) -> list[str]:
    return [s.line for s in servers.running if s.process.poll() is None]


def test_a_stack_replaces_what_runs_and_a_split_stacks_parts_run_side_by_side(
    servers: Servers,
) -> None:
    assert started(servers, "python -m services all --drafts draft-e") == "pass"
    first = servers.running[0].process
    started(servers, "python -m services verifier")
    started(servers, "python -m services gateway")
    assert first.poll() is not None  # the whole stack stopped for the split one
    assert alive(servers) == ["python -m services verifier", "python -m services gateway"]
    parts = [s.process for s in servers.running]
    started(servers, "python -m services all --threads 2 &")
    assert all(p.poll() is not None for p in parts)
    assert alive(servers) == ["python -m services all --threads 2 &"]


def test_stopping_every_server_empties_the_shared_redis(servers: Servers) -> None:
    started(servers, "python -m services all")
    client = redis.Redis.from_url(servers.redis_url)
    client.set("left-over", "1")
    servers.stop()
    assert servers.running == [] and client.get("left-over") is None
    client.close()


def test_a_server_that_exits_before_it_is_ready_fails_and_is_not_kept(servers: Servers) -> None:
    status, _, tail = servers.start("python -m services all", "echo no model; exit 1", {}, 30)
    assert (status, tail.strip(), servers.running) == ("fail", "no model", [])


def test_the_docs_port_and_redis_host_become_this_runs(servers: Servers) -> None:
    servers.port = 8123
    line = servers.as_here(
        "python -m tools.replay run --trace 'redis://host:6379/0?stream=s' "
        "--base-url http://127.0.0.1:8000 --out runs/a"
    )
    assert "127.0.0.1:8123" in line and f"{servers.redis_url}?stream=s" in line
    assert servers.env()["AUGURY_GATEWAY__PORT"] == "8123"


def test_cells_stacks_run_side_by_side(servers: Servers) -> None:
    started(servers, "AUGURY_SERVICE__CELL=a python -m services all --no-gateway &")
    started(servers, "AUGURY_SERVICE__CELL=b python -m services all --no-gateway &")
    started(servers, """AUGURY_GATEWAY__CELLS='["a","b"]' python -m services gateway""")
    assert [(s.cell, s.probe) for s in servers.running] == [
        ("a", "scheduler"),
        ("b", "scheduler"),
        ("0", "gateway"),
    ]
    assert len(alive(servers)) == 3
    started(servers, "AUGURY_SERVICE__CELL=a python -m services all --no-gateway &")
    assert [s.cell for s in servers.running] == ["b", "0", "a"]


def test_a_doc_that_asks_for_a_cluster_gets_one_started_once(servers: Servers) -> None:
    starts: list[str] = []

    def start_cluster() -> str:
        starts.append("cluster")
        return "redis://127.0.0.1:7001/0"

    servers.start_cluster = start_cluster
    cluster = {"AUGURY_REDIS__CLUSTER": "true"}
    assert servers.env()["AUGURY_REDIS__URL"] == servers.redis_url and starts == []
    assert servers.env(cluster)["AUGURY_REDIS__URL"] == "redis://127.0.0.1:7001/0"
    assert servers.env(cluster)["AUGURY_REDIS__URL"] == "redis://127.0.0.1:7001/0"
    assert starts == ["cluster"]


def test_an_assignment_keeps_its_name_outside_the_quotes() -> None:
    line = """AUGURY_GATEWAY__CELLS='["a","b"]' python -m services gateway"""
    assert smoke_form(line) == line
    assert as_run(line).startswith("""AUGURY_GATEWAY__CELLS='["a","b"]' /""")
