"""Bad input gets a clear error naming the limit, and the engine keeps serving the others."""

from __future__ import annotations

import pytest

from shared.errors import (
    ContextLengthError,
    InvalidRequestError,
    OutOfKVMemoryError,
    UnsupportedOptionError,
)
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams, sampling_params_from_options
from tests.test_engine_greedy import make_engine


@pytest.fixture
def engine(tiny_target_dir, tiny_draft_dir):
    return make_engine(tiny_target_dir, tiny_draft_dir, DraftMethod("chain", k=3))


def test_bad_requests_are_refused_and_others_keep_running(engine):
    good = engine.add_request([5, 6, 7], SamplingParams(max_tokens=8))
    engine.step()
    with pytest.raises(InvalidRequestError, match="empty") as e:
        engine.add_request([], SamplingParams())
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match=r"token id 96 out of range \[0, 96\)"):
        engine.add_request([1, 96], SamplingParams())
    with pytest.raises(InvalidRequestError, match="out of range"):
        engine.add_request([-1], SamplingParams())
    with pytest.raises(ContextLengthError, match="context of 512 tokens") as e:
        engine.add_request([1] * 500, SamplingParams(max_tokens=20))
    assert e.value.param == "max_tokens"
    while engine.has_unfinished():
        engine.step()
    assert len(engine.requests[good].output) == 8


def test_request_larger_than_the_kv_cache(tiny_target_dir, tiny_draft_dir):
    # 4 blocks of 4 tokens: room for 16 tokens in all
    per_block = 2 * 2 * 4 * 2 * 16 * 4
    engine = make_engine(
        tiny_target_dir, tiny_draft_dir, DraftMethod("chain", k=3), target_kv_bytes=4 * per_block
    )
    with pytest.raises(OutOfKVMemoryError, match="needs 7 KV blocks, more than the cache's 4"):
        engine.add_request([1] * 20, SamplingParams(max_tokens=4))
    ok = engine.add_request([1] * 5, SamplingParams(max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    assert len(engine.requests[ok].output) == 4


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -1}, "seed"),
    ],
)
def test_out_of_range_sampling_options(options, param):
    with pytest.raises(InvalidRequestError) as e:
        sampling_params_from_options(**options)
    assert e.value.param == param


@pytest.mark.parametrize("option", ["n", "best_of"])
def test_unsupported_options_are_refused_not_ignored(option):
    value = {"n": 2, "best_of": 2}.get(option, 0.5)
    with pytest.raises(UnsupportedOptionError, match=option) as e:
        sampling_params_from_options(**{option: value})
    assert e.value.param == option


def test_neutral_values_of_unsupported_options_are_accepted():
    params = sampling_params_from_options(n=1, presence_penalty=0.0, logprobs=None, max_tokens=3)
    assert params.max_tokens == 3


def test_unknown_option_is_refused():
    with pytest.raises(UnsupportedOptionError, match="frobnicate"):
        sampling_params_from_options(frobnicate=1)


def test_a_vanishing_temperature_is_greedy_not_nan(engine):
    # 1/T overflows below vLLM's epsilon: such a request decodes greedily instead of sampling
    # from NaN probabilities (which used to crash the engine's step)
    assert SamplingParams(temperature=1e-320).is_greedy
    tiny = engine.add_request([5, 6, 7], SamplingParams(temperature=1e-320, max_tokens=8))
    greedy = engine.add_request([5, 6, 7], SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        engine.step()
    assert engine.requests[tiny].output == engine.requests[greedy].output


@pytest.mark.parametrize(
    ("option", "value"),
    [("response_format", {"type": "json_object"}), ("tool_choice", "auto"), ("tools", [{}])],
)
def test_the_engine_refuses_what_the_gateway_refuses(option, value):
    with pytest.raises(UnsupportedOptionError, match=option):
        sampling_params_from_options(**{option: value})
