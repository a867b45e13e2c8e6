"""Lower precision for the target on a CPU: bf16 where the CPU multiplies bf16 natively.

A CPU forward of a big target is bound by the bytes of its weights; bf16 halves them, and CPUs
with AMX (`amx_bf16`) or AVX-512 BF16 (`avx512_bf16`) multiply bf16 without converting each
operand back to fp32. Elsewhere bf16 runs slower than fp32, so it is refused there. Speculation
stays exact *at that precision*: the drafts' tokens are verified against the bf16 target, whose
greedy output is what plain decoding in bf16 gives; it may depart from fp32's greedy output
where two tokens are nearly tied.
"""

from __future__ import annotations

from pathlib import Path

import torch

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


def check_target_dtype(dtype: str, device: str | torch.device, *, setting: str) -> torch.dtype:
    """The torch dtype for a target; bf16 on a CPU needs AMX or AVX-512 BF16 (refused naming
    `setting` otherwise)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"{setting} must be float32 or bfloat16, not {dtype!r}")
    if dtype == "bfloat16" and torch.device(device).type == "cpu" and not cpu_bf16_flags():
        raise ValueError(
            f"{setting} bfloat16 needs a CPU with AMX or AVX-512 BF16 (flag "
            f"{' or '.join(BF16_CPU_FLAGS)}); this one has neither: bf16 would run slower "
            "than float32"
        )
    return getattr(torch, dtype)
