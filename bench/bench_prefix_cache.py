"""The second turn of a conversation with a long history, with prefix caching on and off.

A conversation's second turn resends the first turn's prompt and answer. With prefix caching the
target and the draft find that history's full KV blocks cached and compute only the rest; without,
they compute all of it again. For each setting the in-process engine runs turn 1 (the history),
then turn 2 (history, answer, a follow-up question), and reports per turn the time to the first
token and the prompt tokens each model forwarded before it (the second number does not depend on
the machine's load).

    python -m bench.bench_prefix_cache --history 2000              # SmolLM2 and draft-e
    python -m bench.bench_prefix_cache --history 64 --max-tokens 4 --draft none   # a quick check
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import AutoTokenizer

from shared.datasets import eval_prompts
from shared.engine.drafting import Drafter
from shared.engine.presets import DEFAULT_METHOD
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.model_set import all_draft_dirs, target_dir
from shared.model.runner import ModelRunner
from shared.values.sampling import SamplingParams

KV_BYTES = 512 << 20
FOLLOW_UP = "Thanks. Now summarize all of that in two sentences."


@dataclass(frozen=True)
class Turn:
    caching: bool
    turn: int
    prompt_tokens: int
    cached_tokens: int  # prompt tokens the target found cached
    ttft_ms: float
    target_tokens_forwarded: int  # before the first token: the prompt tokens computed
    draft_tokens_forwarded: int  # the draft's, over the whole turn


def history_ids(tokenizer, num_tokens: int) -> list[int]:
    """A chat of about `num_tokens` tokens: evaluation questions as user turns, chat template
    applied, cut to the last `num_tokens`."""
    questions = eval_prompts("everyday", 20)
    text = " ".join(questions * (1 + num_tokens // 200))
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return list(ids)[-num_tokens:]


def run_turn(
    engine: SpecEngine, prompt: list[int], params: SamplingParams, caching: bool, turn: int
) -> tuple[Turn, list[int]]:
    target = engine.verifier.runner
    draft = engine.drafter.runner if engine.drafter is not None else None
    target_before = target.num_tokens_forwarded
    draft_before = draft.num_tokens_forwarded if draft is not None else 0
    started = time.perf_counter()
    rid = engine.add_request(prompt, params)
    ttft_ms = None
    forwarded = 0
    while engine.requests[rid].finish_reason is None:
        outputs = engine.step()
        if ttft_ms is None and any(o.request_id == rid and o.new_tokens for o in outputs):
            ttft_ms = 1000 * (time.perf_counter() - started)
            forwarded = target.num_tokens_forwarded - target_before
    request = engine.requests.pop(rid)
    draft_forwarded = draft.num_tokens_forwarded - draft_before if draft is not None else 0
    result = Turn(
        caching,
        turn,
        len(prompt),
        request.num_cached_prompt_tokens,
        ttft_ms or 0.0,
        forwarded,
        draft_forwarded,
    )
    return result, request.output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history", type=int, default=2000, help="tokens of the first turn")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens of each answer")
    parser.add_argument("--draft", default="draft-e", help="a draft checkpoint name, or none")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()

    target_path = target_dir()
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    target = load_model(target_path)
    draft_model = None
    if args.draft != "none":
        drafts = all_draft_dirs()
        if args.draft not in drafts:
            raise SystemExit(f"no draft {args.draft!r}; have {sorted(drafts)} (or --draft none)")
        draft_model = load_model(drafts[args.draft], target_path=target_path)
    first = history_ids(tokenizer, args.history)
    follow_up = tokenizer.encode(FOLLOW_UP, add_special_tokens=False)
    params = SamplingParams(max_tokens=args.max_tokens)
    rows: list[Turn] = []
    for caching in (False, True):
        drafter = None
        if draft_model is not None:
            runner = ModelRunner(draft_model, kv_memory_bytes=KV_BYTES, prefix_caching=caching)
            drafter = Drafter(runner, name=args.draft)
        verifier = Verifier(ModelRunner(target, kv_memory_bytes=KV_BYTES, prefix_caching=caching))
        method = DEFAULT_METHOD if drafter is not None else None
        engine = SpecEngine(verifier, drafter, method, eos_token_ids=target.cfg.eos_token_ids)
        row, answer = run_turn(engine, first, params, caching, 1)
        rows.append(row)
        row, _ = run_turn(engine, first + answer + follow_up, params, caching, 2)
        rows.append(row)
    print(
        f"{'caching':>8} {'turn':>4} {'prompt':>6} {'cached':>6} {'TTFT ms':>9} "
        f"{'target fwd':>10} {'draft fwd':>9}"
    )
    for r in rows:
        print(
            f"{'on' if r.caching else 'off':>8} {r.turn:>4} {r.prompt_tokens:>6} "
            f"{r.cached_tokens:>6} {r.ttft_ms:>9.0f} {r.target_tokens_forwarded:>10} "
            f"{r.draft_tokens_forwarded:>9}"
        )
    on = {r.turn: r for r in rows if r.caching}
    print(f"second turn's TTFT with caching: {on[2].ttft_ms / on[1].ttft_ms:.1%} of the first's")
    if args.out is not None:
        args.out.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")


if __name__ == "__main__":
    main()
