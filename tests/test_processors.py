"""Logits processors on every tree node, logprobs from the verification forward, and seeds that
reproduce (Gumbel-coupled sampling), through the engine.

The processors are checked against a reference written here row by row (vLLM's semantics), the
engine's greedy outputs against transformers' decoding with that reference, and sampled outputs
against the exact processed joint distribution (chi-square, tests/stats.py).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from shared.engine.drafting import Drafter
from shared.engine.processors import process_logits
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.errors import InvalidRequestError
from shared.model import load_model
from shared.model.runner import ModelRunner
from shared.scheduling import executor
from shared.scheduling.config import SchedulerConfig
from shared.values.logprobs import TokenLogprobs
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams, TokenHistory, processed_probs, token_history
from shared.values.steps import VerifiedRequest, VerifyRequest
from shared.wire.codec import PayloadReader
from shared.wire.requests import Tokens
from shared.wire.steps import (
    read_verified_request,
    read_verify_request,
    verified_request_payload,
    verify_request_payload,
)
from tests.small_vocab import exact_joint, small_vocab_pair
from tests.stats import P_VALUE_FLOOR, fit_p_value

PROMPTS = [[5, 17, 3, 44], [9, 10, 11, 12, 13, 14, 15], [70]]
METHODS = {
    "chain": DraftMethod("chain", k=4),
    "static": DraftMethod("static", expansion=(3, 2, 1)),
    "beam": DraftMethod("beam", depth=4, width=3),
    "dynamic": DraftMethod("dynamic", budget=12, max_size=8, max_depth=5, max_width=3),
}
PROCESSORS = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 0.8},
    "repetition": {"repetition_penalty": 1.8},
    "logit_bias": {"logit_bias": {"7": 5.0, "11": -100.0, "23": 2.5}},
    "negative": {"presence_penalty": -0.7, "frequency_penalty": -0.4},
    "all": {
        "presence_penalty": 0.6,
        "frequency_penalty": 0.3,
        "repetition_penalty": 1.3,
        "logit_bias": {"3": 1.0},
        "min_tokens": 12,
    },
}
MAX_TOKENS = 20


# ---- the reference ---------------------------------------------------------------------------


def reference_logits(
    logits: torch.Tensor,  # [V] the model's next-token logits
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    end_ids: Sequence[int] = (),
) -> torch.Tensor:
    """vLLM's processors, one token at a time (float64)."""
    x = logits.double().clone()
    for token, bias in params.logit_bias:
        x[token] += bias
    if params.repetition_penalty != 1.0:
        for token in set(prompt) | set(output):
            r = params.repetition_penalty
            x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token, count in Counter(output).items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    if len(output) < params.min_tokens:
        for token in end_ids:
            x[token] = float("-inf")
    return x


def reference_greedy(
    model_dir, prompt: list[int], params: SamplingParams, eos: Sequence[int] = ()
) -> list[int]:
    """transformers' forward, the reference processors, argmax; stops like the engine."""
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ends = {*params.stop_token_ids, *eos}
    output: list[int] = []
    while len(output) < params.max_tokens:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + output])).logits[0, -1]
        token = int(reference_logits(logits, params, prompt, output, sorted(ends)).argmax())
        if token in ends:
            break
        output.append(token)
    return output


def runner(path, kv_bytes: int = 2 << 20) -> ModelRunner:
    return ModelRunner(load_model(path), block_size=4, kv_memory_bytes=kv_bytes)


def engine_for(
    target_dir, draft_dir=None, method=None, eos: Sequence[int] = (), **config
) -> SpecEngine:
    drafter = Drafter(runner(draft_dir, 1 << 20)) if draft_dir is not None else None
    return SpecEngine(
        Verifier(runner(target_dir)),
        drafter,
        method if drafter is not None else None,
        SchedulerConfig(**config),
        eos_token_ids=eos,
    )


