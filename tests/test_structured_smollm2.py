"""Structured output with the real SmolLM2 target and a distilled draft: JSON-schema outputs
parse and validate (nested object, array, enum, required fields), greedy and sampled, and greedy
constrained speculation equals plain constrained decoding with a floor on acceptance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from transformers import AutoTokenizer

from shared.engine.drafting import Drafter
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.model_set import draft_dirs, target_dir
from shared.model.runner import ModelRunner
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams, StructuredOutput

pytestmark = pytest.mark.smollm2

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["engineer", "teacher", "doctor"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
            "required": ["city", "country"],
            "additionalProperties": False,
        },
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "skills"],
    "additionalProperties": False,
}
PROMPTS = [
    "Maria Lopez, 34, is an engineer from Madrid, Spain. She knows Python and Rust.",
    "Tom Baker is a 51 year old teacher living in Leeds, England; he plays chess.",
]
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(target_dir())


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ask = "Extract the person as JSON with name, age, role, address and skills: "
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": ask + p}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for p in PROMPTS
    ]


@pytest.fixture(scope="module")
def target():
    return load_model(target_dir())


def engine(target, tokenizer, draft: str | None = None) -> SpecEngine:
    drafter = None
    if draft is not None:
        model = load_model(draft_dirs()[draft], target_path=target_dir())
        drafter = Drafter(ModelRunner(model), name=draft)
    return SpecEngine(
        Verifier(ModelRunner(target)),
        drafter,
        DraftMethod("chain", k=4) if drafter is not None else None,
        eos_token_ids=[tokenizer.eos_token_id],
        tokenizer=tokenizer,
    )


def parsed(tokenizer, output: list[int]) -> dict:
    document = json.loads(tokenizer.decode(output, skip_special_tokens=True))
    jsonschema.validate(document, SCHEMA)
    return document


def test_greedy_json_schema_output_validates_and_equals_plain_decoding(target, tokenizer, prompts):
    params = SamplingParams(
        max_tokens=MAX_TOKENS, structured=StructuredOutput("json_schema", json.dumps(SCHEMA))
    )
    plain = engine(target, tokenizer).generate(prompts, params)
    spec_engine = engine(target, tokenizer, "draft-m")
    spec = spec_engine.generate(prompts, params)
    assert [r.output for r in spec] == [r.output for r in plain]
    assert all(r.finish_reason == "stop" for r in spec)
    documents = [parsed(tokenizer, r.output) for r in spec]
    assert documents[0]["role"] == "engineer" and documents[0]["address"]["city"] == "Madrid"
    stats = spec_engine.stats
    assert stats.num_accepted >= 0.25 * stats.num_draft_tokens
    tokens = sum(len(r.output) for r in spec)
    assert stats.num_target_forwards <= 0.6 * tokens  # plain decoding: one forward a token


def test_sampled_json_schema_output_validates(target, tokenizer, prompts):
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    params = [
        SamplingParams(temperature=0.8, seed=seed, max_tokens=MAX_TOKENS, structured=structured)
        for seed in range(2)
    ]
    results = engine(target, tokenizer, "draft-m").generate(prompts, params)
    for r in results:
        if r.finish_reason == "stop":
            parsed(tokenizer, r.output)
        else:  # cut by max_tokens: a prefix of a valid document
            assert r.finish_reason == "length"
            assert tokenizer.decode(r.output).startswith('{"name": "')


FIRST_STRUCTURED_REQUEST = """
import sys, threading
from pathlib import Path
from shared.grammar.matcher import CheckpointGrammar
from shared.values.sampling import StructuredOutput

grammars = [CheckpointGrammar(Path(sys.argv[1]), [2]) for _ in range(2)]
outcomes = []

def first_request(grammar):
    try:
        book = grammar.book()
        outcomes.append((book.tokenizer, book.dead_end("r", StructuredOutput("regex", "a+"), [])))
    except BaseException as error:
        outcomes.append((None, repr(error)))

threads = [threading.Thread(target=first_request, args=(g,)) for g in grammars]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
assert [why for _, why in outcomes] == [None, None], outcomes
assert outcomes[0][0] is outcomes[1][0], "each service built its own tokenizer"
"""


def test_two_services_first_structured_requests_at_once_share_one_tokenizer():
    """The verifier's and a drafter's model threads meet their first structured request at the
    same moment, in a fresh process (transformers' lazy imports once failed in one of them)."""
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, "-c", FIRST_STRUCTURED_REQUEST, str(target_dir())],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
