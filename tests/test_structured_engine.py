"""Structured output under speculation, on tiny models with a one-character-a-token vocabulary:
sampling follows the target's grammar-masked distribution exactly (chi-square, chains and
trees), greedy equals plain constrained decoding, forced tokens never reach the draft model, and
a grammar's dead end ends the request.

The grammar's language here is finite and written out, so the reference masks are computed
from the language itself, not by llguidance.
"""

from __future__ import annotations

import functools
import itertools
import json

import llguidance
import pytest
import torch
from transformers import LlamaForCausalLM

from shared.engine.drafting import Drafter
from shared.engine.model_free import ModelFreeDrafter, after_chain
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.errors import InvalidRequestError
from shared.grammar.matcher import GrammarBook
from shared.model import load_model
from shared.model.runner import ModelRunner
from shared.scheduling import executor
from shared.scheduling.config import SchedulerConfig
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams, StructuredOutput, processed_probs
from shared.values.tree import TokenTree
from tests.conftest import make_tiny_checkpoint
from tests.stats import P_VALUE_FLOOR, fit_p_value

EOS = 0
CHARS = "abcde"  # token i + 1 is CHARS[i]; token 0 is the end of sequence
VOCAB = 1 + len(CHARS)
LANGUAGE = ("ad", "ae", "bd", "be", "cad", "cae", "cbd", "cbe")  # (a|b|ca|cb)(d|e)
REGEX = StructuredOutput("regex", "(a|b|ca|cb)(d|e)")
PROMPT = [1, 4, 2]
OUT_LEN = 3  # every output: a word of the language (EOS, not in the output, pads it here)
NUM_REQUESTS = 2000
TEMPERATURE = 0.9
SAMPLED = {
    "chain": DraftMethod("chain", k=3),
    "tree": DraftMethod("static", expansion=(2, 2)),
}


class CharTokenizer:
    """One token per character (llguidance's `TokenizerWrapper` protocol)."""

    eos_token_id = EOS
    bos_token_id = None
    special_token_ids = [EOS]
    tokens = [b"<eos>", *(c.encode() for c in CHARS)]

    def __call__(self, text: bytes | str) -> list[int]:
        chars = text.decode(errors="replace") if isinstance(text, bytes) else text
        return [CHARS.index(c) + 1 for c in chars if c in CHARS]


def char_grammar() -> GrammarBook:
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(CharTokenizer()), slices=[])
    return GrammarBook(tokenizer, [EOS])


def text_of(tokens: list[int]) -> str:
    return "".join(CHARS[t - 1] for t in tokens if t != EOS)


def allowed_after(prefix: str) -> set[int]:
    """The reference mask: the tokens that keep `prefix` inside the language."""
    longer = [w for w in LANGUAGE if w.startswith(prefix) and w != prefix]
    nxt = {CHARS.index(w[len(prefix)]) + 1 for w in longer}
    return nxt | ({EOS} if prefix in LANGUAGE else set())


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target = make_tiny_checkpoint(
        tmp_path_factory.mktemp("st_target"), seed=3, vocab_size=VOCAB, hidden_size=32
    )
    draft = make_tiny_checkpoint(
        tmp_path_factory.mktemp("st_draft"), seed=4, vocab_size=VOCAB, hidden_size=16, num_layers=1
    )
    return target, draft


def engine_for(target_dir, draft_dir=None, method=None, **config) -> SpecEngine:
    runner = ModelRunner(load_model(target_dir), block_size=4, kv_memory_bytes=8 << 20)
    drafter = None
    if draft_dir is not None:
        draft_runner = ModelRunner(load_model(draft_dir), block_size=4, kv_memory_bytes=8 << 20)
        drafter = Drafter(draft_runner)
    return SpecEngine(
        Verifier(runner),
        drafter,
        method if drafter is not None else None,
        SchedulerConfig(**config),
        eos_token_ids=[EOS],
        grammar=char_grammar(),
    )


@functools.cache
def hf_model(target_dir: str) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@functools.cache
def target_logits(target_dir: str, output: tuple[int, ...]) -> torch.Tensor:
    """[len(output) + 1, VOCAB]: transformers' logits before each output token and after."""
    hf = hf_model(target_dir)
    with torch.no_grad():
        return hf(torch.tensor([PROMPT + list(output)])).logits[0, len(PROMPT) - 1 :]


