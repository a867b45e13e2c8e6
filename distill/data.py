"""Distillation data: real text plus the target's own answers, and the target's top-k cache.

Two kinds of sequences, all in the target's chat format:

1. *generated*: distillation prompts (chat, code, math and everyday questions; see
   `shared.datasets`) answered by the target itself, greedily (bf16, batched). At serving time a
   draft predicts exactly such text.
2. *documents*: human-written conversations (ShareGPT replies, standard-library Python code,
   GSM8K reference solutions), teacher-forced.

Then one batched bf16 teacher-forced pass of the target over every sequence caches, per position,
its top-k next-token log-probabilities (fp16) and ids (int32) — once, shared by all drafts.
The same pass keeps the target's last-layer features (fp16) for the feature-level draft.
Everything lands under the cache directory (ignored by git) and is reused when present.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from tqdm import tqdm

from shared import datasets
from shared.model.hf_checkpoint import load_transformers_model
from shared.model.model_set import DRAFTS_DIR, QWEN_DRAFTS_DIR, REPO_ROOT, model_set_target

CACHE_ROOT = REPO_ROOT / ".cache" / "distill"  # ignored by git
TOP_K = 32
MAX_USER_CHARS = 1200
MAX_DOC_TOKENS = 384
GEN_TOKENS = 128
# How many prompts the target answers, and how many human-written documents, per kind.
GEN_PROMPTS = {"chat": 5500, "code": 1200, "math": 819, "everyday": 273}
DOCUMENTS = {"chat": 3000, "code": 150, "math": 150}


@dataclass(frozen=True)
class Recipe:
    """What a model set's distillation data is built from; its files are named after it."""

    gen_prompts: dict[str, int]
    documents: dict[str, int]
    gen_tokens: int = GEN_TOKENS
    max_doc_tokens: int = MAX_DOC_TOKENS
    max_user_chars: int = MAX_USER_CHARS
    top_k: int = TOP_K
    answer_batch: int = 50  # prompts the target answers at once
    # where the set's files go: a folder under .cache/distill ("": SmolLM2's, there first) and
    # the drafts' folder (committed)
    cache_subdir: str = ""
    drafts_dir: Path = DRAFTS_DIR
    # SmolLM2's drafts copy its layers (every target tensor is read); a bigger target's feature
    # draft reads only its embedding, head and final norm
    copies_target_layers: bool = True
    # the output vocabulary: the tokens the target ranks first most often in the top-k cache, or
    # (qwen2.5-coder) the 32k-token head's, counted over 4 M tokens of documents
    cut_vocabulary: bool = False

    @property
    def cache_dir(self) -> Path:
        return CACHE_ROOT / self.cache_subdir

    def tag(self) -> str:
        """Changing a count rebuilds the sequence and top-k files (answers are kept, extended)."""
        recipe = [
            self.gen_prompts,
            self.documents,
            self.gen_tokens,
            self.max_doc_tokens,
            self.max_user_chars,
            self.top_k,
        ]
        return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]


# SmolLM2-135M's drafts. The 1.5B of `qwen2.5-coder` costs about 11x as much a token, so its
# feature draft learns from a smaller set (500 answers and a teacher pass: about 71 minutes of
# target time on a 2-core CPU with AVX-512 BF16).
RECIPES = {
    "smollm2": Recipe(GEN_PROMPTS, DOCUMENTS),
    "qwen2.5-coder": Recipe(
        {"chat": 200, "code": 120, "math": 40, "everyday": 140},
        {"chat": 200, "code": 60, "math": 60},
        answer_batch=16,
        cache_subdir="qwen2.5-coder",
        drafts_dir=QWEN_DRAFTS_DIR,
        copies_target_layers=False,
        cut_vocabulary=True,
    ),
}
SMOLLM2_RECIPE = RECIPES["smollm2"]


def set_data(
    model_set: str, cache: Path | None, recipes: dict[str, Recipe] = RECIPES
) -> tuple[Recipe, Path, Path]:
    """A model set's distillation recipe (from `recipes`), target checkpoint and cache folder
    (`cache` where given)."""
    recipe = recipes[model_set]
    return recipe, model_set_target(model_set), cache or recipe.cache_dir


def data_tag(recipe: Recipe = SMOLLM2_RECIPE) -> str:
    return recipe.tag()


def sequences_path(cache_dir: Path, recipe: Recipe = SMOLLM2_RECIPE) -> Path:
    return cache_dir / f"sequences-{recipe.tag()}.json"


