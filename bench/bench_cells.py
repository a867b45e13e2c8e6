"""Aggregate throughput of one gateway over 1, 2 and 4 cells, and Redis operations per step.

For each cell count N: a fresh single Redis node, N cells (each `python -m services all
--no-gateway`: scheduler, verifier and a drafter in one process, `--threads` torch threads),
one gateway process routing over all of them (`AUGURY_GATEWAY__CELLS`), and a closed-loop HTTP
client keeping `--concurrency` requests per cell in flight (greedy, `ignore_eos`, token-id
prompts, the same prompts at every N). Measured over the timed window:

- aggregate completion tokens per second;
- Redis commands: `INFO commandstats` deltas (every command of every service, heartbeats and
  stats included, the benchmark's own INFO/XLEN left out), with the server's own CPU time per
  command (`usec`);
- engine steps: verifier answers (entries added to each cell's results stream; one per
  micro-batch verified), so ops/step = commands / steps.

The report also turns ops/step into a paper estimate of how many cells one Redis node and a
3-node Redis Cluster carry (`capacity`): at a documented single-node rate (`--redis-ops-per-s`,
default 80,000: Redis's own benchmark page, "about 110000 SETs per second, about 81000 GETs per
second" with 50 clients and no pipelining on a 2.5 GHz Xeon X3320, `doc/Benchmarks.html` of
antirez/redis 2.2; stream commands carry more than a GET, so the lower figure) and at the
server CPU time per step measured here. Outputs are checked equal across cell counts (greedy).

    python -m bench.bench_cells                       # SmolLM2 + draft-e, cells 1 2 4
    python -m bench.bench_cells --quick --cells 1 2   # tiny random model, seconds per N
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis

from shared.settings import GatewaySettings
from shared.wire.streams import results_stream
from tools.ports import free_port
from tools.redis_server import redis_node

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTED_REDIS_OPS_PER_S = 80_000
CLUSTER_NODES = 3
OWN_COMMANDS = ("info", "xlen", "ping", "config|resetstat", "config")
START_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Models:
    target: Path
    draft: Path
    draft_name: str
    threads: int
    kv_memory_bytes: int
    block_size: int
    profile_cache: Path | None  # a private profile cache (tiny models: measured at start)


@dataclass
class CellsRun:
    cells: int
    requests: int
    completion_tokens: int
    seconds: float
    steps: int
    steps_by_cell: dict[str, int]
    redis_commands: int
    redis_usec: float
    top_commands: dict[str, int] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0

    @property
    def ops_per_step(self) -> float:
        return self.redis_commands / self.steps if self.steps else 0.0

    @property
    def redis_usec_per_step(self) -> float:
        return self.redis_usec / self.steps if self.steps else 0.0

    @property
    def steps_per_s_per_cell(self) -> float:
        return self.steps / self.seconds / self.cells if self.seconds else 0.0


def command_stats(client: redis.Redis) -> dict[str, tuple[int, float]]:
    """Each command's (calls, usec) since the server started."""
    raw = client.info("commandstats")
    stats = {}
    for name, value in raw.items():
        command = name.removeprefix("cmdstat_")
        stats[command] = (int(value["calls"]), float(value["usec"]))
    return stats


def steps_so_far(client: redis.Redis, cells: Sequence[str]) -> dict[str, int]:
    """Verifier answers so far, by cell (one per micro-batch verified)."""
    return {cell: int(client.xlen(results_stream(cell))) for cell in cells}


# ---- services ------------------------------------------------------------------------------------
def service_env(models: Models, url: str, cell: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUGURY_")}
    env.update(
        PYTHONPATH=str(ROOT),
        AUGURY_REDIS__URL=url,
        AUGURY_REDIS__STREAM_MAXLEN=str(10_000_000),  # steps are counted by XLEN
        AUGURY_SERVICE__CELL=cell,
        AUGURY_MODELS__TARGET_DIR=str(models.target),
        AUGURY_MODELS__DRAFTS=json.dumps([{"name": models.draft_name, "dir": str(models.draft)}]),
        AUGURY_ENGINE__KV_MEMORY_BYTES=str(models.kv_memory_bytes),
        AUGURY_ENGINE__BLOCK_SIZE=str(models.block_size),
        **extra,
    )
    if models.profile_cache is not None:
        env["AUGURY_ENGINE__PROFILE_CACHE_DIR"] = str(models.profile_cache)
    return env


def launch(
    args: Sequence[str], env: dict[str, str], log: Path, threads: int
) -> subprocess.Popen[bytes]:
    with log.open("wb") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "services", *args, "--threads", str(threads)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=sink,
        )