def exact_joint(target_dir, masked: bool = True) -> dict[tuple[int, ...], float]:
    """P(output) of plain sampling from the target masked with the reference masks; or, not
    `masked`, of sampling unconstrained and keeping the outputs in the language (the control:
    the same support, another distribution)."""
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=OUT_LEN)
    joint = {}
    for seq in itertools.product(range(VOCAB), repeat=OUT_LEN):
        if EOS in seq and any(t != EOS for t in seq[seq.index(EOS) :]):
            continue  # nothing follows the end of the output
        logits = target_logits(str(target_dir), seq[:-1])
        p = 1.0
        for i in range(OUT_LEN):
            if EOS in seq[:i]:
                break
            allowed = sorted(allowed_after(text_of(list(seq[:i]))))
            if seq[i] not in allowed:
                p = 0.0
                break
            row = logits[i].clone()
            if masked:
                row = torch.full((VOCAB,), float("-inf"))
                row[allowed] = logits[i, allowed]
            p *= float(processed_probs(row[None], params)[0, seq[i]])
        if p > 0:
            joint[seq] = p
    total = sum(joint.values())
    return {k: v / total for k, v in joint.items()}


def padded(output: list[int]) -> tuple[int, ...]:
    return tuple(output) + (EOS,) * (OUT_LEN - len(output))


@pytest.mark.parametrize("name", sorted(SAMPLED))
def test_constrained_sampling_follows_the_masked_target(dirs, monkeypatch, name):
    target_dir, draft_dir = dirs
    counter = itertools.count(20_000)
    monkeypatch.setattr(executor.secrets, "randbits", lambda bits: next(counter))
    engine = engine_for(target_dir, draft_dir, SAMPLED[name], max_running_requests=NUM_REQUESTS)
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=OUT_LEN, structured=REGEX)
    results = engine.generate([PROMPT] * NUM_REQUESTS, params)
    assert all(text_of(r.output) in LANGUAGE for r in results)
    outcomes = [padded(r.output) for r in results]
    assert engine.stats.num_accepted > 0.3 * engine.stats.num_draft_tokens
    joint = exact_joint(target_dir)
    assert fit_p_value(outcomes, joint) > P_VALUE_FLOOR
    # the control: sampling without the mask and keeping outputs of the language differs
    assert fit_p_value(outcomes, exact_joint(target_dir, masked=False)) < P_VALUE_FLOOR


def test_greedy_constrained_speculation_equals_plain_constrained_decoding(dirs):
    target_dir, draft_dir = dirs
    structured = StructuredOutput("regex", "(ab|cd)+e(a|b)*")
    params = SamplingParams(max_tokens=24, structured=structured)
    prompts = [[5, 3, 1], [2, 2, 4, 1, 3], [1]]
    plain = engine_for(target_dir).generate(prompts, params)
    for method in (DraftMethod("chain", k=4), DraftMethod("dynamic", budget=10, max_depth=4)):
        engine = engine_for(target_dir, draft_dir, method)
        spec = engine.generate(prompts, params)
        assert [r.output for r in spec] == [r.output for r in plain]
        assert engine.stats.num_accepted >= 0.3 * engine.stats.num_draft_tokens
    assert all(r.finish_reason in ("stop", "length") for r in plain)


def test_forced_tokens_never_reach_the_draft_model(dirs, monkeypatch):
    """The draft proposes only where the grammar leaves a choice; forced runs ("cccc") are
    drafted without it, a run a step, and accepted with certainty."""
    target_dir, draft_dir = dirs
    structured = StructuredOutput("regex", "[ab]{3}cccc[de]{2}ccc[ab]{2}")
    proposed_at: list[int] = []  # output lengths at which the draft proposed a token
    grown = Drafter._take_logits

    def take_logits(self, t, logits):
        proposed_at.extend(len(t.req.history.output) + len(t.path(n)) for n in t.frontier)
        return grown(self, t, logits)

    monkeypatch.setattr(Drafter, "_take_logits", take_logits)
    engine = engine_for(target_dir, draft_dir, DraftMethod("chain", k=3))
    [result] = engine.generate([PROMPT], SamplingParams(max_tokens=20, structured=structured))
    text = text_of(result.output)
    assert result.finish_reason == "stop" and len(text) == 14 and text[3:7] == "cccc"
    forced = {3, 4, 5, 6, 9, 10, 11, 14}  # output lengths where the next token is forced
    assert proposed_at and not forced & set(proposed_at)
    assert engine.stats.num_target_forwards <= 10  # plain decoding: 15 (14 tokens and EOS)


