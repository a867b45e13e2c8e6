"""Our forward pass equals transformers' LlamaForCausalLM (fp32) for prefill, decode and trees."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from shared.model import load_model
from shared.model.runner import ForwardItem, ModelRunner


def hf_logits(hf: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def test_prefill_and_decode_match_hf(tiny_target_dir):
    hf = LlamaForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    runner = ModelRunner(load_model(tiny_target_dir), block_size=4, kv_memory_bytes=1 << 20)
    prompt = [5, 17, 3, 44, 91, 12, 7, 8, 60]
    runner.add_request("a")
    [logits] = runner.forward([ForwardItem.chain("a", prompt, logits="all")])
    runner.commit({"a": range(len(prompt))})
    ref = hf_logits(hf, prompt)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    seq = list(prompt)
    for tok in [33, 2, 71]:
        [step] = runner.forward([ForwardItem.chain("a", [tok])])
        runner.commit({"a": [0]})
        seq.append(tok)
        torch.testing.assert_close(step[0], hf_logits(hf, seq)[-1], atol=1e-4, rtol=1e-4)


def test_tree_logits_match_each_path(tiny_target_dir):
    hf = LlamaForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    runner = ModelRunner(load_model(tiny_target_dir), block_size=4, kv_memory_bytes=1 << 20)
    prompt = [9, 10, 11, 12, 13]
    runner.add_request("a")
    runner.prefill({"a": prompt})
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    tokens = [40, 41, 42, 43, 44, 45]
    parents = [-1, 0, 0, 1, 1, 2]
    [logits] = runner.forward([ForwardItem("a", tokens, parents)])
    for node in range(len(tokens)):
        path, i = [], node
        while i >= 0:
            path.append(tokens[i])
            i = parents[i]
        ref = hf_logits(hf, prompt + path[::-1])[-1]
        torch.testing.assert_close(logits[node], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_llama_family_architectures_match_hf(tmp_path, arch):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[arch]
    torch.manual_seed(0)
    cfg = config_cls(
        vocab_size=80,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=None,
        tie_word_embeddings=False,
    )
    hf = model_cls(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.15)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    runner = ModelRunner(load_model(tmp_path), block_size=4, kv_memory_bytes=1 << 20)
    prompt = [3, 9, 27, 1, 40, 77]
    runner.add_request("a")
    [logits] = runner.forward([ForwardItem.chain("a", prompt, logits="all")])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_sliding_window_caps_the_context():
    from shared.model.config import ModelConfig

    base = {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 32768,
    }
    assert ModelConfig.from_hf({**base, "sliding_window": 4096}).max_position_embeddings == 4096
    assert ModelConfig.from_hf({**base, "sliding_window": None}).max_position_embeddings == 32768
