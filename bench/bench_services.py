"""Tokens/s of the whole service stack against the in-process engine, same prompts, same models.

Both run greedy speculative decoding with the same target, draft (with the same weights: int8
on an x86 CPU, as the services load drafts by default) and method, every step drafting the
method's whole tree (planner `fixed` in both, so both do the same work), closed loop: at
concurrency c, c requests are in flight and a new one starts whenever one finishes. The services
run verifier, drafter and scheduler in this process (each model on its own thread), with every
message through Redis (embedded unless --redis-url). Reported per concurrency: tokens/s of
each, their ratio, the scheduler's iterations and the per-iteration cost outside the models
(Redis hops, msgpack, scheduling: iteration wall time minus the drafter's and the verifier's
own measured time). Outputs are checked equal between the two.

    python -m bench.bench_services --concurrency 1 8 32 --requests 32 --max-tokens 64
    python -m bench.bench_services --draft draft-e --method dynamic --concurrency 1 8
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from services.run import Stack, start_stack
from services.runtime import ModelPaths, run_async
from shared.bus import redis_url
from shared.engine.drafting import Drafter
from shared.engine.presets import DEFAULT_METHOD
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.cost_profiles import load_or_measure
from shared.model.model_set import all_draft_dirs, target_dir
from shared.model.quantized import uses_int8
from shared.model.runner import ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.settings import AugurySettings, RedisSettings
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from tests.test_services_support import Client
from tools.prompts import chat_ids

KV_BYTES = 256 << 20


@dataclass
class Run:
    tokens: int
    seconds: float
    outputs: dict[int, list[int]]
    iterations: int = 0
    hop_ms: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def load_prompts(n: int) -> list[list[int]]:
    """n chat-templated prompts, chat, code and math in turn (shared.datasets' evaluation set)."""
    from transformers import AutoTokenizer

    from shared.datasets import KINDS, eval_prompts

    tokenizer = AutoTokenizer.from_pretrained(target_dir())
    texts = {kind: eval_prompts(kind, -(-n // len(KINDS))) for kind in KINDS}
    prompts = []
    for i in range(n):
        text = texts[KINDS[i % len(KINDS)]][i // len(KINDS)]
        prompts.append(chat_ids(tokenizer, text, keep=384))
    return prompts


def engine_method(method: str, k: int) -> DraftMethod | None:
    if method == "none":
        return None
    if method == "chain":
        return DraftMethod("chain", k=k)
    return DEFAULT_METHOD  # the services' default speculation is this preset


class EngineRunner:
    """The in-process engine with the same models, driven closed-loop like the services."""

    def __init__(
        self, target: Path, draft: Path | None, method: DraftMethod | None, *, int8: bool
    ) -> None:
        runner = ModelRunner(load_model(target), kv_memory_bytes=KV_BYTES)
        drafter = None
        if draft:
            model = load_model(draft, target_path=target, int8=int8)
            drafter = Drafter(ModelRunner(model, kv_memory_bytes=KV_BYTES), name="draft")
        # the profiles the services' model services load (their kernel plans applied), and the
        # cost model their scheduler builds from them
        drafts = {drafter.name: drafter.runner} if drafter else {}
        cost = load_or_measure(runner, drafts, target_name=target.name)
        self.engine = SpecEngine(
            Verifier(runner),
            drafter,
            method,
            SchedulerConfig(planner="fixed"),
            eos_token_ids=runner.cfg.eos_token_ids,
            cost=cost,
        )
        self._ids = itertools.count()

    def run(self, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> Run:
        engine = self.engine
        todo = deque(enumerate(prompts))
        ids: dict[str, int] = {}
        outputs: dict[int, list[int]] = {}
        started = time.perf_counter()
        while todo or engine.has_unfinished():
            while todo and len(ids) < concurrency:
                i, prompt = todo.popleft()
                ids[engine.add_request(prompt, params, request_id=f"e{next(self._ids)}")] = i
            engine.step()
            for rid in [r for r in ids if engine.requests[r].finish_reason is not None]:
                outputs[ids.pop(rid)] = engine.requests.pop(rid).output
        seconds = time.perf_counter() - started
        return Run(sum(len(o) for o in outputs.values()), seconds, outputs)


class ServicesRunner:
    """A client of the stack, closed loop: `concurrency` requests in flight at any time."""

    def __init__(self, stack: Stack, client: Client) -> None:
        self.stack = stack
        self.client = client
        self._ids = itertools.count()

    async def run(
        self, prompts: list[list[int]], params: SamplingParams, concurrency: int, **extra: object
    ) -> Run:
        """`extra`: Submit fields for every request (e.g. speculate=False)."""
        client = self.client
        scheduler = self.stack.scheduler
        assert scheduler is not None
        stats = scheduler.stats
        before = (stats.iterations, stats.wall_ms - stats.draft_ms - stats.verify_ms)
        todo = deque(enumerate(prompts))
        active: dict[str, int] = {}
        outputs: dict[int, list[int]] = {}
        started = time.perf_counter()
        while todo or active:
            while todo and len(active) < concurrency:
                i, prompt = todo.popleft()
                rid = f"s{next(self._ids)}"
                await client.submit(rid, prompt, params, **extra)
                active[rid] = i
            await client.poll(block_ms=20)
            for rid in [r for r in active if client.outcomes[r].done]:
                outcome = client.outcomes.pop(rid)
                assert outcome.error is None, outcome.error
                outputs[active.pop(rid)] = outcome.tokens
        seconds = time.perf_counter() - started
        iterations = stats.iterations - before[0]
        outside = stats.wall_ms - stats.draft_ms - stats.verify_ms - before[1]
        return Run(
            sum(len(o) for o in outputs.values()),
            seconds,
            outputs,
            iterations=iterations,
            hop_ms=outside / max(iterations, 1),
        )


@dataclass
class Row:
    concurrency: int
    engine: list[Run]
    services: list[Run]

    @staticmethod
    def _median(values: list[float]) -> float:
        return statistics.median(values)

    @property
    def engine_tps(self) -> float:
        return self._median([r.tokens_per_s for r in self.engine])

    @property
    def services_tps(self) -> float:
        return self._median([r.tokens_per_s for r in self.services])

    @property
    def ratio(self) -> float:
        """Median of the per-round ratios (rounds alternate, so shared-CPU noise cancels)."""
        pairs = zip(self.services, self.engine, strict=True)
        return self._median([s.tokens_per_s / e.tokens_per_s for s, e in pairs])

    @property
    def hop_ms(self) -> float:
        return self._median([r.hop_ms for r in self.services])

    @property
    def iterations(self) -> int:
        return self.services[-1].iterations

    def identical(self) -> tuple[int, int]:
        e, s = self.engine[-1].outputs, self.services[-1].outputs
        return sum(e[i] == s[i] for i in e), len(e)


async def bench(args: argparse.Namespace, url: str) -> list[Row]:
    target = target_dir()
    draft: Path | None = None
    if args.draft != "none" and args.method != "none":
        try:
            named = args.draft.startswith("draft-")
            draft = all_draft_dirs()[args.draft] if named else Path(args.draft)
        except KeyError:
            print(f"({args.draft} is not built yet: plain decoding, no draft)")
    method_name = args.method if draft else "none"
    spec: dict[str, object] = {"method": method_name, "chain_length": args.k, "planner": "fixed"}
    settings = AugurySettings(
        redis=RedisSettings(url=url),
        engine={"kv_memory_bytes": KV_BYTES},
        scheduler={"micro_batches": args.micro_batches, "speculation": spec},
        service={"cell": "bench", "replica": "bench"},
    )
    prompts = load_prompts(args.requests)
    params = SamplingParams(max_tokens=args.max_tokens)
    int8 = uses_int8(settings.engine.draft_weights, settings.engine.device)
    engine = EngineRunner(target, draft, engine_method(method_name, args.k), int8=int8)
    models = ModelPaths(target, {"draft": draft} if draft else {})
    stack = await start_stack(settings, url, models, gateway=False)
    client = Client(url, settings, "bench-client")
    services = ServicesRunner(stack, client)
    print(
        f"target {target.name}, draft {draft}{' (int8)' if draft and int8 else ''}, "
        f"method {method_name}, "
        f"{torch.get_num_threads()} torch threads, M={args.micro_batches}, "
        f"{args.requests} requests x {args.max_tokens} tokens, {args.rounds} rounds",
        flush=True,
    )
    rows = []
    try:
        await services.run(prompts[:2], SamplingParams(max_tokens=4), 2)  # warm up
        await asyncio.to_thread(engine.run, prompts[:2], SamplingParams(max_tokens=4), 2)
        for c in args.concurrency:
            row = Row(c, [], [])
            for _ in range(args.rounds):
                row.engine.append(await asyncio.to_thread(engine.run, prompts, params, c))
                row.services.append(await services.run(prompts, params, c))
            same, total = row.identical()
            print(
                f"c={c:>3}  engine {row.engine_tps:7.1f} tok/s  services {row.services_tps:7.1f}"
                f" tok/s  ratio {row.ratio:.2f}  hops {row.hop_ms:.2f} ms/iteration"
                f"  identical {same}/{total}",
                flush=True,
            )
            rows.append(row)
    finally:
        await client.close()
        await stack.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=32, help="requests per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating engine/services rounds")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--draft", default="draft-s", help="draft name, a directory, or none")
    parser.add_argument("--method", choices=["chain", "dynamic", "none"], default="chain")
    parser.add_argument("--k", type=int, default=4, help="chain length")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--redis-url", default=None, help="default: an embedded redis-server")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with redis_url(RedisSettings(url=args.redis_url)) as url:
        rows = run_async(bench(args, url))
    print()
    print(
        "| concurrency | engine tok/s | services tok/s | services / engine (median of rounds) "
        "| scheduler iterations | outside the models, ms per iteration | identical outputs |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        same, total = row.identical()
        print(
            f"| {row.concurrency} | {row.engine_tps:.1f} | {row.services_tps:.1f} | "
            f"{row.ratio:.2f} | {row.iterations} | {row.hop_ms:.2f} | {same}/{total} |"
        )


if __name__ == "__main__":
    main()
