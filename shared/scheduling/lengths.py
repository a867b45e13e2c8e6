"""A learned output-length predictor for LP-SJF and LAPS-SD (numpy only, cheap to import).

The target's greedy answer length is predicted from the prompt's token ids alone: hashed token
unigrams and bigrams (log1p counts, L2-normalized) plus the log prompt length, fed to a ridge
regression on log1p(output length). The weights are trained by `python -m distill.lengths build`
on the target's own answers and loaded from a committed `.npz` file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the request module imports torch; this one must not
    from shared.scheduling.request import RequestState

# Bump when `features` changes: a file trained on other features is refused.
RECIPE_VERSION = 1
HASH_SIZE = 4096  # a power of two
TARGET_VOCAB_SIZE = 49152  # SmolLM2-135M-Instruct's tokenizer
DEFAULT_PATH = (
    Path(__file__).resolve().parents[2]
    / "models"
    / "length-predictor"
    / "SmolLM2-135M-Instruct.npz"
)

_FIB = np.uint64(11400714819323198485)  # 2^64 / golden ratio: multiplicative hashing
_BIGRAM_SHIFT = np.uint64(32)
_BIGRAM_TAG = np.uint64(1 << 63)  # keeps bigram keys apart from unigram keys


def features(prompt_ids: Sequence[int], hash_size: int = HASH_SIZE) -> np.ndarray:
    """float64 [hash_size + 1]: hashed unigram and bigram counts, then log1p(prompt length)."""
    if hash_size & (hash_size - 1):
        raise ValueError(f"hash_size must be a power of two, got {hash_size}")
    ids = np.asarray(prompt_ids, dtype=np.uint64)
    bigrams = (ids[:-1] << _BIGRAM_SHIFT) | ids[1:] | _BIGRAM_TAG
    keys = np.concatenate([ids, bigrams])
    bits = np.uint64(hash_size.bit_length() - 1)
    # uint64 products wrap around modulo 2^64, which is what the hash wants
    slots = (keys * _FIB) >> (np.uint64(64) - bits) if bits else np.zeros_like(keys)
    counts = np.log1p(np.bincount(slots.astype(np.int64), minlength=hash_size))
    norm = np.linalg.norm(counts)
    out = np.empty(hash_size + 1)
    out[:hash_size] = counts / norm if norm else counts
    out[hash_size] = np.log1p(len(ids))
    return out


def feature_matrix(prompts: Sequence[Sequence[int]], hash_size: int = HASH_SIZE) -> np.ndarray:
    return np.stack([features(p, hash_size) for p in prompts])


def fit(x: np.ndarray, y: np.ndarray, alpha: float) -> tuple[np.ndarray, float]:
    """Ridge regression with an unpenalized intercept: (weights, intercept)."""
    x_mean, y_mean = x.mean(axis=0), float(y.mean())
    xc, yc = x - x_mean, y - y_mean
    n, d = xc.shape
    if n < d:  # the dual form: an n x n system instead of d x d
        weights = xc.T @ np.linalg.solve(xc @ xc.T + alpha * np.eye(n), yc)
    else:
        weights = np.linalg.solve(xc.T @ xc + alpha * np.eye(d), xc.T @ yc)
    return weights, y_mean - float(x_mean @ weights)


def mae(predicted: Sequence[float] | np.ndarray, true: Sequence[float] | np.ndarray) -> float:
    return float(np.mean(np.abs(np.asarray(predicted, float) - np.asarray(true, float))))


def average_ranks(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """1-based ranks; tied values share the mean of the ranks they span."""
    x = np.asarray(values, dtype=np.float64)
    order = np.argsort(x, kind="stable")
    ordered = x[order]
    starts_run = np.concatenate([[True], ordered[1:] != ordered[:-1]])
    run = np.cumsum(starts_run) - 1
    starts = np.flatnonzero(starts_run)
    ends = np.append(starts[1:], len(x))
    ranks = np.empty(len(x))
    ranks[order] = ((starts + ends - 1) / 2 + 1)[run]
    return ranks


def spearman(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> float:
    """Spearman rank correlation (average ranks for ties).

    0 when either side is constant: such a side carries no ranking (scipy would give nan).
    """
    if len(a) != len(b):
        raise ValueError(f"lengths differ: {len(a)} != {len(b)}")
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = float(np.sqrt((ra @ ra) * (rb @ rb)))
    return float(ra @ rb / denom) if denom > 0 else 0.0


@dataclass(frozen=True)
class LengthModel:
    """Weights over `features`, predicting log1p(output tokens), and what they were made from."""

    weights: np.ndarray  # [hash_size + 1]
    intercept: float
    hash_size: int = HASH_SIZE
    vocab_size: int = TARGET_VOCAB_SIZE
    recipe_version: int = RECIPE_VERSION
    # training counts, max_new_tokens, ridge strength, baselines, held-out metrics
    meta: dict[str, Any] = field(default_factory=dict)

    def predict_tokens(self, prompt_ids: Sequence[int]) -> float:
        z = float(features(prompt_ids, self.hash_size) @ self.weights) + self.intercept
        return float(np.expm1(z))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            np.savez_compressed(
                f,
                weights=self.weights.astype(np.float32),
                intercept=np.float64(self.intercept),
                hash_size=np.int64(self.hash_size),
                vocab_size=np.int64(self.vocab_size),
                recipe_version=np.int64(self.recipe_version),
                meta=np.array(json.dumps(self.meta, sort_keys=True)),
            )

    @classmethod
    def load(cls, path: Path, *, vocab_size: int = TARGET_VOCAB_SIZE) -> LengthModel:
        with np.load(path, allow_pickle=False) as z:
            version, vocab = int(z["recipe_version"]), int(z["vocab_size"])
            if version != RECIPE_VERSION:
                raise ValueError(
                    f"{path}: length predictor recipe version {version}, this code computes "
                    f"version {RECIPE_VERSION}; rebuild with `python -m distill.lengths build`"
                )
            if vocab != vocab_size:
                raise ValueError(
                    f"{path}: length predictor trained for a vocabulary of {vocab} tokens, "
                    f"expected {vocab_size} (another target's tokenizer?)"
                )
            hash_size = int(z["hash_size"])
            weights = z["weights"].astype(np.float64)
            if weights.shape != (hash_size + 1,):
                raise ValueError(f"{path}: weights of shape {weights.shape}, hash size {hash_size}")
            return cls(
                weights=weights,
                intercept=float(z["intercept"]),
                hash_size=hash_size,
                vocab_size=vocab,
                recipe_version=version,
                meta=json.loads(str(z["meta"])),
            )


class LearnedLength:
    """`LengthPredictor` from a `LengthModel`; one prediction per request, remembered until
    `forget` (policies ask on every ordering)."""

    name = "learned"

    def __init__(self, model: LengthModel | None = None) -> None:
        self.model = model if model is not None else LengthModel.load(DEFAULT_PATH)
        self._cache: dict[str, float] = {}

    @classmethod
    def load(
        cls, path: Path = DEFAULT_PATH, *, vocab_size: int = TARGET_VOCAB_SIZE
    ) -> LearnedLength:
        return cls(LengthModel.load(path, vocab_size=vocab_size))

    def predict_tokens(self, prompt_ids: Sequence[int]) -> float:
        """The predicted total output length, unclipped."""
        return self.model.predict_tokens(prompt_ids)

    def predict(self, request: RequestState) -> float:
        predicted = self._cache.get(request.request_id)
        if predicted is None:
            predicted = self.predict_tokens(request.prompt)
            self._cache[request.request_id] = predicted
        return min(max(predicted, 1.0), float(request.params.max_tokens))

    def forget(self, request_id: str) -> None:
        self._cache.pop(request_id, None)

    @property
    def num_cached(self) -> int:
        return len(self._cache)