def features_path(cache_dir: Path, recipe: Recipe = SMOLLM2_RECIPE) -> Path:
    """The target's features (last layer after the final norm, fp16 [N, hidden]) at every position
    of every sequence, aligned with the top-k cache: what the feature-level draft reads."""
    return cache_dir / f"target_features-{recipe.tag()}.npy"


def load_gen_starts(cache_dir: Path, recipe: Recipe = SMOLLM2_RECIPE) -> np.ndarray:
    """Where each cached sequence's target answer starts (0 for documents): [num_sequences]."""
    seqs = json.loads(sequences_path(cache_dir, recipe).read_text())
    return np.array([s["gen_start"] for s in seqs], dtype=np.int64)


def load_features(cache_dir: Path, recipe: Recipe = SMOLLM2_RECIPE) -> np.ndarray:
    """The feature cache, memory-mapped (about 3.2 GB for SmolLM2's recipe)."""
    return np.load(features_path(cache_dir, recipe), mmap_mode="r")


@dataclass
class TopKCache:
    tokens: np.ndarray  # int32 [N] all sequences concatenated
    offsets: np.ndarray  # int64 [S + 1]
    kinds: list[str]  # [S]
    generated: np.ndarray  # bool [S]: answered by the target (True) or human-written
    topk_ids: np.ndarray  # int32 [N, K]: target's top-k next tokens after tokens[: i + 1]
    topk_logp: np.ndarray  # float16 [N, K]

    def sequence(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    @property
    def num_sequences(self) -> int:
        return len(self.offsets) - 1

    def save(self, path: Path) -> None:
        np.savez(
            path,
            tokens=self.tokens,
            offsets=self.offsets,
            kinds=np.array(self.kinds),
            generated=self.generated,
            topk_ids=self.topk_ids,
            topk_logp=self.topk_logp,
        )

    @classmethod
    def load(cls, path: Path) -> TopKCache:
        z = np.load(path)
        return cls(
            tokens=z["tokens"],
            offsets=z["offsets"],
            kinds=[str(k) for k in z["kinds"]],
            generated=z["generated"],
            topk_ids=z["topk_ids"],
            topk_logp=z["topk_logp"],
        )


def chat_ids(tokenizer, messages: list[tuple[str, str]], *, generation_prompt: bool) -> list[int]:
    msgs = [{"role": r, "content": c} for r, c in messages]
    text = tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=generation_prompt
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(tokenizer, user_message: str) -> list[int]:
    """The target's chat-templated prompt for one user message (the serving format)."""
    return chat_ids(tokenizer, [("user", user_message)], generation_prompt=True)


@torch.inference_mode()
def greedy_generate(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    batch_size: int,
    desc: str,
) -> list[list[int]]:
    """Batched greedy continuations (left-padded HF generate), cut after the first eos."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt")
    for lo in range(0, len(order), batch_size):
        idx = order[lo : lo + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), eos_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]) :] = 1
        gen = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=eos_id,
            eos_token_id=eos_id,
        )[:, width:]
        for r, i in enumerate(idx):
            toks = gen[r].tolist()
            out[i] = toks[: toks.index(eos_id) + 1] if eos_id in toks else toks
        bar.update(len(idx))
    bar.close()
    return out


def build_sequences(
    cache_dir: Path, target_dir: Path, recipe: Recipe = SMOLLM2_RECIPE
) -> list[dict]:
    """Token sequences (prompt + target answer, and documents); cached as sequences-*.json."""
    path = sequences_path(cache_dir, recipe)
    if path.is_file():
        return json.loads(path.read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    eos = int(tok.eos_token_id)
    model = load_transformers_model(target_dir, torch.bfloat16)
    seqs: list[dict] = []
    for kind, n in recipe.gen_prompts.items():
        prompts = [
            prompt_ids(tok, m[: recipe.max_user_chars]) for m in datasets.distill_prompts(kind, n)
        ]
        # Per-kind checkpoint of the slow part. Prompts are a fixed prefix-stable list, so a
        # checkpoint made with fewer prompts is extended, not redone.
        part = cache_dir / f"answers_{kind}.json"
        answers = json.loads(part.read_text())[: len(prompts)] if part.is_file() else []
        if len(answers) < len(prompts):
            answers += greedy_generate(
                model,
                prompts[len(answers) :],
                max_new_tokens=recipe.gen_tokens,
                eos_id=eos,
                batch_size=recipe.answer_batch,
                desc=f"target answers ({kind})",
            )
            cache_dir.mkdir(parents=True, exist_ok=True)
            part.write_text(json.dumps(answers))
        for p, a in zip(prompts, answers, strict=True):
            seqs.append({"kind": kind, "generated": True, "tokens": p + a, "gen_start": len(p)})
    for kind, n in recipe.documents.items():
        for conv in datasets.distill_documents(kind, n):
            conv = [(r, c[:4000]) for r, c in conv]
            ids = chat_ids(tok, conv, generation_prompt=False)[: recipe.max_doc_tokens]
            seqs.append({"kind": kind, "generated": False, "tokens": ids, "gen_start": 0})
    cache_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(seqs))
    return seqs


@torch.inference_mode()
def build_topk_cache(
    cache_dir: Path,
    target_dir: Path,
    recipe: Recipe = SMOLLM2_RECIPE,
    *,
    batch_tokens: int = 6144,
) -> TopKCache:
    """Target top-k log-probs at every position of every sequence; cached as target_topk-*.npz.

    The same pass writes the target's features beside it (`features_path`)."""
    path = cache_dir / f"target_topk-{recipe.tag()}.npz"
    feats_path = features_path(cache_dir, recipe)
    if path.is_file() and feats_path.is_file():
        return TopKCache.load(path)
    seqs = build_sequences(cache_dir, target_dir, recipe)
    model = load_transformers_model(target_dir, torch.bfloat16)
    lengths = np.array([len(s["tokens"]) for s in seqs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    total = int(offsets[-1])
    topk_ids = np.zeros((total, recipe.top_k), dtype=np.int32)
    topk_logp = np.zeros((total, recipe.top_k), dtype=np.float16)
    hidden_size = int(model.config.hidden_size)
    partial = feats_path.with_suffix(".partial.npy")
    features = np.lib.format.open_memmap(
        partial, mode="w+", dtype=np.float16, shape=(total, hidden_size)
    )
    bar = tqdm(total=total, desc="target top-k cache", unit="tok", unit_scale=True)
    for idx, ids in padded_batches(seqs, lengths, batch_tokens):
        hidden = model.model(input_ids=ids).last_hidden_state
        for r, s in enumerate(idx):
            h = hidden[r, : lengths[s]]
            logp = torch.log_softmax(model.lm_head(h).float(), dim=-1)
            val, ind = logp.topk(recipe.top_k, dim=-1)
            lo = int(offsets[s])
            topk_ids[lo : lo + len(h)] = ind.numpy().astype(np.int32)
            topk_logp[lo : lo + len(h)] = val.numpy().astype(np.float16)
            features[lo : lo + len(h)] = h.float().numpy().astype(np.float16)
        bar.update(int(lengths[idx].sum()))
    bar.close()
    features.flush()
    del features
    partial.replace(feats_path)
    cache = TopKCache(
        tokens=np.concatenate([np.asarray(s["tokens"], dtype=np.int32) for s in seqs]),
        offsets=offsets,
        kinds=[s["kind"] for s in seqs],
        generated=np.array([s["generated"] for s in seqs], dtype=bool),
        topk_ids=topk_ids,
        topk_logp=topk_logp,
    )
    cache.save(path)
    return cache


def padded_batches(
    seqs: list[dict], lengths: np.ndarray, batch_tokens: int
) -> Iterator[tuple[np.ndarray, torch.Tensor]]:
    """(sequence indices, right-padded token ids [rows, width]) of up to `batch_tokens` tokens,
    longest sequences first. Right padding under a causal mask leaves every real position's
    output unchanged."""
    order = np.argsort(-lengths, kind="stable")
    i = 0
    while i < len(order):
        width = int(lengths[order[i]])
        idx = order[i : i + max(1, batch_tokens // width)]
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        for r, s in enumerate(idx):
            ids[r, : lengths[s]] = torch.tensor(seqs[s]["tokens"])
        yield idx, ids
        i += len(idx)


def fused_features_path(cache_dir: Path, recipe: Recipe, layers: tuple[int, ...]) -> Path:
    names = "-".join(str(layer) for layer in layers)
    return cache_dir / f"target_fused_features-{recipe.tag()}-layers{names}.npy"


@torch.inference_mode()
def build_fused_features(
    cache_dir: Path,
    target_dir: Path,
    recipe: Recipe,
    layers: tuple[int, ...],
    *,
    batch_tokens: int = 6144,
) -> np.ndarray:
    """The outputs of the target's `layers` (0-based, before the final norm) side by side at
    every position of every cached sequence: [N, len(layers) * hidden] fp16, aligned with the
    top-k cache (EAGLE-3's fused features; a second teacher-forced pass, cached)."""
    path = fused_features_path(cache_dir, recipe, layers)
    if path.is_file():
        return np.load(path, mmap_mode="r")
    seqs = build_sequences(cache_dir, target_dir, recipe)
    model = load_transformers_model(target_dir, torch.bfloat16)
    if max(layers) >= model.config.num_hidden_layers:
        raise ValueError(f"layers {layers}: the target has {model.config.num_hidden_layers}")
    lengths = np.array([len(s["tokens"]) for s in seqs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    width = len(layers) * int(model.config.hidden_size)
    partial = path.with_suffix(".partial.npy")
    out = np.lib.format.open_memmap(
        partial, mode="w+", dtype=np.float16, shape=(int(offsets[-1]), width)
    )
    bar = tqdm(total=int(offsets[-1]), desc="target fused features", unit="tok", unit_scale=True)
    for idx, ids in padded_batches(seqs, lengths, batch_tokens):
        states = model.model(input_ids=ids, output_hidden_states=True).hidden_states
        fused = torch.cat([states[layer + 1] for layer in layers], dim=-1)  # [0]: embeddings
        for r, s in enumerate(idx):
            lo = int(offsets[s])
            out[lo : lo + lengths[s]] = fused[r, : lengths[s]].float().numpy().astype(np.float16)
        bar.update(int(lengths[idx].sum()))
    bar.close()
    out.flush()
    del out
    partial.replace(path)
    return np.load(path, mmap_mode="r")


def tokenizer_fingerprint(tokenizer_dir: Path) -> dict:
    """What a draft must share with the target's tokenizer: vocab, special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps(vocab).encode()).hexdigest()
    return {
        "vocab_size": len(tok),
        "vocab_sha256": digest,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }


def bos_eos(fingerprint: dict) -> tuple[int, int]:
    """(bos, eos) of a `tokenizer_fingerprint`; a tokenizer without a bos token uses its eos."""
    eos = int(fingerprint["eos_token_id"])
    bos = fingerprint["bos_token_id"]
    return (int(bos) if bos is not None else eos), eos


def target_init_tensors(tdir: Path, recipe: Recipe) -> dict[str, torch.Tensor]:
    """The target's tensors the drafts are initialized from: all of them where the drafts copy
    its layers (SmolLM2's), else only the embedding, head and final norm a feature draft reads."""
    wanted = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    out: dict[str, torch.Tensor] = {}
    for file in sorted(tdir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if recipe.copies_target_layers or key in wanted:
                    out[key] = f.get_tensor(key)
    return out


def draft_vocabulary(
    recipe: Recipe, cache: TopKCache, size: int, must_include: list[int]
) -> np.ndarray:
    """A new draft's output tokens: those the target ranks first most often in the cache
    (`output_vocabulary`), or the 32k-token head's (`Recipe.cut_vocabulary`)."""
    if not recipe.cut_vocabulary:
        return output_vocabulary(cache, size, must_include)
    from shared.model import qwen_coder
    from shared.model.loader import OUTPUT_TOKEN_IDS_KEY

    cut = qwen_coder.cut_draft_dir() / "model.safetensors"
    if not cut.is_file():
        raise SystemExit(f"{cut} missing: run `bash scripts/install-qwen-coder.sh` first")
    with safe_open(str(cut), framework="pt") as f:
        ids = f.get_tensor(OUTPUT_TOKEN_IDS_KEY).long().numpy()
    if len(ids) != size:
        raise SystemExit(f"{cut} has {len(ids)} output tokens, the draft wants {size}")
    return np.sort(ids)


def output_vocabulary(cache: TopKCache, size: int, must_include: list[int]) -> np.ndarray:
    """The draft's output tokens: the `size` tokens the target most often ranks first (ties by
    total probability mass over the cached top-k), always including `must_include`."""
    top1 = np.bincount(cache.topk_ids[:, 0], minlength=1).astype(np.float64)
    mass = np.zeros(max(len(top1), int(cache.topk_ids.max()) + 1), dtype=np.float64)
    np.add.at(mass, cache.topk_ids.ravel(), np.exp(cache.topk_logp.astype(np.float32)).ravel())
    score = mass.copy()
    score[: len(top1)] += 1e6 * top1
    for t in must_include:
        score[t] = np.inf
    chosen = np.argsort(-score, kind="stable")[:size]
    return np.sort(chosen).astype(np.int64)