def test_a_wholly_forced_output_needs_no_draft_model(dirs, monkeypatch):
    target_dir, draft_dir = dirs
    engine = engine_for(target_dir, draft_dir, DraftMethod("chain", k=3))
    calls = []
    monkeypatch.setattr(Drafter, "_take_logits", lambda self, t, logits: calls.append(t))
    structured = StructuredOutput("choice", json.dumps(["bebebeb"]))
    [result] = engine.generate([PROMPT], SamplingParams(max_tokens=20, structured=structured))
    assert text_of(result.output) == "bebebeb" and result.finish_reason == "stop"
    assert calls == []
    # after the prompt's forward (which picked "b"): the rest in runs of the chain's 3 nodes
    assert engine.stats.num_target_forwards == 2
    assert engine.stats.num_accepted == engine.stats.num_draft_tokens == 6


def test_a_dead_end_ends_the_request_with_its_reason(dirs):
    target_dir, draft_dir = dirs
    engine = engine_for(target_dir, draft_dir, DraftMethod("chain", k=3))
    # "x" is no token of this vocabulary: after "a" nothing may follow
    structured = StructuredOutput("regex", "ax")
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=10, structured=structured))
    for _ in range(10):
        if not engine.has_unfinished():
            break
        engine.step()
    request = engine.requests[rid]
    assert text_of(request.output) == "a"
    assert request.finish_reason == "abort" and "grammar_dead_end" in (request.error or "")


def test_a_bad_grammar_is_refused_at_admission(dirs):
    engine = engine_for(dirs[0])
    with pytest.raises(InvalidRequestError, match="regex"):
        engine.add_request(PROMPT, SamplingParams(structured=StructuredOutput("regex", "(a")))
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        SpecEngine(Verifier(engine.verifier.runner)).add_request(
            PROMPT, SamplingParams(structured=REGEX)
        )


def model_free_engine(target_dir, method: DraftMethod) -> SpecEngine:
    runner = ModelRunner(load_model(target_dir), block_size=4, kv_memory_bytes=8 << 20)
    return SpecEngine(
        Verifier(runner),
        ModelFreeDrafter("ngram"),
        method,
        SchedulerConfig(),
        eos_token_ids=[EOS],
        grammar=char_grammar(),
    )


def test_a_model_free_draft_proposes_the_forced_runs(dirs):
    """Both "cccc" and "ccc" are forced, each drafted whole in one step and accepted; the
    lookup alone (no grammar given to the drafter) accepts 4 tokens in 10 forwards here."""
    target_dir, _ = dirs
    structured = StructuredOutput("regex", "[ab]{3}cccc[de]{2}ccc[ab]{2}")
    params = SamplingParams(max_tokens=20, structured=structured)
    [plain] = engine_for(target_dir).generate([PROMPT], params)
    engine = model_free_engine(target_dir, DraftMethod("chain", k=4))
    [result] = engine.generate([PROMPT], params)
    assert result.output == plain.output and len(text_of(result.output)) == 14
    assert engine.stats.num_accepted >= 7  # "cccc" and "ccc", each drafted whole
    assert engine.stats.num_target_forwards <= 15 - 7


@pytest.mark.parametrize("method", [DraftMethod("chain", k=3), DraftMethod("dynamic", budget=8)])
def test_greedy_constrained_model_free_speculation_equals_plain(dirs, method):
    target_dir, _ = dirs
    params = SamplingParams(max_tokens=24, structured=StructuredOutput("regex", "(ab|cd)+e(a|b)*"))
    prompts = [[5, 3, 1], [2, 2, 4, 1, 3], [1]]
    plain = engine_for(target_dir).generate(prompts, params)
    spec = model_free_engine(target_dir, method).generate(prompts, params)
    assert [r.output for r in spec] == [r.output for r in plain]


def test_a_forced_run_roots_the_model_free_tree():
    run_tree = after_chain(7, [1, 2], TokenTree.build([2, 3, 4], [-1, 0, 0], [0.0, -0.5, -1.0]))
    assert run_tree.tokens.tolist() == [7, 1, 2, 3, 4]
    assert run_tree.parents.tolist() == [-1, 0, 1, 2, 2]
    assert run_tree.logq.tolist() == [0.0, 0.0, 0.0, -0.5, -1.0]
