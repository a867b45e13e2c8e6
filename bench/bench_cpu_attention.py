"""Target forwards and whole generations on a CPU: the reference tree attention vs the planned one.

    .venv/bin/python bench/bench_cpu_attention.py [--rounds 15] [--threads 2] [--engine 3]

Loads the target (SmolLM2-135M-Instruct, fp32) with its measured linear-kernel plan, then times
forwards with the PyTorch reference attention (`kernels.reference`) and with the planned CPU
attention (`kernels.cpu_tree_attention`), in turn, over the same cache and tokens:

- one request after a 256-token prefix, a chain of n new tokens (n = 1: plain decoding; n > 1:
  a verifier forward of a chain of n - 1 drafts). The request is alone in its runner, so its
  blocks are consecutive and the planned attention reads them as a view;
- a batch of b requests (256-token prefixes each), one decode token each, as the services run at
  concurrency b; they share a runner, whose allocator keeps each request's blocks in one run
  (the `views` column counts the requests read as views).

Prints medians of the forward latency with both, the ratio and the largest logit difference,
and the planned attention once more with every request gathered (`gathered`: what reading
consecutive blocks as views saves; the same for one request alone and for a batch).
`--engine P`: then P prompts each of chat, code and math through the in-process engine, plain
decoding and `draft-e` with the pruned dynamic tree, with either attention, prompt by prompt in
turn: tokens/s, the planned attention's speedup, and speculative over plain with each. With
`--concurrency C` the prompts go C at a time (a batch of C requests decoding together), and the
planned attention also runs with every request gathered.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])  # tools/profile.py would shadow profile

from kernels.cpu_tree_attention import CpuTreeAttention  # noqa: E402
from kernels.reference import tree_attention_reference  # noqa: E402
from shared.model import LlamaModel, load_model  # noqa: E402
from shared.model.model_set import target_dir  # noqa: E402
from shared.model.runner import ForwardItem, ModelRunner  # noqa: E402

PREFIX = 256
CHAINS = (1, 2, 3, 5, 9, 17)
BATCHES = (4, 8, 16)
Case = tuple[str, int]


def forwards(model: LlamaModel, rounds: int) -> None:
    rng = random.Random(0)
    alone = ModelRunner(model, kv_memory_bytes=64 << 20)
    shared = ModelRunner(model, kv_memory_bytes=512 << 20)
    rids = [f"r{i}" for i in range(max(BATCHES))]
    alone.add_request(rids[0])
    alone.prefill({rids[0]: [rng.randrange(1000, 20000) for _ in range(PREFIX)]})
    for rid in rids:
        shared.add_request(rid)
        shared.prefill({rid: [rng.randrange(1000, 20000) for _ in range(PREFIX)]})
    planned = CpuTreeAttention()
    modes = {
        "reference": tree_attention_reference,
        "gathered": CpuTreeAttention(reads_views=False),
        "planned": planned,
    }
    cases: list[Case] = [("chain", n) for n in CHAINS] + [("batch", b) for b in BATCHES]

    def new_items(case: Case) -> tuple[ModelRunner, list[ForwardItem]]:
        kind, n = case
        if kind == "chain":
            tokens = [rng.randrange(1000, 20000) for _ in range(n)]
            return alone, [ForwardItem.chain(rids[0], tokens, logits="all")]
        items = [ForwardItem.chain(r, [rng.randrange(1000, 20000)], logits="all") for r in rids[:n]]
        return shared, items

    times: dict[tuple[str, Case], list[float]] = {(m, c): [] for m in modes for c in cases}
    max_diff = dict.fromkeys(cases, 0.0)
    views = dict.fromkeys(cases, 0)
    for r in range(rounds + 1):  # round 0 warms up
        for case in cases:
            runner, items = new_items(case)
            out = {}
            for m in list(modes) if r % 2 else list(modes)[::-1]:  # drift hits all alike
                runner.attention = modes[m]
                t = time.perf_counter()
                logits = runner.forward(items)
                if r:
                    times[(m, case)].append(time.perf_counter() - t)
                if m == "planned":
                    views[case] = sum(p.blocks is None for p in planned._plans)
                for item in items:
                    runner.discard_tree(item.request_id)
                out[m] = torch.cat(logits)
            for m in ("planned", "gathered"):
                diff = (out["reference"] - out[m]).abs().max().item()
                max_diff[case] = max(max_diff[case], diff)
        print(f"round {r}/{rounds}", file=sys.stderr, end="\r")

    def med(m: str, case: Case) -> float:
        return statistics.median(times[(m, case)]) * 1e3

    print(f"median of {rounds} forwards (ms) after {PREFIX}-token prefixes")
    header = (
        f"{'forward':<22} {'reference':>10} {'planned':>8} {'speedup':>8} {'views':>6} "
        f"{'gathered':>9} {'views save':>10}"
    )
    print(f"{header} {'max|dlogit|':>12}")
    for case in cases:
        kind, n = case
        label = f"1 request, {n} tokens" if kind == "chain" else f"{n} requests x 1 token"
        ref, new, gathered = med("reference", case), med("planned", case), med("gathered", case)
        count = n if kind == "batch" else 1
        print(
            f"{label:<22} {ref:>10.1f} {new:>8.1f} {ref / new:>7.2f}x "
            f"{views[case]:>3}/{count:<2} {gathered:>9.1f} {gathered / new:>9.2f}x "
            f"{max_diff[case]:>12.2e}"
        )
    ref1, new1 = med("reference", ("chain", 1)), med("planned", ("chain", 1))
    print("cost(n) / cost(1), one request:")
    for n in CHAINS:
        case = ("chain", n)
        print(
            f"  n = {n:>2}: reference {med('reference', case) / ref1:.2f}, "
            f"planned {med('planned', case) / new1:.2f}"
        )


def generations(model: LlamaModel, per_kind: int, max_tokens: int, concurrency: int) -> None:
    from transformers import AutoTokenizer

    from bench.bench_engine import METHODS, chat_prompts
    from shared.engine.drafting import Drafter
    from shared.engine.spec_engine import SpecEngine
    from shared.engine.verifier import Verifier
    from shared.model.model_set import all_draft_dirs
    from shared.values.sampling import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(target_dir())
    eos = tokenizer.eos_token_id
    prompts = chat_prompts(tokenizer, per_kind)
    groups = [prompts[i : i + concurrency] for i in range(0, len(prompts), concurrency)]
    draft = load_model(all_draft_dirs()["draft-e"], target_path=target_dir())
    attentions = {
        "reference": lambda: tree_attention_reference,
        "gathered": lambda: CpuTreeAttention(reads_views=False),
        "planned": CpuTreeAttention,
    }
    if concurrency == 1:  # a request alone always holds consecutive blocks
        del attentions["gathered"]
    engines: dict[tuple[str, str], SpecEngine] = {}
    for name, make in attentions.items():

        def runner(m: LlamaModel, make=make) -> ModelRunner:
            return ModelRunner(m, kv_memory_bytes=64 * concurrency << 20, attention=make())

        engines[("plain", name)] = SpecEngine(Verifier(runner(model)), eos_token_ids=[eos])
        engines[("draft-e", name)] = SpecEngine(
            Verifier(runner(model)),
            Drafter(runner(draft)),
            METHODS["tree16-p0.2"],
            eos_token_ids=[eos],
        )
    params = SamplingParams(max_tokens=max_tokens)
    for engine in engines.values():  # warm-up
        engine.generate([prompts[0][:16]], params)
    tokens = dict.fromkeys(engines, 0)
    seconds = dict.fromkeys(engines, 0.0)
    outputs: dict[tuple[str, str], list[list[int]]] = {key: [] for key in engines}
    for i, group in enumerate(groups):
        order = list(engines) if i % 2 else list(engines)[::-1]
        for key in order:
            t = time.perf_counter()
            outs = [r.output for r in engines[key].generate(group, params)]
            seconds[key] += time.perf_counter() - t
            tokens[key] += sum(map(len, outs))
            outputs[key] += outs
        print(f"group {i + 1}/{len(groups)}", file=sys.stderr, end="\r")
    rate = {key: tokens[key] / seconds[key] for key in engines}
    print(
        f"\n{len(prompts)} prompts (chat, code, math), {concurrency} at a time, up to "
        f"{max_tokens} tokens, tokens/s"
    )
    names = list(attentions)
    print(
        f"{'decoding':<10} " + " ".join(f"{n:>10}" for n in names) + f" {'planned/ref':>12}", end=""
    )
    print(f" {'planned/gathered':>17}" if "gathered" in names else "")
    for how in ("plain", "draft-e"):
        line = f"{how:<10} " + " ".join(f"{rate[(how, n)]:>10.1f}" for n in names)
        line += f" {rate[(how, 'planned')] / rate[(how, 'reference')]:>11.2f}x"
        if "gathered" in names:
            line += f" {rate[(how, 'planned')] / rate[(how, 'gathered')]:>16.2f}x"
        print(line)
    for name in names:
        same = outputs[("draft-e", name)] == outputs[("plain", name)]
        ratio = rate[("draft-e", name)] / rate[("plain", name)]
        print(f"draft-e / plain with the {name} attention: {ratio:.2f}x, outputs equal: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", type=int, default=0, metavar="P", help="prompts per kind")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument(
        "--concurrency", type=int, default=1, help="--engine: requests generated at once"
    )
    ap.add_argument("--no-forwards", action="store_true", help="only --engine")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(target_dir())
    model.plan_kernels()
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    if not args.no_forwards:
        forwards(model, args.rounds)
    if args.engine:
        generations(model, args.engine, args.max_tokens, args.concurrency)


if __name__ == "__main__":
    main()
