"""Train and evaluate the output-length predictor (`shared.scheduling.lengths`).

    python -m distill.lengths build   # target answers (cached) -> train -> .npz, held-out, report
    python -m distill.lengths eval    # the committed predictor on the committed held-out set

The target answers distillation prompts (training) and evaluation prompts (held-out, disjoint by
construction) greedily, in float32 through the project's own engine: the serving default on a
CPU, and so the lengths the scheduler will see. An answer's length counts its tokens without the
eos; one that reaches `--max-new-tokens` is truncated and labelled with the cap. Answers are
cached under `.cache/lengths/` (ignored by git) and extended when more are asked for.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from shared import datasets
from shared.scheduling.lengths import (
    DEFAULT_PATH,
    HASH_SIZE,
    LengthModel,
    feature_matrix,
    fit,
    mae,
    spearman,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from shared.engine.spec_engine import SpecEngine

SEED = 1234
TARGET_NAME = "SmolLM2-135M-Instruct"
REPO_ROOT = Path(__file__).resolve().parents[1]
CACHE_DIR = REPO_ROOT / ".cache" / "lengths"
HELDOUT_PATH = DEFAULT_PATH.with_name(f"heldout-{TARGET_NAME}.jsonl")
REPORT_PATH = REPO_ROOT / "docs" / "results" / "scheduling" / "length-predictor.json"
ALPHAS = tuple(float(a) for a in 10.0 ** np.arange(-3.0, 2.01, 0.5))
FOLDS = 5
PREDICTORS = ("learned", "constant", "prompt_length")


@dataclass(frozen=True)
class Example:
    split: str  # "train" or "heldout"
    kind: str
    index: int  # within its kind's prompt range of the split
    message: str  # the user text, cut to MAX_USER_CHARS
    prompt: list[int]  # chat-templated token ids
    num_output_tokens: int = 0
    is_truncated: bool = False

    @property
    def key(self) -> str:
        return hashlib.sha256(self.message.encode()).hexdigest()[:16]


# ---- the target's answers ----------------------------------------------------------------------
def cache_path(cache_dir: Path, split: str, kind: str, cap: int) -> Path:
    return cache_dir / f"{split}-{kind}-float32-cap{cap}.json"


def load_answers(path: Path) -> dict[str, dict]:
    """index -> {"key", "tokens", "finish"} of a cache file (empty when there is none)."""
    return json.loads(path.read_text()) if path.is_file() else {}


def make_examples(
    tokenizer: PreTrainedTokenizerBase, split: str, counts: dict[str, int]
) -> list[Example]:
    from distill.data import MAX_USER_CHARS, prompt_ids

    source = datasets.distill_prompts if split == "train" else datasets.eval_prompts
    out = []
    for kind, n in counts.items():
        for i, text in enumerate(source(kind, n)):
            message = text[:MAX_USER_CHARS]
            out.append(Example(split, kind, i, message, prompt_ids(tokenizer, message)))
    return out


Answers = dict[tuple[str, str], dict[str, dict]]  # (split, kind) -> index -> answer


def answer(examples: list[Example], args: argparse.Namespace) -> list[Example]:
    """Labels every example from the cache, generating what it lacks (one engine pass)."""
    cap = args.max_new_tokens
    files: Answers = {}
    for e in examples:
        if (e.split, e.kind) not in files:
            files[e.split, e.kind] = load_answers(cache_path(args.cache, e.split, e.kind, cap))
    missing = [
        e for e in examples if files[e.split, e.kind].get(str(e.index), {}).get("key") != e.key
    ]
    if missing:
        generate(missing, files, args)
    labelled = []
    for e in examples:
        a = files[e.split, e.kind][str(e.index)]
        truncated = a["finish"] == "length"
        labelled.append(replace(e, num_output_tokens=len(a["tokens"]), is_truncated=truncated))
    return labelled


def generate(examples: list[Example], files: Answers, args: argparse.Namespace) -> None:
    """The target's greedy answers to `examples`, into `files` and the cache (saved every minute,
    so an interrupted build resumes)."""
    from tqdm import tqdm

    from shared.values.sampling import SamplingParams

    print(f"generating {len(examples)} answers (max_new_tokens={args.max_new_tokens})")
    engine = make_engine(args)
    params = SamplingParams(max_tokens=args.max_new_tokens)
    by_id = {f"{e.split}/{e.kind}/{e.index}": e for e in examples}
    for request_id, e in by_id.items():
        engine.add_request(e.prompt, params, request_id)
    started = last_save = time.monotonic()
    tokens = 0
    bar = tqdm(total=len(examples), desc="target answers", unit="prompt")
    while engine.has_unfinished():
        for out in engine.step():
            if out.finish_reason is None:
                continue
            if out.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"{out.request_id} ended with {out.finish_reason}: {out.error}")
            request = engine.requests.pop(out.request_id)
            e = by_id[out.request_id]
            files[e.split, e.kind][str(e.index)] = {
                "key": e.key,
                "tokens": request.output,
                "finish": request.finish_reason,
            }
            tokens += len(request.output)
            bar.update()
        if time.monotonic() - last_save > 60:
            save_answers(files, args)
            last_save = time.monotonic()
    bar.close()
    save_answers(files, args)
    record_timing(args.cache, time.monotonic() - started, len(examples), tokens)


def make_engine(args: argparse.Namespace) -> SpecEngine:
    """Plain greedy decoding (no drafts) in float32 on the CPU, as the services serve by default."""
    from shared.engine.spec_engine import SpecEngine
    from shared.engine.verifier import Verifier
    from shared.model import load_model
    from shared.model.model_set import target_dir
    from shared.model.runner import ModelRunner
    from shared.scheduling.config import SchedulerConfig

    target = load_model(target_dir())
    runner = ModelRunner(target, kv_memory_bytes=int(args.kv_gib * (1 << 30)))
    return SpecEngine(
        Verifier(runner),
        config=SchedulerConfig(max_running_requests=args.max_running),
        eos_token_ids=target.cfg.eos_token_ids,
    )


def save_answers(files: Answers, args: argparse.Namespace) -> None:
    args.cache.mkdir(parents=True, exist_ok=True)
    for (split, kind), answers in files.items():
        path = cache_path(args.cache, split, kind, args.max_new_tokens)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(answers))
        tmp.replace(path)


def record_timing(cache_dir: Path, seconds: float, answers: int, tokens: int) -> None:
    """Adds one generation pass to the cache's running totals (the report quotes them)."""
    path = cache_dir / "timing.json"
    total = json.loads(path.read_text()) if path.is_file() else []
    total.append({"seconds": round(seconds, 1), "answers": answers, "tokens": tokens})
    path.write_text(json.dumps(total, indent=1))