# ---- the processors themselves -----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_processors_match_the_reference_per_node(name):
    """Each row gets its own path's counts; a reduced draft head sees the same values."""
    params = SamplingParams(temperature=0.7, max_tokens=30, **PROCESSORS[name])
    gen = torch.Generator().manual_seed(1)
    vocab = 40
    prompt, output = [3, 4, 4, 9], [7, 3, 3, 12, 7]
    paths = [[], [5], [5, 7], [3], [3, 3, 30]]
    logits = torch.randn(len(paths), vocab, generator=gen) * 3
    history = token_history(params, prompt, output, eos_token_ids=[2, 31])
    got = process_logits(logits, params, history, paths)
    for row, path in enumerate(paths):
        want = reference_logits(logits[row], params, prompt, output + path, [2, 31])
        torch.testing.assert_close(got[row].double(), want, rtol=1e-5, atol=1e-5)
    # a head holding every other token: its columns carry the same processed values
    ids = torch.arange(0, vocab, 2)
    column_of = torch.full((vocab,), -1, dtype=torch.long)
    column_of[ids] = torch.arange(len(ids))
    sub = process_logits(logits[:, ids], params, history, paths, column_of)
    torch.testing.assert_close(sub, got[:, ids])


@pytest.mark.parametrize("name", ["presence", "repetition", "all"])
def test_the_first_step_penalizes_only_what_the_prompt_holds(name):
    """No output and no draft path yet: the counts are empty, only the prompt is seen."""
    params = SamplingParams(temperature=0.7, max_tokens=30, **PROCESSORS[name])
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(2)) * 3
    prompt = [3, 4, 4, 9]
    history = token_history(params, prompt, [], eos_token_ids=[2, 31])
    got = process_logits(logits, params, history, [[]])
    want = reference_logits(logits[0], params, prompt, [], [2, 31])
    torch.testing.assert_close(got[0].double(), want, rtol=1e-5, atol=1e-5)
    untouched = [t for t in range(40) if t not in {2, 3, 4, 9, 31}]
    torch.testing.assert_close(got[0, untouched], logits[0, untouched])


def test_min_p_drops_what_is_less_likely_than_min_p_times_the_likeliest():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    probs = processed_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))[0]
    assert probs[3] == 0 and probs[2] > 0  # 0.08 < 0.2 * 0.5 <= 0.12
    torch.testing.assert_close(probs[:3], torch.tensor([0.5, 0.3, 0.12]).double() / 0.92)


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 30}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_out_of_range_processors_name_the_field(options, param):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(max_tokens=16, **options)
    assert error.value.param == param


def test_the_engine_refuses_a_bias_outside_the_vocabulary(tiny_target_dir):
    engine = engine_for(tiny_target_dir)
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request([1, 2], SamplingParams(logit_bias={96: 1.0}))
    assert error.value.param == "logit_bias"


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0


def test_new_fields_survive_the_wire():
    params = SamplingParams(
        temperature=0.5,
        seed=3,
        max_tokens=9,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.5,
        logit_bias={"4": -2.0, 9: 1.5},
        min_p=0.1,
        min_tokens=2,
        logprobs=0,
    )
    history = TokenHistory(output_len=3, output=(4, 4, 5), prompt=(1, 2), end_ids=(0,))
    entry = VerifyRequest("r", 1, params, 3, 6, chunk=(1, 2), history=history)
    again = read_verify_request(PayloadReader(verify_request_payload(entry), "entry"))
    assert again.sampling == params and again.history == history
    lps = TokenLogprobs((-0.5, -1.0), ((4, 2), (5, 1)), ((-0.5, -1.5), (-1.0, -2.0)))
    done = VerifiedRequest("r", 1, accepted=(4,), bonus=5, logprobs=lps)
    assert read_verified_request(PayloadReader(verified_request_payload(done), "v")) == done
    tokens = Tokens("r", 1, 0, (4, 5), logprobs=lps)
    assert Tokens.from_payload(PayloadReader(tokens.payload(), "t")).logprobs == lps
    bare = TokenLogprobs((-0.5,), ((),), ((),))  # logprobs: 0
    tokens = Tokens("r", 1, 0, (4,), logprobs=bare)
    assert Tokens.from_payload(PayloadReader(tokens.payload(), "t")).logprobs == bare
    plain = VerifyRequest("r", 1, SamplingParams(), 3, 6, chunk=(1,))
    assert "history" not in verify_request_payload(plain)
    assert set(verify_request_payload(plain)["sampling"]) == {
        "temperature", "top_p", "top_k", "seed", "max_tokens", "stop_token_ids", "ignore_eos"
    }  # fmt: skip


