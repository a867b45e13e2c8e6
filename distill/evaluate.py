"""Offline, exact evaluation of greedy speculative decoding with each draft.

For an evaluation prompt, g is the target's greedy continuation (fp32, our runtime). Along the
committed prefix prompt + g[:j], a greedy draft proposes its argmax; a chain of k proposes k
tokens, the target accepts the leading run that equals g and adds one bonus token. Since every
accepted proposal lies on g, the draft's proposals are exactly its teacher-forced predictions along
prompt + g, so one teacher-forced draft forward per request gives the exact outcome of greedy
chain decoding for every k. The same holds for static expansion trees <k1, ..., km> (SpecInfer):
depth d's children are the draft's top-k_d tokens, and the accepted path follows g as long as
g's next token is among the draft's top-k_d there.

Costs come from our runtime (`ModelRunner`) on this machine: a decode step of the target (one
token), a verification forward of n tokens, and a draft step at tree width w.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from shared.datasets import KINDS, eval_prompts
from shared.model import load_model
from shared.model.runner import ForwardItem, ModelRunner

MAX_RANK = 16  # ranks at or past this count as "not in any tree we consider"


@dataclass
class Reference:
    kind: str
    prompt: list[int]
    continuation: list[int]  # target's greedy tokens, g[0] comes from the prefill


def _runner(model, tokens: int) -> ModelRunner:
    """A runner whose KV cache holds `tokens` tokens (plus slack for block rounding)."""
    cfg = model.cfg
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    return ModelRunner(model, block_size=16, kv_memory_bytes=(tokens + 1024) * per_token)


@torch.inference_mode()
def target_references(
    target_dir: Path,
    n_per_kind: int,
    max_new_tokens: int,
    cache_path: Path | None,
    kinds: tuple[str, ...] = KINDS,
) -> list[Reference]:
    """The target's greedy continuations of the evaluation prompts (fp32, our runtime, batched
    decode); cached as JSON when a path is given."""
    if cache_path is not None and cache_path.is_file():
        raw = json.loads(cache_path.read_text())
        same_kinds = raw.get("kinds", list(KINDS)) == list(kinds)
        enough = raw["n_per_kind"] >= n_per_kind and raw["max_new_tokens"] == max_new_tokens
        if same_kinds and enough:  # the first n of each kind (prompts are a fixed list)
            refs = [Reference(**r) for r in raw["refs"]]
            return [r for k in kinds for r in [x for x in refs if x.kind == k][:n_per_kind]]
    from transformers import AutoTokenizer

    from distill.data import prompt_ids

    tok = AutoTokenizer.from_pretrained(target_dir)
    eos = int(tok.eos_token_id)
    model = load_model(target_dir, torch.float32)
    refs: list[Reference] = []
    for kind in kinds:
        prompts = [prompt_ids(tok, m) for m in eval_prompts(kind, n_per_kind)]
        refs.extend(
            Reference(kind, p, c)
            for p, c in zip(
                prompts,
                greedy_runner(model, prompts, max_new_tokens, eos, f"refs {kind}"),
                strict=True,
            )
        )
    if cache_path is not None:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "n_per_kind": n_per_kind,
            "max_new_tokens": max_new_tokens,
            "kinds": list(kinds),
            "refs": [r.__dict__ for r in refs],
        }
        cache_path.write_text(json.dumps(payload))
    return refs


@torch.inference_mode()
def greedy_runner(
    model, prompts: list[list[int]], max_new_tokens: int, eos: int, desc: str, batch: int = 16
) -> list[list[int]]:
    """Plain greedy decoding with our runner, `batch` requests per decode forward."""
    out: list[list[int]] = []
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt")
    for lo in range(0, len(prompts), batch):
        group = prompts[lo : lo + batch]
        runner = _runner(model, sum(len(p) + max_new_tokens + 16 for p in group))
        rids = [str(i) for i in range(len(group))]
        for rid in rids:
            runner.add_request(rid)
        last = {}
        for rid, p in zip(rids, group, strict=True):
            [logits] = runner.prefill({rid: p})
            last[rid] = int(model.output_token_ids[logits[-1].argmax()])
        gens = {rid: [last[rid]] for rid in rids}
        live = [rid for rid in rids if last[rid] != eos]
        while live and max(len(gens[r]) for r in live) < max_new_tokens:
            logits = runner.forward([ForwardItem.chain(r, [gens[r][-1]]) for r in live])
            runner.commit({r: [0] for r in live})
            for r, lg in zip(live, logits, strict=True):
                gens[r].append(int(model.output_token_ids[lg[-1].argmax()]))
            live = [r for r in live if gens[r][-1] != eos and len(gens[r]) < max_new_tokens]
        out.extend(gens[r] for r in rids)
        bar.update(len(group))
    bar.close()
    return out


@torch.inference_mode()
def teacher_forced_ranks(
    draft_dir: Path, target_dir: Path, refs: list[Reference]
) -> list[np.ndarray]:
    """Per request, the draft's rank of g[j] given prompt + g[:j], for j = 1..len(g)-1
    (0 = the draft's argmax; MAX_RANK when absent from its top-(MAX_RANK-1) or its vocab)."""
    model = load_model(draft_dir, torch.float32, target_path=target_dir)
    out_ids = model.output_token_ids
    full_to_row = torch.full((model.cfg.vocab_size,), -1, dtype=torch.long)
    full_to_row[out_ids] = torch.arange(len(out_ids))
    ranks: list[np.ndarray] = []
    for ref in tqdm(refs, desc=f"score {draft_dir.name}", unit="req", leave=False):
        runner = _runner(model, len(ref.prompt) + len(ref.continuation))
        runner.add_request("r")
        seq = ref.prompt + ref.continuation[:-1]
        [logits] = runner.forward([ForwardItem.chain("r", seq, logits="all")])
        lg = logits[len(ref.prompt) :]  # predicts g[1:]
        want = full_to_row[torch.tensor(ref.continuation[1:], dtype=torch.long)]
        top = lg.topk(MAX_RANK - 1, dim=-1).indices
        hit = (top == want.clamp_min(0)[:, None]) & (want[:, None] >= 0)
        r = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(want, MAX_RANK))
        ranks.append(r.numpy().astype(np.int64))
    return ranks


