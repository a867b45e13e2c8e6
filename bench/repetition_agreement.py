"""Why a repetition penalty costs speculation: how well a draft predicts the target, with and
without the penalty, and with the draft's logits moved to the target's level first.

    python -m bench.repetition_agreement --draft draft-m --per-kind 2 --tokens 48
    python -m bench.repetition_agreement --model-set qwen2.5-coder --per-kind 2 --tokens 48

vLLM's repetition penalty divides a seen token's positive logit by the penalty and multiplies a
negative one, so unlike the other processors it depends on the logits' level, not only on their
differences: SmolLM2's largest logit is about 27, a distilled draft's about 6. The same penalty
then moves the two models' distributions by different amounts. Teacher-forced over the target's
greedy continuation of each prompt, every position is scored under four treatments: no penalty;
the penalty on both (what the engine does); the penalty on the draft after shifting its logits
so that its row maximum equals the target's (an oracle: it reads the target's row); and after
shifting by the mean of that difference over all positions (a constant one could calibrate).
Per treatment: the distributions' overlap at the temperature (sum of min(p, q): the acceptance
of one drafted token under speculative sampling) and the agreement of the two argmaxes under
shared Gumbel noise (the acceptance of seeded, coupled sampling), estimated from `--samples`
draws. Nothing is timed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch

from bench.bench_speculation import KINDS, KV_BYTES, prompts_by_kind
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.llama import LlamaModel
from shared.model.model_set import MODEL_SETS, SMOLLM2, model_set_drafts, model_set_target
from shared.model.runner import ForwardItem, ModelRunner
from shared.values.sampling import SamplingParams

Row = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # target logits, draft logits, seen [V]


def all_logits(runner: ModelRunner, ids: Sequence[int]) -> torch.Tensor:
    """[len(ids), V] float32: every position's next-token logits."""
    runner.add_request("x")
    try:
        return runner.forward([ForwardItem.chain("x", list(ids), logits="all")])[0].float()
    finally:
        runner.free_request("x")


def penalized(x: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    return torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)


def positions(
    target: ModelRunner, draft: ModelRunner, draft_ids: torch.Tensor, prompt: list[int], n: int
) -> list[Row]:
    """The target's greedy continuation of `prompt` (n tokens, the engine's plain decoding) and
    both models' rows there."""
    plain = SpecEngine(Verifier(target))
    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    seq = [*prompt, *plain.generate([prompt], greedy)[0].output]
    t = all_logits(target, seq)
    d = torch.full_like(t, float("-inf"))
    d[:, draft_ids] = all_logits(draft, seq)  # a reduced head's columns at their token ids
    rows = []
    for pos in range(len(prompt) - 1, len(seq) - 1):
        seen = torch.zeros(t.shape[1], dtype=torch.bool)
        seen[torch.tensor(seq[: pos + 1])] = True
        rows.append((t[pos], d[pos], seen))
    return rows


def scores(
    t: torch.Tensor, d: torch.Tensor, temperature: float, samples: int
) -> tuple[float, float]:
    """(overlap of the two distributions, coupled argmax agreement) at `temperature`."""
    p, q = torch.softmax(t / temperature, -1), torch.softmax(d / temperature, -1)
    overlap = float(torch.minimum(p, q).sum())
    u = torch.rand(samples, t.shape[0]).clamp_min(1e-20)
    gumbel = -torch.log(-torch.log(u))
    agree = (t / temperature + gumbel).argmax(-1) == (d / temperature + gumbel).argmax(-1)
    return overlap, float(agree.float().mean())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-set", choices=MODEL_SETS, default=SMOLLM2)
    parser.add_argument("--draft", default="", help="default: draft-m, or the set's first draft")
    parser.add_argument("--per-kind", type=int, default=2, help=f"prompts of each of {KINDS}")
    parser.add_argument("--kinds", nargs="+", default=["chat", "everyday", "code"])
    parser.add_argument("--tokens", type=int, default=48, help="continuation per prompt")
    parser.add_argument("--penalty", type=float, default=1.1)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--samples", type=int, default=200, help="Gumbel draws per position")
    parser.add_argument(
        "--draft-penalties",
        type=float,
        nargs="*",
        default=[],
        help="also score the draft penalized by each of these instead of --penalty",
    )
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    target_dir = model_set_target(args.model_set)
    drafts = model_set_drafts(args.model_set)
    args.draft = args.draft or ("draft-m" if args.model_set == SMOLLM2 else next(iter(drafts)))
    target_model = load_model(target_dir)
    draft_model: LlamaModel = load_model(drafts[args.draft], target_path=target_dir)
    target = ModelRunner(target_model, kv_memory_bytes=KV_BYTES, prefix_caching=False)
    draft = ModelRunner(draft_model, kv_memory_bytes=KV_BYTES, prefix_caching=False)
    draft_ids = draft_model.output_token_ids.long()
    prompts = prompts_by_kind(args.per_kind, args.model_set)
    rows = [
        row
        for kind in args.kinds
        for prompt in prompts[kind]
        for row in positions(target, draft, draft_ids, prompt, args.tokens)
    ]
    gap = [float(t.max() - d.max()) for t, d, _ in rows]
    shift = sum(gap) / len(gap)
    target_top = sum(float(t.max()) for t, _, _ in rows) / len(rows)
    draft_top = sum(float(d.max()) for _, d, _ in rows) / len(rows)
    print(
        f"{args.draft}, {len(rows)} positions: largest logit {target_top:.2f} (target), "
        f"{draft_top:.2f} (draft); mean gap {shift:.2f}"
    )
    p = args.penalty
    treatments: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]] = {
        "no penalty": lambda t, d, s: (t, d),
        "penalty on both": lambda t, d, s: (penalized(t, s, p), penalized(d, s, p)),
        "draft shifted to the target's row maximum (oracle)": lambda t, d, s: (
            penalized(t, s, p),
            penalized(d - d.max() + t.max(), s, p),
        ),
        "draft shifted by the mean gap": lambda t, d, s: (
            penalized(t, s, p),
            penalized(d + shift, s, p),
        ),
    }
    for q in args.draft_penalties:
        treatments[f"the draft penalized by {q} instead"] = lambda t, d, s, q=q: (
            penalized(t, s, p),
            penalized(d, s, q),
        )
    print(f"{'treatment':<52} {'overlap':>8} {'coupled':>8}")
    for label, treat in treatments.items():
        measured = [scores(*treat(t, d, s), args.temperature, args.samples) for t, d, s in rows]
        overlap = sum(m[0] for m in measured) / len(measured)
        coupled = sum(m[1] for m in measured) / len(measured)
        print(f"{label:<52} {overlap:>8.3f} {coupled:>8.3f}")


if __name__ == "__main__":
    main()