# ---- training and metrics ----------------------------------------------------------------------
def log_labels(examples: Sequence[Example]) -> np.ndarray:
    return np.log1p(np.array([e.num_output_tokens for e in examples], dtype=np.float64))


def choose_alpha(x: np.ndarray, y_tokens: np.ndarray, cap: int) -> tuple[float, float]:
    """The ridge strength with the least MAE (tokens) over fixed random validation folds of the
    training set. One 20% slice picked a strength ten times off: too few prompts to trust."""
    order = np.random.default_rng(SEED).permutation(len(x))
    folds = np.array_split(order, min(FOLDS, len(x)))
    best = (np.inf, ALPHAS[0])
    for alpha in ALPHAS:
        predicted = np.empty(len(x))
        for val in folds:
            train = np.setdiff1d(order, val)
            w, b = fit(x[train], np.log1p(y_tokens[train]), alpha)
            predicted[val] = np.clip(np.expm1(x[val] @ w + b), 1, cap)
        best = min(best, (mae(predicted, y_tokens), alpha))
    return best[1], best[0]


def predictions(model: LengthModel, examples: Sequence[Example], cap: int) -> dict[str, np.ndarray]:
    """Each predictor's clipped predictions (tokens) for the examples."""
    x = feature_matrix([e.prompt for e in examples], model.hash_size)
    baselines = model.meta["baselines"]
    w, b = baselines["prompt_length"]
    out = {
        "learned": np.expm1(x @ model.weights + model.intercept),
        "constant": np.full(len(examples), baselines["constant"]),
        "prompt_length": np.expm1(x[:, -1] * w + b),
    }
    return {k: np.clip(v, 1, cap) for k, v in out.items()}


