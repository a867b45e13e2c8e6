"""Rotary position embedding frequencies of the rope types LLaMA-family checkpoints use.

`RopeScaling` is a checkpoint's `rope_scaling` / `rope_parameters` entry (everything but θ);
`inverse_frequencies` turns it into the per-pair frequencies and the factor cos/sin are scaled
by, the same numbers transformers computes for `default`, `linear`, `llama3`, `dynamic` and
`yarn` (formulas from the papers: position interpolation, Llama 3.1's smooth low-frequency
scaling, dynamic NTK, YaRN).

`dynamic` (NTK) changes θ once a sequence grows past the pretraining context, so a key cached
early would be rotated differently from one computed later: its checkpoints are served within
their pretraining context (`max_position_embeddings`), where dynamic scaling is the default RoPE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # one of ROPE_TYPES, never "default" (then there is no RopeScaling)
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None
) -> tuple[torch.Tensor, float]:
    """[head_dim / 2] inverse frequencies (fp32) and the factor applied to cos and sin."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None or scaling.rope_type == "dynamic":
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if scaling.rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    raise ValueError(f"rope type {scaling.rope_type!r} is not one of {ROPE_TYPES}")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than original_context / low_freq_factor are stretched by
    `factor`, shorter than original_context / high_freq_factor kept, the band between blended."""
    assert s.original_max_position_embeddings is not None
    old_context = s.original_max_position_embeddings
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies by `factor`, keep the high ones, ramp between the
    dimensions that turn beta_fast and beta_slow times over the original context; cos and sin
    are scaled by the attention factor."""
    assert s.original_max_position_embeddings is not None
    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(
                s.factor, s.mscale_all_dim
            )
        else:
            attention_factor = _yarn_mscale(s.factor)
    original = s.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a one-dimension ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (s.factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, float(attention_factor)
