"""Model runtime: our own LLaMA-family forward pass over a packed batch, and its loaders."""

from shared.model.config import ModelConfig
from shared.model.llama import LlamaModel
from shared.model.loader import load_model, load_target

__all__ = ["LlamaModel", "ModelConfig", "load_model", "load_target"]
