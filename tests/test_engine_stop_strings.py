"""Stop strings in the in-process engine (`SpecEngine(tokenizer=...)`): a stop string completed
inside a step of several accepted draft tokens ends the output at the token that completed it,
the later accepted tokens are dropped, and the request leaves the core (its KV freed).

The target is a tiny random model over SmolLM2's vocabulary (its tokenizer copied beside it),
drafted for by itself: every drafted token is accepted, so each step commits a whole chain."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from shared.engine.drafting import Drafter
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.errors import InvalidRequestError
from shared.model import load_model
from shared.model.runner import ModelRunner
from shared.model.smollm2 import ensure_smollm2
from shared.scheduling.config import SchedulerConfig
from shared.text.detokenize import IncrementalDetokenizer
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from tests.conftest import make_tiny_checkpoint
from tests.test_services_support import plain_greedy

CHAIN = 4  # each step commits CHAIN + 1 tokens with a self-draft
MAX_TOKENS = 40
PROMPT_TEXT = "The capital of France is"


def worded_checkpoint(path: Path) -> Path:
    """A tiny random target over SmolLM2's vocabulary, with SmolLM2's tokenizer beside it."""
    make_tiny_checkpoint(path, seed=5, vocab_size=49152, tie=True)
    source = ensure_smollm2()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path


def stop_inside_a_step(tokenizer: Any, tokens: list[int], first: int = 1) -> tuple[str, int]:
    """A stop string across the boundary of two tokens committed in one step (steps after the
    first commit CHAIN + 1 tokens), whose first occurrence in the text is that one; and how many
    tokens it takes to complete it."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.step(t) for t in tokens]
    text = "".join(pieces)
    for j in range(first + 1, len(tokens) - 1):
        if (j - first) % (CHAIN + 1) == CHAIN:  # j and j + 1 in different steps
            continue
        left, right = pieces[j], pieces[j + 1]
        if len(left) < 2 or len(right) < 2 or "\ufffd" in left + right:
            continue
        stop = left[-2:] + right[:2]
        at = len("".join(pieces[:j])) + len(left) - 2
        if text.find(stop) == at:
            return stop, j + 2
    raise AssertionError("no stop string fits this output")


@pytest.fixture(scope="module")
def worded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return worded_checkpoint(tmp_path_factory.mktemp("worded"))


@pytest.fixture(scope="module")
def tokenizer(worded_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(worded_dir)


def self_drafted_engine(target: Path, tokenizer: Any | None) -> SpecEngine:
    runner = ModelRunner(load_model(target), block_size=4, kv_memory_bytes=16 << 20)
    drafter = Drafter(ModelRunner(load_model(target), block_size=4, kv_memory_bytes=16 << 20))
    return SpecEngine(
        Verifier(runner),
        drafter,
        DraftMethod("chain", k=CHAIN),
        SchedulerConfig(planner="fixed"),
        tokenizer=tokenizer,
    )


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_inside_an_accepted_chain_ends_the_output(
    worded_dir: Path, tokenizer: Any, include: bool
) -> None:
    prompt = tokenizer.encode(PROMPT_TEXT)
    [reference] = plain_greedy(worded_dir, [prompt], [SamplingParams(max_tokens=MAX_TOKENS)])
    full = tokenizer.decode(reference)
    stop, taken = stop_inside_a_step(tokenizer, reference)
    engine = self_drafted_engine(worded_dir, tokenizer)
    rid = engine.add_request(
        prompt,
        SamplingParams(max_tokens=MAX_TOKENS),
        stop=[stop, "never in this text"],
        include_stop_str_in_output=include,
    )
    streamed: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.offset == len(streamed)
            streamed += out.new_tokens
    request, text = engine.requests.pop(rid), engine.texts.pop(rid)
    assert request.finish_reason == "stop"
    assert request.output == streamed == reference[:taken]  # later accepted tokens dropped
    cut = full.index(stop) + (len(stop) if include else 0)
    assert text.text == full[:cut] and text.stop_reason == stop
    assert engine.stats.num_accepted >= CHAIN  # the stop came inside an accepted chain
    assert not engine.verifier.runner.has_request(rid)  # the request's KV is freed


def test_without_a_match_the_text_is_the_whole_decode(worded_dir: Path, tokenizer: Any) -> None:
    engine = self_drafted_engine(worded_dir, tokenizer)
    prompt = tokenizer.encode(PROMPT_TEXT)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS), stop=["\x00zz"])
    while engine.has_unfinished():
        engine.step()
    request, text = engine.requests.pop(rid), engine.texts.pop(rid)
    assert request.finish_reason == "length" and len(request.output) == MAX_TOKENS
    assert text.text == tokenizer.decode(request.output, skip_special_tokens=True)
    assert text.stop_reason is None


def test_stop_strings_need_a_tokenizer(worded_dir: Path) -> None:
    engine = self_drafted_engine(worded_dir, None)
    with pytest.raises(InvalidRequestError, match="tokenizer") as error:
        engine.add_request([5, 6], SamplingParams(max_tokens=4), stop=["x"])
    assert error.value.param == "stop"
