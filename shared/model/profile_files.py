"""Cost profiles on disk and what they are keyed by: the architecture fingerprint of a model
config or checkpoint, the processor's name, and the search of a profile directory for the newest
profile measured for the same target and drafts (`shared.scheduling.cost_model` holds the profile
types and the scheduler's view of them, and reads nothing from the machine).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from shared.scheduling.cost_model import CostProfile, ProfileKey, ProfileMismatchError

log = logging.getLogger(__name__)


# Where `python -m tools.profile` saves profiles and where services look for one first.
DEFAULT_PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"


# ModelConfig fields that decide a forward's cost. `num_output_tokens` (a draft's reduced output
# vocabulary) and `embedding_rank` (a factorized input embedding) change the cost too; None means
# "full vocabulary" / "no factorization".
ARCHITECTURE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
    "num_output_tokens",
    "embedding_rank",
    "has_qkv_bias",
)


def architecture_fingerprint(cfg: Any) -> str:
    """A 12-hex-digit hash of the architecture fields that decide cost (`ARCHITECTURE_FIELDS`,
    and a feature-level draft's `feature_size`).

    `cfg` is anything with those attributes (a `shared.model.config.ModelConfig`) or a mapping of
    them; weights, context length, tokens ids and names do not enter it.
    """

    def get(name: str) -> Any:
        return cfg[name] if isinstance(cfg, Mapping) else getattr(cfg, name)

    fields = {name: get(name) for name in ARCHITECTURE_FIELDS}
    # A feature-level draft also projects the target's features at every token; the field enters
    # only where it is set, so that the fingerprints of every other model stay what they were.
    feature_size = cfg.get("feature_size") if isinstance(cfg, Mapping) else cfg.feature_size
    if feature_size:
        fields["feature_size"] = feature_size
    if fields["num_output_tokens"] in (None, fields["vocab_size"]):
        fields["num_output_tokens"] = fields["vocab_size"]
    fields["has_qkv_bias"] = bool(fields["has_qkv_bias"])
    blob = json.dumps(fields, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def fingerprint_of_checkpoint(path: str | Path) -> str:
    """`architecture_fingerprint` of a Hugging Face checkpoint directory, read from its
    `config.json` without torch (the same defaults as `ModelConfig.from_hf`)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    num_heads = cfg["num_attention_heads"]
    archs = set(cfg.get("architectures") or [])
    return architecture_fingerprint(
        {
            "hidden_size": cfg["hidden_size"],
            "intermediate_size": cfg["intermediate_size"],
            "num_layers": cfg["num_hidden_layers"],
            "num_heads": num_heads,
            "num_kv_heads": cfg.get("num_key_value_heads") or num_heads,
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            "vocab_size": cfg["vocab_size"],
            "num_output_tokens": cfg.get("augury_num_output_tokens"),
            "embedding_rank": cfg.get("augury_embedding_rank"),
            "feature_size": cfg.get("augury_feature_size"),
            "has_qkv_bias": bool(cfg.get("attention_bias", False)) or "Qwen2ForCausalLM" in archs,
        }
    )


def cpu_name() -> str:
    """ "cpu: <model name>" from /proc/cpuinfo (the platform's processor name elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return "cpu: " + (platform.processor() or platform.machine() or "unknown")


def load_matching(
    path: str | Path,
    key: ProfileKey,
    drafts: Mapping[str, ProfileKey] | Iterable[ProfileKey] = (),
) -> CostProfile:
    """Load the profile at `path`; raise `ProfileMismatchError` (naming the differing field) if it
    was measured for another target or draft fingerprint, device, dtype or thread count, or lacks
    one of `drafts` (by name; an iterable of keys is taken by their `model`)."""
    profile = CostProfile.load(path)
    profile.check(key, drafts, path=path)
    return profile


def find_profile(
    directory: str | Path,
    key: ProfileKey,
    drafts: Mapping[str, ProfileKey] | Iterable[ProfileKey] = (),
) -> CostProfile | None:
    """The newest (by `created`) profile in `directory/*.json` that `load_matching` accepts, or
    None. Files that are not profiles, or that were measured elsewhere, are skipped (logged)."""
    drafts = dict(drafts) if isinstance(drafts, Mapping) else {k.model: k for k in drafts}
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found: list[CostProfile] = []
    for path in sorted(directory.glob("*.json")):
        try:
            found.append(load_matching(path, key, drafts))
        except ProfileMismatchError as e:
            log.debug("skipping %s", e)
        except (OSError, ValueError) as e:  # not a profile (pydantic errors are ValueErrors)
            log.info("skipping %s: not a cost profile (%s)", path, str(e).splitlines()[0])
    return max(found, key=lambda p: p.created, default=None)
