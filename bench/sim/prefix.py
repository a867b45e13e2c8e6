"""Prefix caching in the simulator: prompts from Mooncake-style `hash_ids`, and the trace's own
hit rate.

A Mooncake trace names each 512-token block of a prompt by an id; equal ids mean equal blocks
after an equal prefix (the ids are remapped prefix hashes). The simulator turns each id into 512
pseudo-random token ids drawn from the id (the same id, the same tokens), so the verifier's
chained block names (`shared/model/prefix_cache.py`, 16 tokens a block) find exactly the
sharing the trace describes, at the verifier's own granularity.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake traces
FIRST_TOKEN = 4  # below: the simulator's placeholder tokens
PROFILES = Path(__file__).resolve().parents[2] / "profiles"
DEFAULT_PROFILE = "SmolLM2-135M-Instruct-cpu-intel-r-xeon-r-processor-float32-t2.json"
DEFAULT_ACCEPTANCE = "acceptance-SmolLM2-135M-Instruct.json.gz"


@lru_cache(maxsize=1 << 16)
def _block_tokens(hash_id: int, vocab_size: int, block: int) -> tuple[int, ...]:
    rng = np.random.default_rng(hash_id)
    return tuple(rng.integers(FIRST_TOKEN, vocab_size, block).tolist())


def hashed_prompt(
    hash_ids: Sequence[int], length: int, vocab_size: int, block: int = MOONCAKE_BLOCK
) -> tuple[int, ...]:
    """`length` prompt tokens whose `block`-token blocks are drawn from `hash_ids` (the last
    block partial); ValueError when the ids cannot cover the length."""
    if len(hash_ids) * block < length or (length and len(hash_ids) > -(-length // block)):
        raise ValueError(
            f"{len(hash_ids)} hash_ids of {block} tokens do not make a prompt of {length} tokens"
        )
    tokens: list[int] = []
    for hash_id in hash_ids:
        tokens += _block_tokens(hash_id, vocab_size, block)
    return tuple(tokens[:length])


def trace_hit_rate(
    requests: Iterable[tuple[int, Sequence[int]]], block: int = MOONCAKE_BLOCK
) -> tuple[int, int]:
    """The trace's own count, in arrival order with a cache that forgets nothing: (prompt
    tokens, of them in the longest prefix of blocks some earlier request had), for
    `(input_length, hash_ids)` pairs. The prompt's last token is never counted (it is always
    computed: its logits give the first output token)."""
    seen: set[int] = set()
    total = hits = 0
    for length, ids in requests:
        hit = 0
        for hash_id in ids:
            if hash_id not in seen:
                break
            hit += 1
        total += length
        hits += min(hit * block, length - 1)
        seen.update(ids)
    return total, hits


def main(argv: Sequence[str] | None = None) -> int:
    """Hit rates of a Mooncake trace: its own count and the simulator's (count-only)."""
    import argparse

    from bench.load.readers import read_trace
    from bench.sim.acceptance import AcceptanceModel
    from bench.sim.simulator import SimConfig, SimRequest, Simulator
    from shared.scheduling.cost_model import CostModel, CostProfile

    parser = argparse.ArgumentParser(prog="python -m bench.sim.prefix", description=main.__doc__)
    parser.add_argument("trace", type=Path, help="a Mooncake-style .jsonl with hash_ids")
    parser.add_argument("--limit", type=int, help="only the first N requests")
    parser.add_argument("--profile", type=Path, default=PROFILES / DEFAULT_PROFILE)
    parser.add_argument("--acceptance", type=Path, default=PROFILES / DEFAULT_ACCEPTANCE)
    parser.add_argument("--draft", default="draft-m")
    parser.add_argument("--cache-blocks", type=int, default=1 << 20, help="verifier's blocks")
    parser.add_argument("--max-running", type=int, default=64)
    args = parser.parse_args(argv)
    trace = [r for r in read_trace(args.trace, limit=args.limit) if r.hash_ids is not None]
    requests = [
        SimRequest(
            r.arrival_s,
            r.input_length or 0,
            max(1, r.output_length or 1),
            kind="chat",
            hash_ids=r.hash_ids,
        )
        for r in trace
    ]
    config = SimConfig(
        max_context=1 << 18,
        max_running=args.max_running,
        drafts=(args.draft,),
        prefix_caching=True,
        prefix_cache_blocks=args.cache_blocks,
    )
    cost = CostModel(CostProfile.load(args.profile))
    sim = Simulator(config, cost, AcceptanceModel.load(args.acceptance))
    sim.run(requests)
    total, hits = trace_hit_rate((r.num_prompt_tokens, r.hash_ids or ()) for r in requests)
    own = 100 * hits / total
    simulated = 100 * sim.cached_prompt_tokens / sim.prompt_tokens
    print(f"{len(requests)} requests, {total} prompt tokens")
    print(f"trace's own hit rate: {own:.2f}% ({hits} tokens)")
    print(
        f"simulated hit rate:   {simulated:.2f}% ({sim.cached_prompt_tokens} of "
        f"{sim.prompt_tokens} prompt tokens prefilled)"
    )
    print(f"difference: {simulated - own:+.2f} points")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
