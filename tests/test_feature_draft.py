"""A feature-level (EAGLE-style) draft on a tiny target: export and runtime agree with training,
its trees read the target's features at the right positions, greedy output equals plain
decoding, the core keeps and hands out features correctly, and training learns a rule that
only the features reveal."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from distill import train
from distill.data import TopKCache
from distill.model import DraftSpec, TrainableDraft, export_draft, load_trainable
from shared.engine.drafting import Drafter
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.runner import ForwardItem, ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.scheduling.features import FeatureLog
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from tests.test_draft_export import SPEC as EXPORT_SPEC

# the shared-embedding draft of test_draft_export, made feature-level (head: the target's)
SPEC = replace(EXPORT_SPEC, name="tiny-e", num_output_tokens=48, target_layers=(), feature_size=64)
PROMPTS = [[5, 17, 3, 44], [9, 10, 11, 12, 13, 14, 15, 16], [70], [33, 34, 35]]


@pytest.fixture(scope="module")
def feature_draft_dir(tiny_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = load_file(str(tiny_target_dir / "model.safetensors"))
    output_ids = torch.arange(0, 96, 2)  # a reduced vocabulary: even tokens only
    draft = TrainableDraft(SPEC, 96, output_ids, rope_theta=10000.0, max_positions=512)
    draft.init_from_target(target, seed=0)
    with torch.no_grad():  # make the embedding half of the fusion matter too
        draft.feature_fc.weight[:, :64].normal_(
            0.0, 0.2, generator=torch.Generator().manual_seed(1)
        )
    out = tmp_path_factory.mktemp("feature_draft")
    return export_draft(draft, out, bos_token_id=1, eos_token_id=2, metadata={})


def target_features(target_dir: Path, tokens: list[int]) -> torch.Tensor:
    """The target's features (last layer after the final norm) at every position, [n, 64]."""
    runner = ModelRunner(load_model(target_dir), block_size=4, kv_memory_bytes=1 << 20)
    runner.add_request("t")
    [out] = runner.forward_full([ForwardItem.chain("t", tokens, "none", feature_rows="all")])
    return out.features


