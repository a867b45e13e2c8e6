"""The learned output-length predictor: its committed file, its cache, its fit and its metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from shared.scheduling.lengths import (
    DEFAULT_PATH,
    RECIPE_VERSION,
    TARGET_VOCAB_SIZE,
    LearnedLength,
    LengthModel,
    average_ranks,
    feature_matrix,
    fit,
    mae,
    spearman,
)
from shared.scheduling.request import RequestState
from shared.values.sampling import SamplingParams


def request(request_id: str, prompt: list[int], max_tokens: int = 512) -> RequestState:
    return RequestState(request_id, prompt, SamplingParams(max_tokens=max_tokens), seed=0)


@pytest.fixture(scope="module")
def heldout() -> list:
    from transformers import AutoTokenizer

    from distill.lengths import HELDOUT_PATH, read_heldout
    from shared.model.model_set import target_dir

    return read_heldout(HELDOUT_PATH, AutoTokenizer.from_pretrained(target_dir()))


def test_module_imports_without_torch():
    code = "import sys, shared.scheduling.lengths; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_committed_file_loads_small_and_predicts_within_bounds(heldout):
    assert DEFAULT_PATH.stat().st_size < 1 << 20
    predictor = LearnedLength.load()
    assert predictor.name == "learned"
    for i, e in enumerate(heldout[::10]):
        for max_tokens in (1, 64, 4096):
            value = predictor.predict(request(f"r{i}-{max_tokens}", e.prompt, max_tokens))
            assert np.isfinite(value) and 1 <= value <= max_tokens
        assert np.isfinite(predictor.predict_tokens(e.prompt))


def test_prediction_is_computed_once_per_request_until_forgotten():
    predictor = LearnedLength.load()
    r = request("a", [1, 2, 3, 4, 5])
    first = predictor.predict(r)
    assert predictor.num_cached == 1
    # a model that predicts ten times more: the cached value still answers for "a"
    shifted = replace(predictor.model, intercept=predictor.model.intercept + np.log(10.0))
    predictor.model = shifted
    assert predictor.predict(r) == first
    predictor.forget("a")
    predictor.forget("never-seen")
    assert predictor.num_cached == 0
    assert predictor.predict(r) > first


def test_learned_beats_the_constant_baseline_on_the_committed_heldout_set(heldout):
    from distill.lengths import metrics, predictions

    model = LengthModel.load(DEFAULT_PATH)
    cap = int(model.meta["max_new_tokens"])
    predicted = predictions(model, heldout, cap)
    recorded = np.array(_recorded_predictions())
    np.testing.assert_allclose(predicted["learned"], recorded, atol=0.1)
    overall = metrics(heldout, predicted)["overall"]
    assert overall["learned"]["mae"] < overall["constant"]["mae"]
    assert overall["learned"]["spearman"] > max(overall["constant"]["spearman"], 0.3)


def _recorded_predictions() -> list[float]:
    from distill.lengths import HELDOUT_PATH

    return [json.loads(line)["predicted"] for line in HELDOUT_PATH.read_text().splitlines()]


def test_fit_recovers_planted_weights_in_both_forms():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 5))
    truth = np.array([1.0, -2.0, 0.5, 0.0, 3.0])
    y = x @ truth + 4.0 + rng.normal(scale=0.01, size=200)
    weights, intercept = fit(x, y, alpha=1e-6)
    np.testing.assert_allclose(weights, truth, atol=0.01)
    assert intercept == pytest.approx(4.0, abs=0.01)
    # fewer rows than columns takes the dual form: the same ridge solution
    wide = rng.normal(size=(8, 20))
    dual, dual_b = fit(wide, wide[:, 0], alpha=0.5)
    centered = wide - wide.mean(axis=0)
    primal = np.linalg.solve(
        centered.T @ centered + 0.5 * np.eye(20), centered.T @ (wide[:, 0] - wide[:, 0].mean())
    )
    np.testing.assert_allclose(dual, primal, atol=1e-9)


def test_fit_on_features_learns_that_token_7_means_long_answers():
    rng = np.random.default_rng(0)

    def synthetic(n: int) -> tuple[list[list[int]], np.ndarray]:
        prompts, lengths = [], []
        for i in range(n):
            ids = rng.integers(100, 150, size=int(rng.integers(20, 60))).tolist()
            if i % 2:
                ids.insert(int(rng.integers(len(ids))), 7)
            prompts.append(ids)
            lengths.append((400 if i % 2 else 40) * rng.uniform(0.8, 1.25))
        return prompts, np.array(lengths)

    train_prompts, train_lengths = synthetic(200)
    weights, intercept = fit(feature_matrix(train_prompts), np.log1p(train_lengths), alpha=0.01)
    model = LengthModel(weights=weights, intercept=intercept)
    test_prompts, test_lengths = synthetic(100)
    predicted = np.array([model.predict_tokens(p) for p in test_prompts])
    long, short = predicted[1::2], predicted[::2]
    assert long.min() > short.max()
    assert np.median(long) > 2.5 * np.median(short)
    # the ranking is as good as a perfect classifier's: the noise within a class is random
    assert spearman(predicted, test_lengths) > 0.7
    assert mae(predicted, test_lengths) < 0.6 * mae(np.full(100, test_lengths.mean()), test_lengths)


def test_loader_refuses_another_recipe_or_vocabulary(tmp_path):
    weights = np.zeros(4096 + 1)
    ok = tmp_path / "ok.npz"
    LengthModel(weights=weights, intercept=1.0).save(ok)
    assert LengthModel.load(ok).intercept == 1.0
    old = tmp_path / "old.npz"
    LengthModel(weights=weights, intercept=1.0, recipe_version=RECIPE_VERSION + 1).save(old)
    with pytest.raises(ValueError, match="recipe version"):
        LengthModel.load(old)
    other = tmp_path / "other.npz"
    LengthModel(weights=weights, intercept=1.0, vocab_size=32000).save(other)
    with pytest.raises(ValueError, match="vocabulary of 32000"):
        LearnedLength.load(other)
    with pytest.raises(ValueError, match=f"expected {TARGET_VOCAB_SIZE + 1}"):
        LengthModel.load(ok, vocab_size=TARGET_VOCAB_SIZE + 1)


def test_spearman_and_ranks_by_hand():
    assert average_ranks([3, 1, 2, 2]).tolist() == [4.0, 1.0, 2.5, 2.5]
    assert average_ranks([5, 5, 5]).tolist() == [2.0, 2.0, 2.0]
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 100, 1000, 10000]) == pytest.approx(1.0)  # ranks only
    # ranks [1, 2.5, 2.5, 4] against [1, 2, 3, 4]: 4.5 / sqrt(4.5 * 5)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(3 / np.sqrt(10))
    # [1, 3, 2] against [2, 1, 3]: d = (-1, 2, -1), 1 - 6 * 6 / (3 * 8)
    assert spearman([1, 3, 2], [2, 1, 3]) == pytest.approx(-0.5)
    assert spearman([7, 7, 7], [1, 2, 3]) == 0.0
    with pytest.raises(ValueError):
        spearman([1, 2], [1, 2, 3])
    assert mae([1, 5, 10], [2, 5, 6]) == pytest.approx(5 / 3)