def stop_all(processes: Sequence[subprocess.Popen[bytes]], timeout_s: float = 60.0) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ---- the client ----------------------------------------------------------------------------------
async def complete(
    http: aiohttp.ClientSession, base: str, prompt: list[int], max_tokens: int
) -> tuple[str, int]:
    body = {
        "model": GatewaySettings().model_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with http.post(f"{base}/v1/completions", json=body) as response:
        answer = await response.json()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {answer}")
    return answer["choices"][0]["text"], int(answer["usage"]["completion_tokens"])


async def closed_loop(
    base: str, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> list[tuple[str, int]]:
    results: list[tuple[str, int]] = [("", 0)] * len(prompts)
    todo = iter(range(len(prompts)))
    timeout = aiohttp.ClientTimeout(total=None)

    async def worker(http: aiohttp.ClientSession) -> None:
        for i in todo:
            results[i] = await complete(http, base, prompts[i], max_tokens)

    async with aiohttp.ClientSession(timeout=timeout) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return results


async def wait_ready(
    base: str, processes: Sequence[subprocess.Popen[bytes]], logs: list[Path]
) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    async with aiohttp.ClientSession() as http:
        while True:
            for process, log in zip(processes, logs, strict=True):
                if process.poll() is not None:
                    tail = log.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"a service exited ({process.returncode}):\n{tail}")
            try:
                async with http.get(f"{base}/health/ready") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the services did not come up")
            await asyncio.sleep(0.5)


def cell_names(n: int) -> list[str]:
    return [f"c{i}" for i in range(n)]


async def run_cells(
    n: int, models: Models, prompts: list[list[int]], args: argparse.Namespace, workdir: Path
) -> CellsRun:
    cells = cell_names(n)
    with redis_node(workdir) as url:
        client = redis.Redis.from_url(url)
        port = free_port()
        processes: list[subprocess.Popen[bytes]] = []
        logs: list[Path] = []
        try:
            for cell in cells:
                logs.append(workdir / f"cells{n}-{cell}.log")
                env = service_env(models, url, cell)
                processes.append(launch(["all", "--no-gateway"], env, logs[-1], models.threads))
            logs.append(workdir / f"cells{n}-gateway.log")
            gateway_env = service_env(
                models,
                url,
                cells[0],
                AUGURY_GATEWAY__PORT=str(port),
                AUGURY_GATEWAY__CELLS=json.dumps(cells),
                AUGURY_GATEWAY__AFFINITY_PREFIX_TOKENS="0",  # by load only
                AUGURY_GATEWAY__MAX_CONCURRENT_REQUESTS=str(4 * args.concurrency * n + 8),
            )
            processes.append(launch(["gateway"], gateway_env, logs[-1], 1))
            base = f"http://127.0.0.1:{port}"
            await wait_ready(base, processes, logs)
            # warm-up: every cell serves (load routing spreads a closed loop over them)
            await closed_loop(base, prompts[: 2 * n], 4, 2 * n)
            before_stats, before_steps = command_stats(client), steps_so_far(client, cells)
            started = time.perf_counter()
            results = await closed_loop(
                base, prompts[: args.requests * n], args.max_tokens, args.concurrency * n
            )
            seconds = time.perf_counter() - started
            after_stats, after_steps = command_stats(client), steps_so_far(client, cells)
        finally:
            stop_all(processes)
            client.close()
    calls = {
        name: after_stats[name][0] - before_stats.get(name, (0, 0.0))[0]
        for name in after_stats
        if name not in OWN_COMMANDS
    }
    usec = sum(
        after_stats[name][1] - before_stats.get(name, (0, 0.0))[1]
        for name in after_stats
        if name not in OWN_COMMANDS
    )
    top = dict(sorted(((k, v) for k, v in calls.items() if v), key=lambda kv: -kv[1])[:10])
    return CellsRun(
        cells=n,
        requests=len(results),
        completion_tokens=sum(tokens for _, tokens in results),
        seconds=seconds,
        steps=sum(after_steps.values()) - sum(before_steps.values()),
        steps_by_cell={cell: after_steps[cell] - before_steps[cell] for cell in cells},
        redis_commands=sum(calls.values()),
        redis_usec=usec,
        top_commands=top,
        outputs=[text for text, _ in results],
    )


# ---- models and prompts --------------------------------------------------------------------------
def tiny_models(workdir: Path, threads: int) -> Models:
    """A tiny random LLaMA with SmolLM2's vocabulary and tokenizer (the gateway needs one),
    drafting for itself; its quick profile is measured at start into a private cache."""
    from shared.model.smollm2 import ensure_smollm2
    from tests.conftest import make_tiny_checkpoint

    path = make_tiny_checkpoint(
        workdir / "tiny", seed=0, vocab_size=49152, hidden_size=64, num_layers=2,
        max_positions=2048, tie=True,
    )  # fmt: skip
    for source in ensure_smollm2().iterdir():
        if source.name.startswith("tokenizer") or source.suffix == ".jinja":
            shutil.copy(source, path / source.name)
    cache = workdir / "profiles"
    return Models(path, path, "self", threads, 4 << 20, 4, cache)


def smollm2_models(draft: str, threads: int) -> Models:
    from shared.model.model_set import all_draft_dirs, target_dir

    return Models(target_dir(), all_draft_dirs()[draft], draft, threads, 256 << 20, 16, None)


def make_prompts(count: int, seed: int = 39) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randrange(8, 48))] for _ in range(count)]


