"""The real default target, SmolLM2-135M-Instruct: our runtime against transformers, and
speculative greedy decoding against plain greedy decoding on real prompts."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from shared.engine.drafting import Drafter
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.model_set import draft_dirs, target_dir
from shared.model.runner import ForwardItem, ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams

pytestmark = pytest.mark.smollm2

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?",
]


@pytest.fixture(scope="module")
def target():
    return load_model(target_dir())


@pytest.fixture(scope="module")
def prompts():
    tok = AutoTokenizer.from_pretrained(target_dir())
    return [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": p}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for p in PROMPTS
    ]


def test_logits_match_transformers(target, prompts):
    hf = LlamaForCausalLM.from_pretrained(target_dir(), dtype=torch.float32).eval()
    runner = ModelRunner(target)
    prompt = prompts[0]
    runner.add_request("a")
    [prefill] = runner.forward([ForwardItem.chain("a", prompt, logits="all")])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill, ref, atol=2e-3, rtol=1e-3)
    runner.commit({"a": range(len(prompt))})
    tree_tokens, parents = [504, 314, 3365, 28], [-1, 0, 0, 1]
    [tree] = runner.forward([ForwardItem("a", tree_tokens, parents)])
    for node, path in [(2, [504, 3365]), (3, [504, 314, 28])]:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + path])).logits[0, -1]
        torch.testing.assert_close(tree[node], ref, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize(
    "method",
    [DraftMethod("chain", k=4), DraftMethod("dynamic", budget=16, max_size=8, max_depth=5)],
    ids=["chain", "dynamic"],
)
def test_speculative_greedy_equals_plain_on_real_prompts(target, prompts, method):
    params = SamplingParams(max_tokens=24)
    plain = SpecEngine(Verifier(ModelRunner(target))).generate(prompts, params)
    drafter = Drafter(ModelRunner(load_model(draft_dirs()["draft-s"], target_path=target_dir())))
    engine = SpecEngine(
        Verifier(ModelRunner(target)), drafter, method, SchedulerConfig(max_tokens_per_step=40)
    )
    spec = engine.generate(prompts, params)
    assert [r.output for r in spec] == [r.output for r in plain]
    assert engine.stats.num_accepted > 0


def test_cli_streams_a_completion_and_reports_acceptance(capsys):
    from shared.cli import main

    assert main(["generate", "Name a color.", "--max-tokens", "12", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "generated tokens" in out and "tokens/s" in out
    assert "mean accepted length" in out and "draft-e (dynamic, merged with ngram)" in out


def test_cli_reports_bad_input_clearly(capsys):
    from shared.cli import main

    assert main(["generate", "Hi", "--max-tokens", "9000", "--no-spec"]) == 2
    assert "context of 8192 tokens" in capsys.readouterr().err


def test_processes_starting_together_convert_once(tmp_path):
    """A second process waits on the conversion lock and then finds the first one's checkpoint
    (the lock is held here; the checkpoint appears as the conversion would leave it)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from shared.model.smollm2 import CHECKPOINT_NAME, conversion_lock

    target = tmp_path / CHECKPOINT_NAME
    code = "import sys; from pathlib import Path; from shared.model.smollm2 import ensure_smollm2;"
    code += " print(ensure_smollm2(Path(sys.argv[1])))"
    root = Path(__file__).resolve().parents[1]
    with conversion_lock(target):
        waiting = subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], cwd=root, stdout=subprocess.PIPE, text=True
        )
        time.sleep(3.0)
        assert waiting.poll() is None  # blocked on the lock, not converting beside us
        assert not target.with_name(CHECKPOINT_NAME + ".partial").exists()
        target.mkdir()
        (target / "config.json").write_text("{}")
    out, _ = waiting.communicate(timeout=60)
    assert waiting.returncode == 0 and out.strip() == str(target)
    assert not target.with_name(CHECKPOINT_NAME + ".partial").exists()  # it converted nothing