def test_export_stores_neither_the_embedding_nor_the_head(feature_draft_dir: Path):
    with safe_open(str(feature_draft_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())  # noqa: SIM118
    assert "augury.feature_fc.weight" in names
    assert not {"model.embed_tokens.weight", "lm_head.weight"} & names


def test_runtime_forward_equals_training_forward(feature_draft_dir: Path, tiny_target_dir: Path):
    toks = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    feats = target_features(tiny_target_dir, toks)
    model = load_model(feature_draft_dir, target_path=tiny_target_dir)
    assert model.cfg.feature_size == 64
    runner = ModelRunner(model, block_size=4, kv_memory_bytes=1 << 20)
    runner.add_request("a")
    pairs, inputs = toks[1:], feats[:-1]  # token i+1 reads the feature at position i
    [a] = runner.forward_full([ForwardItem.chain("a", pairs[:9], "all", features=inputs[:9])])
    runner.commit({"a": range(9)})
    [b] = runner.forward_full(
        [ForwardItem.chain("a", pairs[9:], "all", features=inputs[9:], feature_rows="all")]
    )
    trained = load_trainable(feature_draft_dir, tiny_target_dir)
    with torch.no_grad():
        ref_logits, ref_features = trained.forward_features(torch.tensor([pairs]), inputs[None])
    torch.testing.assert_close(torch.cat([a.logits, b.logits]), ref_logits[0], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(b.features, ref_features[0, 9:], atol=2e-4, rtol=2e-4)
    assert model.output_token_ids.tolist() == list(range(0, 96, 2))


def test_runtime_refuses_a_forward_without_features(feature_draft_dir: Path, tiny_target_dir):
    runner = ModelRunner(load_model(feature_draft_dir, target_path=tiny_target_dir))
    runner.add_request("a")
    with pytest.raises(Exception, match="features"):
        runner.forward([ForwardItem.chain("a", [3, 4])])


def test_a_feature_draft_can_be_cost_profiled(feature_draft_dir: Path, tiny_target_dir: Path):
    """Profiling times forwards of made-up tokens; a feature-level draft needs made-up features
    with them (`augury generate` measures a profile when none is stored for the machine)."""
    from shared.model.profiling import measure_curve

    runner = ModelRunner(load_model(feature_draft_dir, target_path=tiny_target_dir))
    curve = measure_curve(runner, [1, 4], [0, 8], repeats=1, warmup=0)
    assert np.all(np.array(curve.ms_grid) > 0)


def make_engine(target_dir: Path, draft_dir: Path, method: DraftMethod, **cfg) -> SpecEngine:
    verifier = Verifier(ModelRunner(load_model(target_dir), block_size=4, kv_memory_bytes=2 << 20))
    model = load_model(draft_dir, target_path=target_dir)
    drafter = Drafter(ModelRunner(model, block_size=4, kv_memory_bytes=1 << 20), name="draft-e")
    return SpecEngine(verifier, drafter, method, SchedulerConfig(planner="fixed", **cfg))


@pytest.fixture(scope="module")
def plain_outputs(tiny_target_dir: Path) -> list[list[int]]:
    verifier = Verifier(ModelRunner(load_model(tiny_target_dir), block_size=4))
    engine = SpecEngine(verifier, None, None)
    return [r.output for r in engine.generate(PROMPTS, SamplingParams(max_tokens=20))]


@pytest.mark.parametrize(
    "method",
    [
        DraftMethod("chain", k=4),
        DraftMethod("static", expansion=(3, 2, 1)),
        DraftMethod("beam", depth=4, width=3),
        DraftMethod("dynamic", budget=12, max_size=8, max_depth=5, max_width=3),
    ],
    ids=["chain", "static", "beam", "dynamic"],
)
def test_greedy_with_a_feature_draft_equals_plain(
    tiny_target_dir: Path, feature_draft_dir: Path, plain_outputs, method: DraftMethod
):
    engine = make_engine(tiny_target_dir, feature_draft_dir, method)
    reqs = engine.generate(PROMPTS, SamplingParams(max_tokens=20))
    assert [r.output for r in reqs] == plain_outputs
    assert engine.stats.num_draft_tokens > 0
    assert not engine.core.features  # finished requests leave no features behind


def test_each_tree_reads_the_target_features_before_its_root(
    tiny_target_dir: Path, feature_draft_dir: Path, plain_outputs
):
    """The root's children are what the training module predicts from the target's true
    features: an off-by-one in the features the core hands out, or in how the drafter pairs
    them with tokens, changes them."""
    engine = make_engine(tiny_target_dir, feature_draft_dir, DraftMethod("chain", k=1))
    seen: list[tuple[int, int]] = []  # (committed tokens, drafted child of the root)

    def observe(batch, results) -> None:
        for r in batch.decode:
            tree = batch.trees[r.request_id]
            if tree.num_nodes > 1:
                seen.append((r.num_tokens, int(tree.tokens[1])))

    engine.observer = observe
    prompt = PROMPTS[1]
    [req] = engine.generate([prompt], SamplingParams(max_tokens=16))
    tokens = prompt + req.output
    assert req.output == plain_outputs[1][:16]
    feats = target_features(tiny_target_dir, tokens)
    trained = load_trainable(feature_draft_dir, tiny_target_dir)
    with torch.no_grad():
        logits, _ = trained.forward_features(torch.tensor([tokens[1:]]), feats[None, :-1])
    expected = trained.output_token_ids[logits[0].argmax(-1)]  # pair i predicts after token i+1
    assert len(seen) >= 8
    for n, child in seen:
        assert child == int(expected[n - 2]), f"after {n} tokens"


def test_feature_log_keeps_positions_in_order():
    log = FeatureLog(2)
    rows = np.arange(12, dtype=np.float16).reshape(6, 2)
    log.put(0, rows[:4])
    log.put(4, rows[4:5])
    assert (log.start, log.end) == (0, 5) and log.covers(1, 5) and not log.covers(1, 6)
    np.testing.assert_array_equal(log.take(1, 5), rows[1:5])
    log.put(2, rows[[5]])  # a recomputation overwrites from its first position on
    assert log.end == 3
    np.testing.assert_array_equal(log.take(0, 3), np.concatenate([rows[:2], rows[[5]]]))
    assert log.take(3, 3).shape == (0, 2)
    log.put(7, rows[:1])  # a gap starts the log over
    assert (log.start, log.end) == (7, 8)
    with pytest.raises(KeyError):
        log.take(0, 1)
    with pytest.raises(ValueError):
        log.put(8, np.zeros((1, 3), np.float16))


def running_sum_cache(num_sequences: int = 80, length: int = 24, seed: int = 0):
    """Tokens at random; the target's hidden state is a running sum of the tokens mod 8 (its
    feature: one-hot) and its next token is a fixed function of that state. Only the features
    carry the state: the tokens alone predict nothing."""
    rng = np.random.default_rng(seed)
    vocab, states = 32, 8
    successor = rng.permutation(vocab)[:states]
    tokens = rng.integers(0, vocab, (num_sequences, length))
    state = np.cumsum(tokens, axis=1) % states
    features = np.zeros((num_sequences * length, 16), dtype=np.float16)
    features[np.arange(num_sequences * length), state.reshape(-1)] = 4.0
    top_ids = np.stack([successor[state], (successor[state] + 1) % vocab], -1).astype(np.int32)
    top_logp = np.log(np.broadcast_to([0.95, 0.05], top_ids.shape)).astype(np.float16)
    cache = TopKCache(
        tokens=tokens.reshape(-1).astype(np.int32),
        offsets=np.arange(num_sequences + 1, dtype=np.int64) * length,
        kinds=["chat"] * num_sequences,
        generated=np.arange(num_sequences) % 2 == 0,
        topk_ids=top_ids.reshape(-1, 2),
        topk_logp=top_logp.reshape(-1, 2),
    )
    return cache, features, vocab


def random_draft(spec: DraftSpec, vocab: int) -> TrainableDraft:
    """A tiny draft over the whole `vocab`, its matrices drawn at 0.1 (seeded)."""
    torch.manual_seed(0)
    draft = TrainableDraft(spec, vocab, torch.arange(vocab), max_positions=64)
    gen = torch.Generator().manual_seed(0)
    for p in draft.parameters():
        if p.dim() == 2:
            p.data.normal_(0.0, 0.1, generator=gen)
    return draft


def test_training_learns_a_rule_only_the_features_reveal(monkeypatch):
    monkeypatch.setattr(train, "VALIDATION_EVERY", 4)
    monkeypatch.setattr(train, "EVAL_INTERVAL", 100)
    cache, features, vocab = running_sum_cache()
    spec = DraftSpec("t-e", 16, 1, 2, 1, 64, None, vocab, train_steps=600, lr=1e-2, feature_size=16)
    draft = random_draft(spec, vocab)
    starts = np.zeros(cache.num_sequences, np.int64)
    stats = train.train_draft(draft, spec, cache, starts, seed=0, features=features)
    assert stats["held_out_answer_top1"] > 0.9  # the mean of the first and the second level
    levels = stats["held_out_top1_by_level"]
    assert stats["feature_passes"] == train.FEATURE_PASSES
    assert len(levels) == train.HELD_OUT_LEVELS
    assert abs((levels[0] + levels[1]) / 2 - stats["held_out_answer_top1"]) < 1e-3
    # the deeper levels, reading the draft's own predicted features, follow the rule too
    assert min(levels) > 0.85
    with pytest.raises(ValueError, match="feature_passes"):
        train.train_draft(draft, spec, cache, starts, seed=0, features=features, feature_passes=0)


def test_sampled_outputs_with_a_feature_draft_follow_the_target(tmp_path_factory):
    """Chi-square over the whole joint of 3 sampled tokens (4000 seeded requests)."""
    from tests.conftest import make_tiny_checkpoint
    from tests.stats import P_VALUE_FLOOR, fit_p_value
    from tests.test_engine_sampling import NUM_REQUESTS, OUT_LEN, PROMPT, VOCAB, exact

    target_dir = make_tiny_checkpoint(
        tmp_path_factory.mktemp("sv_target_e"), seed=3, vocab_size=VOCAB, hidden_size=32
    )
    spec = DraftSpec("sv-e", 32, 1, 4, 2, 64, None, VOCAB, 0, 0.0, (), True, feature_size=32)
    draft = TrainableDraft(spec, VOCAB, torch.arange(VOCAB), rope_theta=10000.0, max_positions=512)
    draft.init_from_target(load_file(str(target_dir / "model.safetensors")), seed=0)
    draft_dir = export_draft(
        draft, tmp_path_factory.mktemp("sv_e"), bos_token_id=1, eos_token_id=2, metadata={}
    )
    engine = make_engine(
        target_dir, draft_dir, DraftMethod("chain", k=3), max_running_requests=NUM_REQUESTS
    )
    params = [
        SamplingParams(temperature=0.9, seed=s, max_tokens=OUT_LEN) for s in range(NUM_REQUESTS)
    ]
    outcomes = [tuple(r.output) for r in engine.generate([PROMPT] * NUM_REQUESTS, params)]
    assert engine.stats.num_draft_tokens > 0
    assert fit_p_value(outcomes, exact(target_dir, params[0])) > P_VALUE_FLOOR


def test_a_draft_loaded_to_train_further_keeps_the_target_tensors_frozen(
    feature_draft_dir: Path, tiny_target_dir: Path
):
    # `python -m distill build --continue-from`: the exported draft is trained on, and what it
    # reads from the target (embedding, head) must stay the target's, since it is not exported
    draft = load_trainable(feature_draft_dir, tiny_target_dir).train()
    draft.freeze_target_tensors()
    frozen = {"embed_tokens.weight", "lm_head.weight"}
    for name, p in draft.named_parameters():
        assert p.requires_grad == (name not in frozen), name
    ids = torch.tensor([[5, 17, 3, 44]])
    logits, predicted = draft.forward_features(ids, torch.randn(1, 4, 64))
    (logits.logsumexp(-1).sum() + predicted.square().sum()).backward()
    assert draft.embed_tokens.weight.grad is None and draft.lm_head.weight.grad is None
    assert draft.feature_fc.weight.grad is not None


def test_each_training_pass_reads_the_predictions_of_the_pass_before():
    """Pass p reads, at pair i, the feature pass p-1 predicted at pair i-1: what tree level p+1
    reads when drafting. The summed loss of three passes equals that chain computed by hand,
    with either context for the deeper passes."""
    cache, features, vocab = running_sum_cache(num_sequences=4)
    spec = DraftSpec("t-e", 16, 1, 2, 1, 64, None, vocab, train_steps=1, lr=1e-3, feature_size=16)
    torch.manual_seed(0)
    draft = TrainableDraft(spec, vocab, torch.arange(vocab), max_positions=64).eval()
    builder = train.BatchBuilder(cache, np.arange(vocab), np.zeros(4, np.int64), features)
    batch = builder(np.arange(4))
    ids, tgt, prob, weight, feats, next_feats = batch
    expected = torch.zeros(())
    inputs = feats
    for _ in range(3):
        logits, predicted = draft.forward_features(ids, inputs)
        ce, _ = train.distill_loss(logits, tgt, prob, weight)
        expected = (
            expected + ce + train.FEATURE_WEIGHT * train.feature_loss(predicted, next_feats, weight)
        )
        inputs = torch.cat([feats[:, :1], predicted[:, :-1]], dim=1)
    loss, _ = train.draft_losses(draft, batch, feature_passes=3, level_context="own")
    two, _ = train.draft_losses(draft, batch, feature_passes=2, level_context="own")
    torch.testing.assert_close(loss, expected)
    assert loss > two  # the third pass adds its own term
    # "chain": the same three passes, each attending as its tree level does when drafting
    chained = torch.zeros(())
    for logits, predicted in draft.forward_levels(ids, feats, 3):
        ce, _ = train.distill_loss(logits, tgt, prob, weight)
        chained = (
            chained + ce + train.FEATURE_WEIGHT * train.feature_loss(predicted, next_feats, weight)
        )
    loss, _ = train.draft_losses(draft, batch, feature_passes=3, level_context="chain")
    torch.testing.assert_close(loss, chained)
    assert not torch.allclose(loss, expected)


def test_each_level_attends_as_when_drafting():
    """`forward_levels` at level L, pair i equals drafting a chain rooted at pair i - L + 1 step
    by step: a causal forward over the committed pairs (the target's features) and the chain's
    nodes, each node reading the feature its parent predicted."""
    cache, features, vocab = running_sum_cache(num_sequences=2)
    spec = DraftSpec("t-e", 16, 2, 2, 1, 32, None, vocab, train_steps=1, lr=1e-3, feature_size=16)
    torch.manual_seed(0)
    draft = TrainableDraft(spec, vocab, torch.arange(vocab), max_positions=64).eval()
    gen = torch.Generator().manual_seed(1)
    for p in draft.parameters():
        if p.dim() == 2:
            p.data.normal_(0.0, 0.2, generator=gen)
    builder = train.BatchBuilder(cache, np.arange(vocab), np.zeros(2, np.int64), features)
    ids, _, _, _, feats, _ = builder(np.arange(2))
    feats = feats + 0.3 * torch.randn(feats.shape, generator=gen)  # not one-hot: all inputs matter
    levels = draft.forward_levels(ids, feats, 4)
    for level in range(1, 5):
        for i in (level - 1, 9, ids.shape[1] - 1):
            root = i - level + 1
            inputs = feats[:1, : root + 1].clone()
            for node in range(root + 1, i + 1):  # each node reads its parent's prediction
                _, predicted = draft.forward_features(ids[:1, :node], inputs)
                inputs = torch.cat([inputs, predicted[:, -1:]], dim=1)
            logits, predicted = draft.forward_features(ids[:1, : i + 1], inputs)
            torch.testing.assert_close(levels[level - 1][0][0, i], logits[0, -1])
            torch.testing.assert_close(levels[level - 1][1][0, i], predicted[0, -1])
    # deeper levels differ from the first: they do not read the target's features
    assert not torch.allclose(levels[0][0], levels[2][0])