# ---- greedy: speculation equals plain decoding with the same processors ------------------------


@pytest.fixture(scope="module")
def end_token(tiny_target_dir) -> int:
    """A token plain greedy decoding of PROMPTS[0] emits early: made EOS, min_tokens matters."""
    return reference_greedy(tiny_target_dir, PROMPTS[0], SamplingParams(max_tokens=3))[2]


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_greedy_with_processors_equals_plain_decoding(
    tiny_target_dir, tiny_draft_dir, end_token, name
):
    params = SamplingParams(max_tokens=MAX_TOKENS, **PROCESSORS[name])
    eos = (end_token,)
    plain = engine_for(tiny_target_dir, eos=eos).generate(PROMPTS, params)
    want = [reference_greedy(tiny_target_dir, p, params, eos) for p in PROMPTS]
    assert [r.output for r in plain] == want
    if params.min_tokens:
        assert all(len(out) >= params.min_tokens for out in want)
    for method in METHODS.values():
        engine = engine_for(tiny_target_dir, tiny_draft_dir, method, eos=eos, planner="fixed")
        assert [r.output for r in engine.generate(PROMPTS, params)] == want
        assert engine.stats.num_draft_tokens > 0
    # the target drafting for itself, processors applied on both sides with each node's path:
    # nearly every draft token is accepted (a draft ignoring its path's counts would not be)
    for method, floor in ((METHODS["chain"], 0.9), (METHODS["dynamic"], 0.6)):
        engine = engine_for(tiny_target_dir, tiny_target_dir, method, eos=eos, planner="fixed")
        assert [r.output for r in engine.generate(PROMPTS, params)] == want
        stats = engine.stats  # a tree's depth may lie off the greedy path: a lower floor
        assert stats.num_accepted >= floor * stats.num_draft_layers, stats


def test_min_tokens_changes_what_eos_would_end(tiny_target_dir, end_token):
    eos = (end_token,)
    short = engine_for(tiny_target_dir, eos=eos).generate(PROMPTS[:1], SamplingParams(max_tokens=8))
    assert len(short[0].output) == 2 and short[0].finish_reason == "stop"
    long = engine_for(tiny_target_dir, eos=eos).generate(
        PROMPTS[:1], SamplingParams(max_tokens=8, min_tokens=6)
    )
    assert len(long[0].output) >= 6 and end_token not in long[0].output[:6]


# ---- sampling follows the processed target distribution ----------------------------------------


PROMPT = [1, 4, 2]
OUT_LEN = 3
NUM_REQUESTS = 4000
SAMPLED = {
    "chain": DraftMethod("chain", k=3),
    "static": DraftMethod("static", expansion=(2, 2)),
    "dynamic": DraftMethod("dynamic", budget=8, max_size=8, max_depth=3, max_width=2),
}
SAMPLED_PARAMS = {
    "temperature": 0.9,
    "presence_penalty": 0.7,
    "frequency_penalty": 0.4,
    "repetition_penalty": 1.4,
    "logit_bias": {"2": 1.2, "5": -0.8},
    "min_p": 0.05,
    "max_tokens": OUT_LEN,
}


@pytest.fixture(scope="module")
def small_vocab_dirs(tmp_path_factory):
    return small_vocab_pair(tmp_path_factory, "pv")


