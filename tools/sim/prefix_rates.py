"""Hit rates of a Mooncake-style trace: its own count from `hash_ids` against the simulator's.

python -m tools.sim.prefix_rates conversation_trace.jsonl --limit 300
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from shared.scheduling.config import SchedulerConfig
from shared.scheduling.cost_model import CostModel, CostProfile
from tools.load.readers import read_trace
from tools.sim.acceptance import AcceptanceModel
from tools.sim.prefix import trace_hit_rate
from tools.sim.simulator import SimConfig, SimRequest, Simulator

PROFILES = Path(__file__).resolve().parents[2] / "profiles"
DEFAULT_PROFILE = "SmolLM2-135M-Instruct-cpu-intel-r-xeon-r-processor-float32-t2.json"
DEFAULT_ACCEPTANCE = "acceptance-SmolLM2-135M-Instruct.json.gz"


def main(argv: Sequence[str] | None = None) -> int:
    """Hit rates of a Mooncake trace: its own count and the simulator's (count-only)."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.sim.prefix_rates", description=main.__doc__
    )
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
        scheduler=SchedulerConfig(max_running_requests=args.max_running),
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
