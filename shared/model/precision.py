"""Lower precision for the target on a CPU: bf16 where the CPU multiplies bf16 natively, int8
weights anywhere PyTorch multiplies int8 matrices.

A CPU forward of a big target is bound by the bytes of its weights; bf16 halves them, and CPUs
with AMX (`amx_bf16`) or AVX-512 BF16 (`avx512_bf16`) multiply bf16 without converting each
operand back to fp32. Elsewhere bf16 runs slower than fp32, so it is refused there. The `int8`
target dtype quarters them instead: linear layers and the output head hold int8 weights and
quantize each token's activations on their own (`shared/model/quantized.py`); norms, attention
and the residual stream stay fp32. Speculation stays exact *at that precision*: the drafts'
tokens are verified against the bf16 or int8 target, whose greedy output is what plain decoding
at that precision gives; it may depart from fp32's greedy output where two tokens are nearly
tied (bf16) or where quantization moves a choice (int8).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shared.model.quantized import int8_supported

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_bf16_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """Which of `BF16_CPU_FLAGS` this CPU has (empty where /proc/cpuinfo is unreadable)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return [f for f in BF16_CPU_FLAGS if f in flags]
    return []


TARGET_DTYPES = ("float32", "bfloat16", "int8")


@dataclass(frozen=True)
class TargetPrecision:
    """How a target computes: `dtype` for its activations and every weight that is not an int8
    linear layer's; `int8`: its linear layers and output head run int8 weights with one int8
    scale per token (`shared/model/quantized.py`)."""

    dtype: torch.dtype
    int8: bool = False


def check_target_precision(
    name: str, device: str | torch.device, *, setting: str
) -> TargetPrecision:
    """The precision a target dtype setting names: float32, bfloat16 (on a CPU only with AMX or
    AVX-512 BF16) or int8 (on a CPU only, fp32 elsewhere); refused naming `setting`."""
    if name not in TARGET_DTYPES:
        raise ValueError(f"{setting} must be one of {', '.join(TARGET_DTYPES)}, not {name!r}")
    if name == "int8":
        if not int8_supported(device, per_token=True):
            raise ValueError(
                f"{setting} int8 needs a CPU whose PyTorch multiplies int8 matrices "
                f"(torch._int_mm), not {device}"
            )
        return TargetPrecision(torch.float32, int8=True)
    if name == "bfloat16" and torch.device(device).type == "cpu" and not cpu_bf16_flags():
        raise ValueError(
            f"{setting} bfloat16 needs a CPU with AMX or AVX-512 BF16 (flag "
            f"{' or '.join(BF16_CPU_FLAGS)}); this one has neither: bf16 would run slower "
            "than float32 (int8 runs int8 weights instead)"
        )
    return TargetPrecision(getattr(torch, name))