def exact(target_dir, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(output) under plain sampling with the reference processors."""
    return exact_joint(
        target_dir,
        PROMPT,
        OUT_LEN,
        params,
        lambda row, out: reference_logits(row, params, PROMPT, out),
    )


def deterministic_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unseeded requests draw their engine seed from `secrets`: make those draws fixed."""
    counter = itertools.count(10_000)
    monkeypatch.setattr(executor.secrets, "randbits", lambda bits: next(counter))


# a chain and two trees; multi-step sampling for the chain and the dynamic tree, the seeded
# (coupled) path for the static tree (test_engine_sampling covers coupling on every method)
@pytest.mark.parametrize(
    ("name", "coupled"),
    [("chain", False), ("dynamic", False), ("static", True)],
    ids=["chain-multi-step", "dynamic-multi-step", "static-coupled"],
)
def test_sampling_with_processors_follows_the_processed_target(
    small_vocab_dirs, monkeypatch, name, coupled
):
    target_dir, draft_dir = small_vocab_dirs
    deterministic_seeds(monkeypatch)
    params = [
        SamplingParams(seed=s if coupled else None, **SAMPLED_PARAMS) for s in range(NUM_REQUESTS)
    ]
    engine = engine_for(target_dir, draft_dir, SAMPLED[name], max_running_requests=NUM_REQUESTS)
    outcomes = [tuple(r.output) for r in engine.generate([PROMPT] * NUM_REQUESTS, params)]
    assert engine.stats.num_accepted > 0.2 * engine.stats.num_draft_tokens
    assert fit_p_value(outcomes, exact(target_dir, params[0])) > P_VALUE_FLOOR
    # the control: the same samples against the distribution without the processors
    bare = SamplingParams(temperature=SAMPLED_PARAMS["temperature"], max_tokens=OUT_LEN)
    assert fit_p_value(outcomes, exact(target_dir, bare)) < P_VALUE_FLOOR


# ---- logprobs --------------------------------------------------------------------------------


def hf_logprobs(model_dir, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V] transformers' log_softmax of the target's logits before each token."""
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) + len(output) - 1]


@pytest.mark.parametrize("num_top", [0, 5])
def test_logprobs_equal_transformers_with_and_without_speculation(
    tiny_target_dir, tiny_draft_dir, num_top
):
    params = SamplingParams(max_tokens=MAX_TOKENS, logprobs=num_top, presence_penalty=0.5)
    plain = engine_for(tiny_target_dir).generate(PROMPTS, params)
    spec = engine_for(tiny_target_dir, tiny_target_dir, METHODS["dynamic"], planner="fixed")
    drafted = spec.generate(PROMPTS, params)
    assert spec.stats.num_accepted >= 0.6 * spec.stats.num_draft_layers
    other = engine_for(tiny_target_dir, tiny_draft_dir, METHODS["static"], planner="fixed")
    mixed = other.generate(PROMPTS, params)
    for prompt, a, b, c in zip(PROMPTS, plain, drafted, mixed, strict=True):
        assert a.output == b.output == c.output
        want = hf_logprobs(tiny_target_dir, prompt, a.output)  # raw: before the penalty
        for got in (a.logprobs, b.logprobs, c.logprobs):
            assert got is not None and len(got) == len(a.output)
            chosen = want.gather(1, torch.tensor(a.output)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(got.logprobs), chosen, rtol=0, atol=1e-4)
            top = want.topk(num_top, -1) if num_top else None
            for i in range(len(got)):
                assert len(got.top_ids[i]) == num_top
                if top is not None:
                    assert list(got.top_ids[i]) == top.indices[i].tolist()
                    torch.testing.assert_close(
                        torch.tensor(got.top_logprobs[i]), top.values[i], rtol=0, atol=1e-4
                    )


def test_sampled_logprobs_are_the_emitted_tokens(tiny_target_dir, tiny_draft_dir):
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=12, logprobs=2)
    engine = engine_for(tiny_target_dir, tiny_draft_dir, METHODS["chain"], planner="fixed")
    [request] = engine.generate(PROMPTS[:1], params)
    want = hf_logprobs(tiny_target_dir, PROMPTS[0], request.output)
    chosen = want.gather(1, torch.tensor(request.output)[:, None])[:, 0]
    assert request.logprobs is not None
    torch.testing.assert_close(torch.tensor(request.logprobs.logprobs), chosen, rtol=0, atol=1e-4)


# ---- seeds that reproduce --------------------------------------------------------------------


SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=24, presence_penalty=0.3)


def test_a_seed_reproduces_alone_under_load_and_without_speculation(
    tiny_target_dir, tiny_draft_dir, monkeypatch
):
    deterministic_seeds(monkeypatch)
    alone = engine_for(tiny_target_dir).generate([PROMPTS[0]], SEEDED)[0].output
    outputs = {"plain": alone}
    for name, method in METHODS.items():
        for planner in ("fixed", "goodput"):
            engine = engine_for(tiny_target_dir, tiny_draft_dir, method, planner=planner)
            outputs[f"{name}-{planner}"] = engine.generate([PROMPTS[0]], SEEDED)[0].output
            # under load: other requests, sampled and greedy, seeded and not, in the batch
            crowd = [SamplingParams(temperature=0.9, max_tokens=17)] * 3 + [
                SamplingParams(max_tokens=5),
                SamplingParams(temperature=0.5, seed=1, max_tokens=30),
            ]
            prompts = [PROMPTS[1], [8, 8], PROMPTS[2], [3], PROMPTS[0], [1, 2]]
            mixed = engine.generate(prompts, [*crowd[:4], SEEDED, crowd[4]])
            outputs[f"{name}-{planner}-crowd"] = mixed[4].output
        engine = engine_for(tiny_target_dir, tiny_draft_dir, method)
        rid = engine.add_request(PROMPTS[0], SEEDED, speculate=False)
        while engine.has_unfinished():
            engine.step()
        outputs[f"{name}-off"] = engine.requests[rid].output
    assert all(out == alone for out in outputs.values()), outputs
    assert len(alone) == SEEDED.max_tokens
    other = engine_for(tiny_target_dir).generate([PROMPTS[0]], SamplingParams(
        temperature=1.0, top_p=0.95, seed=8, max_tokens=24, presence_penalty=0.3
    ))  # fmt: skip
    assert other[0].output != alone


def test_coupled_drafts_are_accepted_when_the_draft_is_the_target(tiny_target_dir):
    """The draft proposes the argmax of its own perturbed scores with the request's noise: a
    draft equal to the target is then always right (multi-step sampling is not)."""
    engine = engine_for(tiny_target_dir, tiny_target_dir, METHODS["chain"], planner="fixed")
    engine.generate(PROMPTS, SEEDED)
    stats = engine.stats
    assert stats.num_accepted >= 0.95 * stats.num_draft_tokens


def test_gumbel_noise_depends_on_seed_and_position_only():
    from shared.values.sampling import gumbel_noise

    a = gumbel_noise(7, 3, 50)
    assert np.array_equal(a, gumbel_noise(7, 3, 50))
    assert np.array_equal(a[:20], gumbel_noise(7, 3, 20))
    assert not np.array_equal(a, gumbel_noise(7, 4, 50))
    assert not np.array_equal(a, gumbel_noise(8, 3, 50))


@pytest.mark.parametrize(
    "options", [{}, {"top_p": 0.7}, {"min_p": 0.1}, {"top_k": 5}, {"top_p": 0.9, "min_p": 0.05}]
)
def test_coupled_scores_pick_the_gumbel_max_of_the_processed_distribution(options):
    """The scores (logits over temperature plus noise, -inf where a filter drops a token) rank
    every row as the log of the processed distribution plus the same noise does, and leave the
    logits they were given as they were."""
    from shared.engine.processors import coupled_scores
    from shared.values.sampling import gumbel_noise

    params = SamplingParams(temperature=0.7, seed=11, max_tokens=8, **options)
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    before = logits.clone()
    positions = [4, 5, 5, 6, 6, 6]
    scores = coupled_scores(logits, params, positions)
    assert torch.equal(logits, before)
    noise = torch.from_numpy(np.stack([gumbel_noise(11, p, 64) for p in positions]))
    definition = torch.log(processed_probs(logits, params)) + noise
    assert torch.equal(scores.argmax(-1), definition.argmax(-1))
    assert torch.equal(torch.isinf(scores), torch.isinf(definition))
    finite = ~torch.isinf(scores)
    torch.testing.assert_close(
        torch.log_softmax(scores, -1)[finite], torch.log_softmax(definition, -1)[finite]
    )


# ---- augury generate -------------------------------------------------------------------------


@pytest.mark.smollm2
def test_cli_takes_the_processor_logprobs_and_seed_options(capsys):
    from shared.cli import main

    argv = ["generate", "Name a color.", "--max-tokens", "10", "--threads", "1"]
    argv += ["--temperature", "0.8", "--seed", "3", "--presence-penalty", "0.5"]
    argv += ["--logit-bias", "13=-100", "--min-p", "0.05", "--logprobs", "2"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert "token logprobs" in first
    assert main([*argv, "--no-spec"]) == 0  # a seed reproduces without speculation
    second = capsys.readouterr().out
    assert first.split("\n\n")[0] == second.split("\n\n")[0]  # the same generated text
    assert main(["generate", "Hi", "--logit-bias", "13=999", "--no-spec"]) == 2
    assert "logit_bias" in capsys.readouterr().err
