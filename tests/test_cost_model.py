"""The measured cost model: interpolation, JSON, refusing foreign profiles, the knee, and a real
(tiny) measurement through the model runner."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shared.model.profile_files import (
    architecture_fingerprint,
    find_profile,
    fingerprint_of_checkpoint,
    load_matching,
)
from shared.model.profiling import token_grid
from shared.scheduling.cost_model import (
    CostModel,
    CostProfile,
    ForwardCurve,
    ModelProfile,
    ProfileKey,
    ProfileMismatchError,
)

REPO = Path(__file__).resolve().parents[1]


def key(model: str = "t", **kw) -> ProfileKey:
    fields = dict(model=model, fingerprint="abc123", device="cpu: Test CPU", dtype="float32")
    return ProfileKey(**(fields | {"threads": 2} | kw))


def curve(scale: float = 1.0) -> ForwardCurve:
    # tokens 1, 4, 16 x contexts 0, 1000: flat up to 4 tokens, then linear
    return ForwardCurve(
        tokens=[1, 4, 16],
        contexts=[0, 1000],
        ms_grid=[[10 * scale, 20 * scale], [10 * scale, 20 * scale], [40 * scale, 60 * scale]],
    )


def profile(**target_key) -> CostProfile:
    return CostProfile(
        target=ModelProfile(key=key(**target_key), curve=curve()),
        drafts={"d": ModelProfile(key=key("d", fingerprint="ddd"), curve=curve(0.1))},
    )


def test_interpolation():
    c = curve()
    assert c.ms(1, 0) == 10 and c.ms(16, 1000) == 60
    assert c.ms(10, 0) == pytest.approx(25)  # halfway between 4 (10) and 16 (40)
    assert c.ms(16, 500) == pytest.approx(50)  # halfway in context
    assert c.ms(10, 500) == pytest.approx((25 + 40) / 2)  # bilinear
    assert c.ms(1, -5) == c.ms(1, 0) and c.ms(16, 5000) == c.ms(16, 1000)  # context clamped
    assert c.ms(28, 0) == pytest.approx(70)  # extrapolated along the last segment
    assert c.ms(0, 0) == 0.0


def test_many_sizes_at_once_equal_one_at_a_time():
    # the planners price every candidate step size in one call; it must be the same curve
    single = ForwardCurve(tokens=[1, 8], contexts=[0, 1000], ms_grid=[[5, 7], [6, 9]])
    target = ModelProfile(key=key(), curve=curve(), single=single, max_requests=8)
    cost = CostModel(CostProfile(target=target))
    sizes = np.arange(0, 40)
    for context, num_requests in ((0, None), (300, 1), (700, 3), (2000, 16)):
        many = cost.verify_ms_many(sizes, context, num_requests)
        one = [cost.verify_ms(int(n), context, num_requests) for n in sizes]
        assert many == pytest.approx(one, rel=1e-12, abs=1e-12)
    one_point = ForwardCurve(tokens=[4], contexts=[0], ms_grid=[[8]])
    assert one_point.along_tokens_many(sizes, [8.0]) == pytest.approx(
        [one_point.ms(int(n), 0) for n in sizes]
    )


def test_monotone_and_validation():
    noisy = ForwardCurve(tokens=[1, 2, 4], contexts=[0], ms_grid=[[10], [8], [12]])
    assert [row[0] for row in noisy.monotone().ms_grid] == [10, 10, 12]
    assert CostModel(_profile_with(noisy)).verify_ms(2, 0) == 10
    with pytest.raises(ValueError):
        ForwardCurve(tokens=[1, 1], contexts=[0], ms_grid=[[1], [1]])
    with pytest.raises(ValueError):
        ForwardCurve(tokens=[1, 2], contexts=[0], ms_grid=[[1]])
    with pytest.raises(ValueError):
        ForwardCurve(tokens=[1], contexts=[0], ms_grid=[[0.0]])


def _profile_with(c: ForwardCurve) -> CostProfile:
    return CostProfile(target=ModelProfile(key=key(), curve=c))


def test_json_round_trip(tmp_path: Path):
    p = profile()
    assert CostProfile.from_json(p.to_json()) == p
    path = p.save(tmp_path / "p.json")
    assert CostProfile.load(path) == p
    with pytest.raises(ValueError):  # extra fields are refused
        CostProfile.from_json(p.to_json().replace('"notes"', '"typo"'))


@pytest.mark.parametrize(
    "field,value",
    [("fingerprint", "other"), ("device", "cuda: X"), ("dtype", "bfloat16"), ("threads", 1)],
)
def test_loader_refuses_another_key(tmp_path: Path, field: str, value):
    path = profile().save(tmp_path / "p.json")
    assert load_matching(path, key()) == profile()
    with pytest.raises(ProfileMismatchError, match=field) as err:
        load_matching(path, key(**{field: value}))
    assert err.value.field == field
    assert find_profile(tmp_path, key(**{field: value})) is None
    # drafts are checked the same way, for the drafts asked for
    draft = key("d", fingerprint="ddd")
    assert load_matching(path, key(), {"d": draft}) is not None
    with pytest.raises(ProfileMismatchError) as err:
        load_matching(path, key(), {"d": draft.model_copy(update={field: value})})
    assert err.value.field == field
    with pytest.raises(ProfileMismatchError, match="no draft 'e'"):
        load_matching(path, key(), [key("e")])


def test_find_profile_picks_newest_match(tmp_path: Path):
    old = profile().model_copy(update={"created": "2024-01-01T00:00:00+00:00"})
    new = profile().model_copy(update={"created": "2025-01-01T00:00:00+00:00"})
    old.save(tmp_path / "old.json")
    new.save(tmp_path / "new.json")
    profile(dtype="float16").save(tmp_path / "other.json")
    (tmp_path / "junk.json").write_text("{}")
    assert find_profile(tmp_path, key()) == new
    assert find_profile(tmp_path / "missing", key()) is None


def test_cost_model_and_knee():
    cost = CostModel(profile())
    assert cost.draft_models == ["d"] and cost.has_draft("d") and not cost.has_draft("x")
    assert cost.verify_ms(4, 0) == 10
    assert cost.draft_forward_ms("d", 16, 1000) == pytest.approx(6)
    assert cost.draft_cost_per_token_ms("d") == pytest.approx(1.0 + 1.0 * 256 / 1000)
    # root chain of 3 tokens, then layers of 4 and 8 nodes: two forwards (3 and 4 tokens)
    assert cost.draft_tree_ms("d", 3, [4, 8], 0) == pytest.approx(2.0)
    with pytest.raises(KeyError):
        cost.draft_forward_ms("x", 1, 0)
    # flat to 4 tokens, then +2.5 ms per token at context 0: 10% over n=1 is n = 4
    assert cost.knee_tokens(0.1, context=0) == 4
    assert cost.knee_tokens(0.5, context=0) == 6  # 10 + 2.5 * 2 = 15
    assert cost.knee_tokens(10.0, context=0) == 16  # never past the measured grid


def test_fingerprint_depends_on_shapes_only(tiny_target_dir: Path, tiny_draft_dir: Path):
    from shared.model.loader import read_config
    from shared.model.profiling import fingerprint_of

    cfg = read_config(tiny_target_dir)
    assert fingerprint_of(cfg) == fingerprint_of_checkpoint(tiny_target_dir)
    assert fingerprint_of(cfg) != fingerprint_of(read_config(tiny_draft_dir))
    # the context length and the token ids do not change the cost
    assert architecture_fingerprint(cfg) == architecture_fingerprint(
        type(cfg)(**{**cfg.__dict__, "max_position_embeddings": 99, "bos_token_id": 7})
    )
    for draft in (REPO / "models" / "drafts").glob("draft-*"):
        assert fingerprint_of(read_config(draft)) == fingerprint_of_checkpoint(draft)
    # draft-e has draft-m's layer shapes but also projects the target's features at every token:
    # it must not be priced (nor kernel-planned) by draft-m's profile
    drafts = REPO / "models" / "drafts"
    assert fingerprint_of_checkpoint(drafts / "draft-e") != fingerprint_of_checkpoint(
        drafts / "draft-m"
    )
    # and the committed profiles, measured before the field existed, still match their drafts
    for name in ("draft-s", "draft-m", "draft-l"):
        for path in (REPO / "profiles").glob("SmolLM2-*.json"):
            stored = CostProfile.load(path).drafts[name].key.fingerprint
            assert stored == fingerprint_of_checkpoint(drafts / name), path.name


def test_cost_model_imports_no_torch():
    code = "import sys, shared.scheduling.cost_model; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_quick_measurement_on_a_tiny_model(tiny_runner, tiny_draft_dir: Path, tmp_path: Path):
    from shared.model import load_model
    from shared.model.profiling import measure_profile, profile_key
    from shared.model.runner import ModelRunner

    draft = ModelRunner(load_model(tiny_draft_dir), block_size=4, kv_memory_bytes=4 << 20)
    tiny_runner.add_request("keep")  # the runner's own requests are left alone
    tiny_runner.prefill({"keep": [1, 2, 3]})
    free_blocks = tiny_runner.cache.allocator.num_free
    prof = measure_profile(
        tiny_runner,
        {"tiny-draft": draft},
        target_name="tiny",
        max_tokens=32,
        quick=True,
        contexts=[0, 64],
        repeats=3,
    )
    assert tiny_runner.num_cached("keep") == 3 and tiny_runner.tree_size("keep") == 0
    assert tiny_runner.cache.allocator.num_free == free_blocks  # the profiling requests are gone
    c = prof.target.curve
    assert c.tokens == [1, 2, 4, 16, 32] and c.contexts == [0, 64]
    assert all(v > 0 for row in c.ms_grid for v in row)
    # monotone-ish: the largest forward is not cheaper than a fraction of the smallest
    for j in range(len(c.contexts)):
        assert c.ms_grid[-1][j] > 0.5 * c.ms_grid[0][j]
    assert prof.target.key == profile_key(tiny_runner, "tiny")
    assert prof.drafts["tiny-draft"].key.threads >= 1
    path = prof.save(tmp_path / "tiny.json")
    found = find_profile(
        tmp_path, profile_key(tiny_runner, "tiny"), [profile_key(draft, "tiny-draft")]
    )
    assert found == CostProfile.load(path)
    cost = CostModel(found)
    assert cost.verify_ms(8, 32) > 0 and 1 <= cost.knee_tokens() <= 32


def test_model_profile_plans_kernels_and_a_stored_profile_brings_its_plan(
    tiny_target_dir: Path, tmp_path: Path
):
    """What is measured is what runs: a measured profile carries the kernel plan it was measured
    with, and loading that profile applies the same plan to a freshly loaded model."""
    from shared.model import load_model
    from shared.model.cost_profiles import model_profile
    from shared.model.runner import ModelRunner

    def runner() -> ModelRunner:
        return ModelRunner(load_model(tiny_target_dir), block_size=4, kv_memory_bytes=4 << 20)

    first = runner()
    cache = tmp_path / "cache"
    measured = model_profile(first, "tiny", directory=tmp_path, max_tokens=8, cache_dir=cache)
    assert measured is not None and measured.kernels is not None
    assert first.model.linear_plan is not None
    assert [p.name for p in cache.iterdir()] == [f"{measured.key.file_stem}.json"]  # kept

    second = runner()  # found in the cache: no second measurement
    loaded = model_profile(second, "tiny", directory=tmp_path, measure=False, cache_dir=cache)
    assert loaded == measured
    assert second.model.linear_plan is not None
    assert second.model.linear_plan.to_dict() == measured.kernels

    plain = runner()  # nothing stored, nothing measured: no profile, the model left as it is
    nowhere = tmp_path / "none"
    assert model_profile(plain, "t", directory=nowhere, measure=False, cache_dir=nowhere) is None
    assert plain.model.linear_plan is None


def test_every_grid_measures_one_draft_tokens_step() -> None:
    """1 and 2 always: a lone draft token's price, which int8's one-row kernel makes steep."""
    assert token_grid(64, quick=True) == [1, 2, 4, 16, 64]
    assert token_grid(64, quick=False)[:4] == [1, 2, 4, 8]
    assert token_grid(2, quick=True) == [1, 2]
    assert token_grid(1, quick=True) == [1]