# ---- the report ----------------------------------------------------------------------------------
def capacity(
    ops_per_step: float, usec_per_step: float, steps_per_s_per_cell: float, rate: float
) -> dict[str, float]:
    """Cells one Redis node and a 3-node cluster carry at this many commands per step (cells
    spread over the cluster's masters by their hash tags; replicas add no write capacity)."""
    per_cell_ops = ops_per_step * steps_per_s_per_cell
    per_cell_usec = usec_per_step * steps_per_s_per_cell
    one_node = rate / per_cell_ops if per_cell_ops else float("inf")
    measured = 1e6 / per_cell_usec if per_cell_usec else float("inf")
    return {
        "redis_ops_per_s_per_cell": per_cell_ops,
        "documented_node_ops_per_s": rate,
        "cells_one_node_documented_rate": one_node,
        "cells_3_node_cluster_documented_rate": CLUSTER_NODES * one_node,
        "redis_cpu_usec_per_s_per_cell": per_cell_usec,
        "cells_one_node_measured_cpu": measured,
        "cells_3_node_cluster_measured_cpu": CLUSTER_NODES * measured,
    }


def report(runs: list[CellsRun], args: argparse.Namespace, models: Models) -> dict[str, Any]:
    reference = runs[0].outputs
    rows = []
    for run in runs:
        row = {k: v for k, v in asdict(run).items() if k != "outputs"}
        row.update(
            tokens_per_s=run.tokens_per_s,
            ops_per_step=run.ops_per_step,
            redis_usec_per_step=run.redis_usec_per_step,
            steps_per_s_per_cell=run.steps_per_s_per_cell,
            speedup_vs_first=run.tokens_per_s / runs[0].tokens_per_s if runs[0].seconds else 0.0,
            # the same prompts at every cell count: the ones both runs sent, equal (greedy)
            outputs_equal_to_first=run.outputs[: len(reference)] == reference[: len(run.outputs)],
            capacity=capacity(
                run.ops_per_step,
                run.redis_usec_per_step,
                run.steps_per_s_per_cell,
                args.redis_ops_per_s,
            ),
        )
        rows.append(row)
    return {
        "target": str(models.target),
        "draft": str(models.draft),
        "threads_per_cell": models.threads,
        "cpu_count": os.cpu_count(),
        "requests_per_cell": args.requests,
        "concurrency_per_cell": args.concurrency,
        "max_tokens": args.max_tokens,
        "runs": rows,
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        "| cells | requests | tok/s | x first | steps | steps/s/cell | Redis cmds | ops/step "
        "| Redis us/step | cells/node (documented rate) | cells/node (measured CPU) | same output |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in result["runs"]:
        cap = row["capacity"]
        print(
            f"| {row['cells']} | {row['requests']} | {row['tokens_per_s']:.1f} "
            f"| {row['speedup_vs_first']:.2f} | {row['steps']} | {row['steps_per_s_per_cell']:.1f} "
            f"| {row['redis_commands']} | {row['ops_per_step']:.1f} "
            f"| {row['redis_usec_per_step']:.0f} | {cap['cells_one_node_documented_rate']:.0f} "
            f"| {cap['cells_one_node_measured_cpu']:.0f} | {row['outputs_equal_to_first']} |"
        )


async def bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    threads = args.threads
    models = tiny_models(workdir, threads) if args.quick else smollm2_models(args.draft, threads)
    if args.profile_cache is not None:
        models = dataclasses.replace(models, profile_cache=args.profile_cache)
    prompts = make_prompts(args.requests * max(args.cells))
    runs = []
    for n in args.cells:
        run = await run_cells(n, models, prompts, args, workdir)
        print(
            f"{n} cell(s): {run.tokens_per_s:.1f} tok/s, {run.steps} steps, "
            f"{run.ops_per_step:.1f} Redis commands per step",
            flush=True,
        )
        runs.append(run)
    return report(runs, args, models)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--requests", type=int, default=32, help="requests per cell")
    parser.add_argument("--concurrency", type=int, default=8, help="in flight, per cell")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--draft", default="draft-e", help="SmolLM2 runs: the committed draft")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per cell")
    parser.add_argument("--redis-ops-per-s", type=float, default=DOCUMENTED_REDIS_OPS_PER_S)
    parser.add_argument("--quick", action="store_true", help="tiny random model, small sizes")
    parser.add_argument(
        "--profile-cache",
        type=Path,
        help="where the cells keep measured cost profiles (default: the user's cache; --quick: "
        "the work directory)",
    )
    parser.add_argument("--json", type=Path, help="write the report here too")
    parser.add_argument("--workdir", type=Path, help="logs and the tiny model (default: a temp)")
    args = parser.parse_args(argv)
    if args.quick:  # sizes a CI run affords, unless given
        given = set(argv if argv is not None else sys.argv[1:])
        if "--requests" not in given:
            args.requests = 4
        if "--concurrency" not in given:
            args.concurrency = 2
        if "--max-tokens" not in given:
            args.max_tokens = 8
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-cells-") as temp:
        workdir = args.workdir or Path(temp)
        workdir.mkdir(parents=True, exist_ok=True)
        result = asyncio.run(bench(args, workdir))
    print()
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
