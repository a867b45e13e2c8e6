"""A draft whose output head covers only the tokens text uses most.

On a CPU a draft's forward reads every weight once per token, and a large vocabulary makes the
output head a large share of them: the qwen2.5-coder 0.5B's 151,936 x 896 head is 136 M of its
494 M weights. Drafting among the N most frequent tokens of a corpus reads N rows instead (the
idea of FR-Spec, Zhao et al. 2025). The target still verifies over its whole vocabulary, so the
output is unchanged: a rarer token is never drafted, only emitted by the target itself (the
step's bonus token, or a rejection's resample).

The counts come from text the caller gives (`python -m tools.draft_vocabulary` counts the
distillation documents, disjoint from every evaluation prompt). The restricted draft is an
ordinary checkpoint: the
decoder layers as they were, `lm_head.weight` holding the kept rows, `augury.output_token_ids`
their ids and `augury_num_output_tokens` in its config, as the feature drafts store theirs.

    python -m tools.draft_vocabulary --draft DIR --size 32768 --out DIR
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from shared.model.loader import OUTPUT_TOKEN_IDS_KEY, checkpoint_dir

EMBED_KEY = "model.embed_tokens.weight"
HEAD_KEY = "lm_head.weight"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def token_counts(tok: Any, conversations: Iterable[list[tuple[str, str]]]) -> np.ndarray:
    """How often each token id occurs in the conversations, rendered with `tok`'s chat
    template (a transformers tokenizer)."""
    counts = np.zeros(len(tok), dtype=np.int64)
    for conv in tqdm(list(conversations), desc="counting tokens", unit="doc"):
        messages = [{"role": role, "content": text} for role, text in conv]
        text = tok.apply_chat_template(messages, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=len(counts))
    return counts


def frequent_tokens(counts: np.ndarray, size: int, must_include: Sequence[int]) -> list[int]:
    """The `size` ids to keep, in id order: `must_include` (special tokens), then the most
    frequent (ties broken by the lower id)."""
    if size > len(counts):
        raise ValueError(f"--size {size} exceeds the vocabulary ({len(counts)})")
    keep = list(dict.fromkeys(int(i) for i in must_include))
    order = np.lexsort((np.arange(len(counts)), -counts))
    chosen = set(keep)
    for i in order:
        if len(keep) >= size:
            break
        if int(i) not in chosen:
            keep.append(int(i))
            chosen.add(int(i))
    return sorted(keep)


def special_token_ids(tok: Any) -> list[int]:
    """Every special or added token of the tokenizer (chat markers, end of turn, ...)."""
    ids = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    return sorted(i for i in ids if i < len(tok))


def write_restricted_draft(draft_dir: Path, out_dir: Path, token_ids: Sequence[int]) -> Path:
    """A copy of the draft checkpoint whose head keeps only `token_ids`' rows."""
    draft_dir = checkpoint_dir(draft_dir)
    config = json.loads((draft_dir / "config.json").read_text())
    if config.get("augury_num_output_tokens") is not None:
        raise ValueError(f"{draft_dir} already has a reduced output vocabulary")
    files = sorted(draft_dir.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = f.get_tensor(name)
    ids = torch.tensor(sorted(token_ids), dtype=torch.int64)
    head = tensors.get(HEAD_KEY, tensors[EMBED_KEY])
    tensors[HEAD_KEY] = head[ids].contiguous()
    tensors[OUTPUT_TOKEN_IDS_KEY] = ids.to(torch.int32)
    config["augury_num_output_tokens"] = len(ids)
    config["tie_word_embeddings"] = False
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in [*TOKENIZER_FILES, "generation_config.json"]:
        if (draft_dir / name).is_file():
            shutil.copy(draft_dir / name, out_dir / name)
    return out_dir


def build(
    draft_dir: Path,
    out_dir: Path,
    size: int,
    conversations: Iterable[list[tuple[str, str]]],
    corpus: dict | None = None,  # what the conversations were, recorded with the counts
) -> dict:
    """Count the conversations with the draft's tokenizer, keep `size` tokens, write the draft
    (and `vocabulary.json` beside it: what was counted and kept)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(draft_dir)
    counts = token_counts(tok, conversations)
    keep = frequent_tokens(counts, size, special_token_ids(tok))
    write_restricted_draft(draft_dir, out_dir, keep)
    summary = {
        "source": str(draft_dir),
        "output_tokens": len(keep),
        "corpus_tokens": int(counts.sum()),
        "corpus_coverage": round(float(counts[keep].sum() / counts.sum()), 5),
        "corpus": corpus or {},
    }
    (out_dir / "vocabulary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