def _output_vocabulary(draft_dir: Path) -> set[int]:
    """The token ids a draft can propose, read without building the model."""
    from safetensors import safe_open

    from shared.model.loader import OUTPUT_TOKEN_IDS_KEY

    with safe_open(str(draft_dir / "model.safetensors"), framework="pt") as f:
        return set(f.get_tensor(OUTPUT_TOKEN_IDS_KEY).tolist())


def tree_size(shape: tuple[int, ...]) -> int:
    return sum(int(np.prod(shape[: d + 1])) for d in range(len(shape)))


def simulate(ranks: np.ndarray, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """Greedy decoding of one request with a static tree <k1..km> (a chain is <1,...,1>).

    Returns (verification forwards, accepted draft tokens, tokens produced by them incl. bonus)
    for producing g[1:] (g[0] comes from the prefill)."""
    n = len(ranks)
    j = forwards = accepted = 0
    while j < n:
        m = 0
        while m < len(shape) and j + m < n and ranks[j + m] < shape[m]:
            m += 1
        forwards += 1
        accepted += m
        j += m + 1
    return forwards, accepted, n


@dataclass
class Costs:
    """Seconds on this machine, measured with our runner (median of repeats)."""

    target_decode: float
    target_verify: dict[int, float]  # tokens in the verification forward -> seconds
    draft_step: dict[str, dict[int, float]]  # draft -> tree width -> seconds per draft forward


def width_stepper(model, prefix: int, room: int, seed: int = 0) -> Callable[[int], float]:
    """After committing a random `prefix`, a function that runs one forward + commit of a root
    and w - 1 children (a tree layer of width w) and returns its seconds; each call commits one
    token, and the cache holds `room` more. A feature-level model reads random features, which
    cost what real ones do."""
    runner = _runner(model, prefix + room)
    runner.add_request("r")
    gen = torch.Generator().manual_seed(seed)
    vocab = model.cfg.vocab_size
    width = model.cfg.feature_size  # a feature-level draft reads a feature per token

    def features(n: int) -> torch.Tensor | None:
        return torch.randn(n, width, generator=gen) if width else None

    prompt = torch.randint(3, vocab, (prefix,), generator=gen).tolist()
    runner.forward([ForwardItem.chain("r", prompt, features=features(prefix))])
    runner.commit({"r": range(prefix)})

    def step(w: int) -> float:
        toks = torch.randint(3, vocab, (w,), generator=gen).tolist()
        feats = features(w)
        t = time.perf_counter()
        runner.forward([ForwardItem("r", toks, [-1] + [0] * (w - 1), features=feats)])
        runner.commit({"r": [0]})
        return time.perf_counter() - t

    return step


@torch.inference_mode()
def _time_widths(
    model, widths: list[int], prefix: int = 200, repeats: int = 15
) -> dict[int, float]:
    """Median seconds of one forward + commit at each width (a root and width-1 children),
    widths interleaved round-robin so that load from other processes hits all of them alike."""
    step = width_stepper(model, prefix, (repeats + 2) * len(widths) + max(widths))
    times: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(repeats + 2):
        for w in widths:
            times[w].append(step(w))
    return {w: statistics.median(ts[2:]) for w, ts in times.items()}


def measure_costs(target_dir: Path, draft_dirs: dict[str, Path], *, int8: bool = False) -> Costs:
    """Step latencies at batch size 1 (chain verification = a forward of k+1 tokens); `int8`:
    the drafts with int8 weights (`LlamaModel.quantize_int8`)."""
    target = load_model(target_dir, torch.float32)
    verify = _time_widths(target, [1, 5, 9, 17, 33])
    drafts = {}
    for name, d in tqdm(draft_dirs.items(), desc="time drafts"):
        drafts[name] = _time_widths(
            load_model(d, torch.float32, target_path=target_dir, int8=int8), [1, 2, 4, 8, 16]
        )
    return Costs(verify[1], verify, drafts)


def _interp(table: dict[int, float], x: int) -> float:
    keys = sorted(table)
    if x <= keys[0]:
        return table[keys[0]]
    for a, b in itertools.pairwise(keys):
        if x <= b:
            return table[a] + (table[b] - table[a]) * (x - a) / (b - a)
    a, b = keys[-2], keys[-1]
    return table[b] + (table[b] - table[a]) * (x - b) / (b - a)


def iteration_seconds(costs: Costs, draft: str, shape: tuple[int, ...]) -> float:
    """One speculation + verification round: m draft forwards (width = nodes at that depth,
    the first at width 1 since it extends the root) and one target forward of size+1 tokens."""
    widths = [1] + [int(np.prod(shape[: d + 1])) for d in range(len(shape) - 1)]
    spec = sum(_interp(costs.draft_step[draft], w) for w in widths)
    return spec + _interp(costs.target_verify, tree_size(shape) + 1)


def candidate_trees(max_nodes: int, max_depth: int = 6) -> list[tuple[int, ...]]:
    out = []
    for depth in range(1, max_depth + 1):
        for shape in itertools.product([1, 2, 3, 4], repeat=depth):
            if list(shape) != sorted(shape, reverse=True):  # wide near the root only
                continue
            if tree_size(shape) <= max_nodes:
                out.append(shape)
    return out


def evaluate(
    target_dir: Path,
    draft_dirs: dict[str, Path],
    *,
    n_per_kind: int,
    max_new_tokens: int,
    cache_dir: Path,
    chain: int = 4,
    max_tree_nodes: int = 16,
) -> dict:
    refs = target_references(
        target_dir, n_per_kind, max_new_tokens, cache_dir / "eval_references.json"
    )
    refs_used = [r for r in refs if len(r.continuation) >= 2]
    costs = measure_costs(target_dir, draft_dirs)
    ranks = {name: teacher_forced_ranks(d, target_dir, refs_used) for name, d in draft_dirs.items()}
    chain_shape = (1,) * chain
    result: dict = {
        "n_per_kind": n_per_kind,
        "max_new_tokens": max_new_tokens,
        "requests": len(refs_used),
        "costs": {
            "target_decode_ms": round(1e3 * costs.target_decode, 3),
            "target_verify_ms": {n: round(1e3 * t, 3) for n, t in costs.target_verify.items()},
            "draft_step_ms": {
                k: {w: round(1e3 * t, 3) for w, t in v.items()} for k, v in costs.draft_step.items()
            },
            "draft_cost_ratio": {
                k: round(v[1] / costs.target_decode, 4) for k, v in costs.draft_step.items()
            },
        },
        "drafts": {},
    }
    kinds_of = [r.kind for r in refs_used]
    trees = candidate_trees(max_tree_nodes)
    for name, ddir in draft_dirs.items():
        vocab = _output_vocabulary(ddir)
        per_kind: dict[str, dict] = {}
        for kind in [*KINDS, "mix"]:
            idx = [i for i, k in enumerate(kinds_of) if kind in ("mix", k)]
            rk = [ranks[name][i] for i in idx]
            top1 = float(np.mean(np.concatenate(rk) == 0))
            f, a, n = map(sum, zip(*(simulate(r, chain_shape) for r in rk), strict=True))
            best = most = None  # fastest estimated tree; tree with most accepted tokens
            for shape in trees:
                tf, _, tn = map(sum, zip(*(simulate(r, shape) for r in rk), strict=True))
                mal = tn / tf
                secs = tf * iteration_seconds(costs, name, shape)
                cand = {
                    "shape": list(shape),
                    "nodes": tree_size(shape),
                    "mean_accepted_tokens": round(mal, 3),
                    "est_tokens_per_s": round(tn / secs, 2),
                }
                if best is None or cand["est_tokens_per_s"] > best["est_tokens_per_s"]:
                    best = cand
                if most is None or mal > most["mean_accepted_tokens"]:
                    most = cand
            secs = f * iteration_seconds(costs, name, chain_shape)
            cont = [t for i in idx for t in refs_used[i].continuation[1:]]
            per_kind[kind] = {
                "output_vocab_coverage": round(float(np.mean([t in vocab for t in cont])), 4),
                "top1_match": round(top1, 4),
                f"chain{chain}_acceptance_rate": round(a / (f * chain), 4),
                f"chain{chain}_mean_accepted_tokens": round(n / f, 3),
                f"chain{chain}_est_tokens_per_s": round(n / secs, 2),
                f"fastest_tree_max{max_tree_nodes}": best,
                f"most_accepting_tree_max{max_tree_nodes}": most,
            }
        result["drafts"][name] = per_kind
    # Which draft gives each request the lowest estimated latency (chain of `chain`)? Once with
    # plain decoding as a contender, once among the drafts only (Spin Fig. 2-3).
    for key, with_target in (("winners_chain", True), ("winners_chain_drafts_only", False)):
        winners: dict[str, Counter] = {k: Counter() for k in [*KINDS, "mix"]}
        for i, kind in enumerate(kinds_of):
            n_tok = len(ranks[next(iter(ranks))][i])
            lat = {"none (target only)": n_tok * costs.target_decode} if with_target else {}
            for name in draft_dirs:
                f, _, _ = simulate(ranks[name][i], chain_shape)
                lat[name] = f * iteration_seconds(costs, name, chain_shape)
            win = min(lat, key=lambda k: lat[k])
            winners[kind][win] += 1
            winners["mix"][win] += 1
        result[key] = {k: dict(v) for k, v in winners.items()}
    speed = {name: {} for name in draft_dirs}
    for name in draft_dirs:
        for kind in [*KINDS, "mix"]:
            idx = [i for i, k in enumerate(kinds_of) if kind in ("mix", k)]
            tok = sum(len(ranks[name][i]) for i in idx)
            fw = sum(simulate(ranks[name][i], chain_shape)[0] for i in idx)
            speed[name][kind] = round(
                tok * costs.target_decode / (fw * iteration_seconds(costs, name, chain_shape)), 3
            )
    result["est_speedup_vs_target_chain"] = speed
    # The offline simulation against the real engine, for every draft on a few requests per kind.
    few = [r for kind in KINDS for r in [x for x in refs_used if x.kind == kind][:4]]
    result["engine_crosscheck"] = [
        engine_crosscheck(target_dir, d, few, chain) for d in tqdm(draft_dirs.values(), "engine")
    ]
    return result


def markdown_report(result: dict, chain: int = 4, max_tree_nodes: int = 16) -> str:
    """The tables of docs/models.md, from `evaluate`'s result."""
    costs = result["costs"]
    lines = [
        f"Target decode step (batch 1): {costs['target_decode_ms']:.1f} ms; verification forward "
        "of n tokens: "
        + ", ".join(f"n={n}: {t:.1f} ms" for n, t in costs["target_verify_ms"].items())
        + ".",
        "",
        "| draft | step ms (width 1) | cost per token vs target | width 2 / 4 / 8 / 16 ms |",
        "|---|---|---|---|",
    ]
    for name, steps in costs["draft_step_ms"].items():
        widths = " / ".join(f"{steps[w]:.2f}" for w in list(steps)[1:])
        lines.append(
            f"| {name} | {steps[next(iter(steps))]:.2f} | "
            f"{100 * costs['draft_cost_ratio'][name]:.1f}% | {widths} |"
        )
    lines += [
        "",
        f"| draft | kind | top-1 match | chain-{chain} acceptance rate | chain-{chain} mean "
        f"accepted tokens | fastest tree (≤{max_tree_nodes} nodes): shape, mean accepted | "
        f"most accepting tree: shape, mean accepted | est. speedup, chain-{chain} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    speed = result["est_speedup_vs_target_chain"]
    for name, per_kind in result["drafts"].items():
        for kind, m in per_kind.items():
            fast = m[f"fastest_tree_max{max_tree_nodes}"]
            most = m[f"most_accepting_tree_max{max_tree_nodes}"]
            lines.append(
                f"| {name} | {kind} | {m['top1_match']:.3f} | "
                f"{m[f'chain{chain}_acceptance_rate']:.3f} | "
                f"**{m[f'chain{chain}_mean_accepted_tokens']:.2f}** | "
                f"⟨{','.join(map(str, fast['shape']))}⟩ ({fast['nodes']} nodes): "
                f"{fast['mean_accepted_tokens']:.2f} | "
                f"⟨{','.join(map(str, most['shape']))}⟩ ({most['nodes']} nodes): "
                f"{most['mean_accepted_tokens']:.2f} | {speed[name][kind]:.2f}× |"
            )
    titles = {
        "winners_chain": "Which draft gives each request the lowest estimated latency "
        f"(chain of {chain}), plain decoding included:",
        "winners_chain_drafts_only": "Among the drafts only (which one a per-request draft "
        "choice should pick):",
    }
    for key, title in titles.items():
        lines += ["", title, "", *_histogram(result.get(key, {}))]
    return "\n".join(lines) + "\n"


def _histogram(win: dict[str, dict[str, int]]) -> list[str]:
    options = sorted({k for v in win.values() for k in v})
    lines = ["| prompts | " + " | ".join(options) + " |", "|---|" + "---|" * len(options)]
    for kind, counts in win.items():
        total = sum(counts.values())
        cells = []
        for o in options:
            c = counts.get(o, 0)
            bar = "█" * round(20 * c / total) if total else ""
            cells.append(f"{c} {bar}")
        lines.append(f"| {kind} ({total}) | " + " | ".join(cells) + " |")
    return lines


@torch.inference_mode()
def engine_run(
    target_dir: Path, draft_dir: Path, refs: list[Reference], method, *, int8: bool = False
) -> dict:
    """Greedy decoding of `refs` with the real engine (shared.engine) and one draft method;
    `int8`: the draft with int8 weights."""
    from shared.engine.drafting import Drafter
    from shared.engine.spec_engine import SpecEngine
    from shared.engine.verifier import Verifier
    from shared.values.sampling import SamplingParams

    target = load_model(target_dir, torch.float32)
    draft = load_model(draft_dir, torch.float32, target_path=target_dir, int8=int8)
    total = sum(len(r.prompt) + len(r.continuation) + 64 for r in refs)
    engine = SpecEngine(
        Verifier(_runner(target, total)),
        Drafter(_runner(draft, total)),
        method,
        eos_token_ids=target.cfg.eos_token_ids,
    )
    params = [SamplingParams(max_tokens=len(r.continuation)) for r in refs]
    start = time.perf_counter()
    out = engine.generate([r.prompt for r in refs], params)
    seconds = time.perf_counter() - start
    eos = set(target.cfg.eos_token_ids)
    # The engine reports a stop token as the finish reason, not as an output token.
    same = sum(
        o.output == [t for t in r.continuation if t not in eos]
        for o, r in zip(out, refs, strict=True)
    )
    return {
        "draft": draft_dir.name,
        "requests": len(refs),
        "outputs_equal_target_greedy": same,
        "engine_target_forwards": engine.stats.num_target_forwards,
        "engine_mean_accepted_length": round(engine.stats.mean_accepted_length, 3),
        "engine_acceptance_rate": round(engine.stats.acceptance_rate, 3),
        "wall_seconds_batched": round(seconds, 1),
        # decode forwards per request (the prefill's forward, which gives g[0], not counted)
        "per_request_forwards": [o.stats.num_target_forwards for o in out],
    }


ENGINE_METHODS = {
    "chain k=4": ("chain", {"k": 4}),
    "static <4,1,1,1>": ("static", {"expansion": (4, 1, 1, 1)}),
    "static <2,2,1,1>": ("static", {"expansion": (2, 2, 1, 1)}),
    "dynamic (<=16 nodes, depth<=6)": ("dynamic", {"max_size": 16, "max_depth": 6}),
    "dynamic (<=16 nodes, depth<=8)": ("dynamic", {"max_size": 16, "max_depth": 8}),
    "dynamic (<=16 nodes, depth<=10, width<=3)": (
        "dynamic",
        {"max_size": 16, "max_depth": 10, "max_width": 3},
    ),
}


# Short names for the command line (`python -m distill kinds --methods chain4,dynamic16`).
METHOD_KEYS = {
    "chain4": "chain k=4",
    "static4111": "static <4,1,1,1>",
    "static2211": "static <2,2,1,1>",
    "dynamic16": "dynamic (<=16 nodes, depth<=6)",
    "dynamic16d8": "dynamic (<=16 nodes, depth<=8)",
    "dynamic16d10w3": "dynamic (<=16 nodes, depth<=10, width<=3)",
}


def engine_by_kind(
    target_dir: Path,
    draft_dirs: dict[str, Path],
    refs: list[Reference],
    methods: list[str] | None = None,
    *,
    int8: bool = False,
) -> list[dict]:
    """Every draft and tree method through the real engine (greedy), per prompt kind: mean
    accepted tokens per target forward and whether outputs equal the target's greedy ones.
    Exact for every draft, a feature-level one included (whose deeper levels read its own
    predicted features, which no teacher-forced simulation reproduces)."""
    from shared.values.methods import DraftMethod

    rows = []
    kinds = sorted({r.kind for r in refs}, key=[*KINDS, "everyday"].index)
    unknown = set(methods or ()) - set(METHOD_KEYS)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; choose from {list(METHOD_KEYS)}")
    labels = [METHOD_KEYS[m] for m in methods] if methods else list(ENGINE_METHODS)
    for d in draft_dirs.values():
        for label in labels:
            kind_of_method, args = ENGINE_METHODS[label]
            for kind in kinds:
                mine = [r for r in refs if r.kind == kind]
                extra = {"budget": 16 * len(mine)} if kind_of_method == "dynamic" else {}
                method = DraftMethod(kind_of_method, **args, **extra)
                row = engine_run(target_dir, d, mine, method, int8=int8)
                rows.append({"method": label, "kind": kind, **row})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def engine_winners(
    target_dir: Path,
    draft_dirs: dict[str, Path],
    refs: list[Reference],
    costs: Costs,
    chain: int = 4,
    *,
    int8: bool = False,
) -> dict:
    """Which draft gives each request the lowest estimated latency with a chain of `chain`, from
    the real engine's per-request target forwards (exact for a feature-level draft too) times
    this machine's measured round cost at batch 1 (`iteration_seconds`)."""
    from shared.values.methods import DraftMethod

    forwards: dict[str, list[int]] = {}
    equal: dict[str, int] = {}
    for name, d in draft_dirs.items():
        row = engine_run(target_dir, d, refs, DraftMethod("chain", k=chain), int8=int8)
        forwards[name] = row["per_request_forwards"]
        equal[name] = row["outputs_equal_target_greedy"]
        print(json.dumps({k: v for k, v in row.items() if k != "per_request_forwards"}))
    result = {"chain": chain, "outputs_equal_target_greedy": equal, "forwards": forwards}
    result["mean_accepted"] = accepted_by_kind(refs, forwards)
    return result | winners_from_forwards(refs, forwards, costs, chain)


def kinds_of(refs: list[Reference]) -> list[str]:
    """The prompt kinds `refs` hold, in the evaluation order (everyday last)."""
    return [k for k in [*KINDS, "everyday"] if any(r.kind == k for r in refs)]


def accepted_by_kind(refs: list[Reference], forwards: dict[str, list[int]]) -> dict:
    """Per draft, per kind and over the mix: mean accepted tokens per target forward (bonus
    included), from each request's target forwards; the engine counts the first token, which
    prefill produces, outside them."""
    kinds = kinds_of(refs)
    result: dict = {}
    for name, per_request in forwards.items():
        result[name] = {}
        for kind in [*kinds, "mix"]:
            mine = [i for i, r in enumerate(refs) if kind in ("mix", r.kind)]
            produced = sum(max(0, len(refs[i].continuation) - 1) for i in mine)
            result[name][kind] = round(produced / max(1, sum(per_request[i] for i in mine)), 3)
    return result


def winners_from_forwards(
    refs: list[Reference], forwards: dict[str, list[int]], costs: Costs, chain: int
) -> dict:
    """Per kind and over the mix, how many requests each contender serves fastest: a draft's
    latency is its target forwards for the request times one chain round's cost, plain
    decoding's is one target decode step per token after the first. Once with plain decoding
    as a contender (`winners_chain`), once among the drafts only."""
    kinds = kinds_of(refs)
    shape = (1,) * chain
    result: dict = {}
    for key, with_target in (("winners_chain", True), ("winners_chain_drafts_only", False)):
        winners: dict[str, Counter] = {k: Counter() for k in [*kinds, "mix"]}
        for i, ref in enumerate(refs):
            n_tok = max(0, len(ref.continuation) - 1)
            lat = {"none (target only)": n_tok * costs.target_decode} if with_target else {}
            for name, per_request in forwards.items():
                lat[name] = per_request[i] * iteration_seconds(costs, name, shape)
            win = min(lat, key=lambda k: lat[k])
            winners[ref.kind][win] += 1
            winners["mix"][win] += 1
        result[key] = {k: dict(v) for k, v in winners.items()}
    return result


def winners_report(result: dict) -> str:
    """Markdown histograms of `engine_winners`' result."""
    lines = [f"Fastest per request, chain of {result['chain']}, plain decoding a contender:", ""]
    lines += _histogram(result["winners_chain"])
    lines += ["", "Among the drafts only:", ""]
    lines += _histogram(result["winners_chain_drafts_only"])
    accepted = result.get("mean_accepted")
    if accepted:
        kinds = list(next(iter(accepted.values())))
        lines += ["", f"Mean accepted tokens per target forward, chain of {result['chain']}:", ""]
        lines += ["| draft | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
        for name, by_kind in accepted.items():
            lines.append(f"| {name} | " + " | ".join(f"{by_kind[k]:.2f}" for k in kinds) + " |")
    return "\n".join(lines) + "\n"


def engine_crosscheck(
    target_dir: Path, draft_dir: Path, refs: list[Reference], chain: int = 4
) -> dict:
    """The engine's chain decoding against the offline simulation (forward counts must agree)."""
    from shared.values.methods import DraftMethod

    result = engine_run(target_dir, draft_dir, refs, DraftMethod("chain", k=chain))
    ranks = teacher_forced_ranks(draft_dir, target_dir, refs)
    offline = sum(simulate(rk, (1,) * chain)[0] for rk in ranks)
    produced = sum(len(r.continuation) - 1 for r in refs)
    result["offline_target_forwards"] = offline
    result["offline_mean_accepted_tokens"] = round(produced / offline, 3)
    return result


def engine_trees(
    target_dir: Path, draft_dirs: dict[str, Path], refs: list[Reference]
) -> list[dict]:
    """Tree methods of shared.engine.drafting through the engine (greedy): mean accepted length."""
    from shared.values.methods import DraftMethod

    methods = {
        "chain k=4": DraftMethod("chain", k=4),
        "static <4,1,1,1>": DraftMethod("static", expansion=(4, 1, 1, 1)),
        "static <2,2,1,1>": DraftMethod("static", expansion=(2, 2, 1, 1)),
        "dynamic (<=16 nodes, depth<=6)": DraftMethod(
            "dynamic", budget=16 * len(refs), max_size=16, max_depth=6
        ),
    }
    rows = []
    for name, d in draft_dirs.items():
        for label, method in tqdm(methods.items(), desc=f"engine trees {name}"):
            rows.append({"method": label, **engine_run(target_dir, d, refs, method)})
    return rows