def metrics(examples: Sequence[Example], predicted: dict[str, np.ndarray]) -> dict[str, dict]:
    """MAE and Spearman per predictor, overall and per kind, with the set's description."""
    kinds = sorted({e.kind for e in examples}, key=datasets.KINDS.index)
    out: dict[str, dict] = {}
    for group in ["overall", *kinds]:
        idx = [i for i, e in enumerate(examples) if group in ("overall", e.kind)]
        true = np.array([examples[i].num_output_tokens for i in idx], dtype=np.float64)
        out[group] = {
            "n": len(idx),
            "mean_output_tokens": round(float(true.mean()), 1),
            "truncated": sum(examples[i].is_truncated for i in idx),
            **{
                name: {
                    "mae": round(mae(p[idx], true), 1),
                    "spearman": round(spearman(p[idx], true), 3),
                }
                for name, p in predicted.items()
            },
        }
    return out


def describe(examples: Sequence[Example]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for kind in datasets.KINDS:
        lengths = [e.num_output_tokens for e in examples if e.kind == kind]
        if lengths:
            out[kind] = {
                "n": len(lengths),
                "mean_output_tokens": round(float(np.mean(lengths)), 1),
                "truncated": sum(e.is_truncated for e in examples if e.kind == kind),
            }
    return out


def table(results: dict[str, dict], cap: int) -> str:
    head = (
        f"held-out, max_new_tokens={cap}: MAE in tokens (Spearman); "
        "constant = training mean, prompt_length = ridge on log prompt length"
    )
    rows = [
        head,
        f"{'':8} {'n':>4} {'mean':>6} {'trunc':>5}  "
        + "  ".join(f"{name:>16}" for name in PREDICTORS),
    ]
    for group, m in results.items():
        cells = "  ".join(
            f"{m[name]['mae']:>7.1f} ({m[name]['spearman']:>+.3f})" for name in PREDICTORS
        )
        rows.append(
            f"{group:8} {m['n']:>4} {m['mean_output_tokens']:>6.1f} {m['truncated']:>5}  {cells}"
        )
    return "\n".join(rows)


# ---- the commands ------------------------------------------------------------------------------
def build(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoTokenizer

    from shared.model.model_set import target_dir

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(target_dir())
    train_counts = {"chat": args.train_chat, "code": args.train_code, "math": args.train_math}
    eval_counts = {"chat": args.eval_chat, "code": args.eval_code, "math": args.eval_math}
    examples = answer(
        make_examples(tokenizer, "train", train_counts)
        + make_examples(tokenizer, "heldout", eval_counts),
        args,
    )
    train = [e for e in examples if e.split == "train"]
    heldout = [e for e in examples if e.split == "heldout"]
    cap = args.max_new_tokens

    x = feature_matrix([e.prompt for e in train], HASH_SIZE)
    y_tokens = np.array([e.num_output_tokens for e in train], dtype=np.float64)
    alpha, val_mae = choose_alpha(x, y_tokens, cap)
    weights, intercept = fit(x, log_labels(train), alpha)
    length_w, length_b = fit(x[:, -1:], log_labels(train), 1e-6)
    meta = {
        "target": TARGET_NAME,
        "dtype": "float32",
        "max_new_tokens": cap,
        "seed": SEED,
        "ridge_alpha": alpha,
        "validation_folds": FOLDS,
        "validation_mae": round(val_mae, 1),
        "train": describe(train),
        "heldout": describe(heldout),
        "baselines": {
            "constant": float(y_tokens.mean()),
            "prompt_length": [float(length_w[0]), length_b],
        },
    }
    model = LengthModel(weights=weights, intercept=intercept, meta=meta)
    predicted = predictions(model, heldout, cap)
    results = metrics(heldout, predicted)
    model = LengthModel(
        weights=weights, intercept=intercept, meta={**meta, "heldout_metrics": results}
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model.save(args.out)
    write_heldout(heldout, predicted["learned"], args.out.with_name(HELDOUT_PATH.name))
    timing_path = args.cache / "timing.json"
    report = {
        "predictor": "shared.scheduling.lengths.LearnedLength",
        "file": str(args.out.relative_to(REPO_ROOT)) if args.out.is_relative_to(REPO_ROOT) else "",
        **{k: v for k, v in meta.items() if k != "baselines"},
        "labels": "answer tokens without the eos; truncated answers (at the cap) count as the cap",
        "generation": json.loads(timing_path.read_text()) if timing_path.is_file() else [],
        "heldout_metrics": results,
    }
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=2) + "\n")
    print(f"ridge alpha {alpha:g} ({FOLDS}-fold validation MAE {val_mae:.1f}); wrote {args.out}")
    print(table(results, cap))


def write_heldout(examples: Sequence[Example], predicted: np.ndarray, path: Path) -> None:
    with path.open("w") as f:
        for e, p in zip(examples, predicted, strict=True):
            row = {
                "kind": e.kind,
                "index": e.index,
                "message": e.message,
                "num_prompt_tokens": len(e.prompt),
                "num_output_tokens": e.num_output_tokens,
                "is_truncated": e.is_truncated,
                "predicted": round(float(p), 1),
            }
            f.write(json.dumps(row) + "\n")


def read_heldout(path: Path, tokenizer: PreTrainedTokenizerBase) -> list[Example]:
    """The committed held-out set, prompts re-tokenized (the lengths must match)."""
    from distill.data import prompt_ids

    out = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        prompt = prompt_ids(tokenizer, row["message"])
        if len(prompt) != row["num_prompt_tokens"]:
            raise ValueError(f"{path}: {row['kind']} #{row['index']} tokenizes differently")
        out.append(
            Example(
                "heldout",
                row["kind"],
                row["index"],
                row["message"],
                prompt,
                num_output_tokens=row["num_output_tokens"],
                is_truncated=row["is_truncated"],
            )
        )
    return out


def evaluate(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from shared.model.model_set import target_dir

    model = LengthModel.load(args.out)
    heldout = read_heldout(
        args.out.with_name(HELDOUT_PATH.name), AutoTokenizer.from_pretrained(target_dir())
    )
    cap = int(model.meta["max_new_tokens"])
    print(table(metrics(heldout, predictions(model, heldout, cap)), cap))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m distill.lengths", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="generate (cached), train, write the predictor and report")
    e = sub.add_parser("eval", help="evaluate the committed predictor on the held-out set")
    for p in (b, e):
        p.add_argument("--out", type=Path, default=DEFAULT_PATH, help="the predictor's .npz")
    b.add_argument("--max-new-tokens", type=int, default=512)
    b.add_argument("--train-chat", type=int, default=160)
    b.add_argument("--train-code", type=int, default=80)
    b.add_argument("--train-math", type=int, default=80)
    b.add_argument("--eval-chat", type=int, default=60)
    b.add_argument("--eval-code", type=int, default=40)
    b.add_argument("--eval-math", type=int, default=60)
    b.add_argument("--max-running", type=int, default=64, help="requests decoded together")
    b.add_argument("--kv-gib", type=float, default=4.0, help="the target's KV cache, GiB")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--cache", type=Path, default=CACHE_DIR)
    b.add_argument("--report", type=Path, default=REPORT_PATH, help="the held-out metrics, JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command == "build":
        build(args)
    else:
        evaluate(args)


if __name__ == "__main__":
    main()
