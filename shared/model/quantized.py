"""Int8 weights for draft models on the CPU.

A CPU forward of a small model is bound by the bytes its weights take to stream from memory:
one `draft-e` step reads 36 MB of fp32 weights to compute 9 M multiply-adds. Stored as int8 (one
scale per output row), the same weights take a quarter of the bytes and often fit in the
cache; PyTorch's FBGEMM kernel (`quantized::linear_dynamic`) quantizes each call's activations
on the fly and runs the product in integers. Drafts may use it because a draft's numbers never
reach a client: the target verifies every drafted token against its own exact distribution
(greedy and sampled verification alike use the draft distribution the draft actually computed),
so a quantized draft can only change how often drafts are accepted, never the output.

A target may run int8 too, as its own precision (`Int8TokenLinear`, the `int8` target dtype):
its output is then the int8 target's, and speculation must round every token as plain decoding
does, so activations are quantized one token at a time and multiplied exactly in integers.

`int8_available()` says whether this PyTorch build has the kernel (FBGEMM, x86 CPUs);
`Int8Linear` is one layer; `LlamaModel.quantize_int8()` applies it to the decoder layers and the
output head; `uses_int8` turns the `draft_weights` setting into a yes or no for one device.

The input projection of a feature-level draft (`feature_fc`) stays in full precision: its input
is a token embedding (values around 0.05) beside a target feature (values around 1, with
outliers), and one activation scale for both rounds the embedding away; quantized, it took
`draft-e`'s chain-4 acceptance from 2.02 to 1.62 tokens per forward. A feature-level draft's
output head keeps the `HEAD_OUTLIER_CHANNELS` largest input channels of each call in fp32: its
input is a predicted target feature, whose largest channel reaches 34 where a typical channel's
largest value is about 3; with it `draft-e`'s 16-node tree accepts 2.73 tokens per forward on 24
prompts, against 2.69 without and 2.75 in fp32. Token-level drafts accept the same with or
without it, so their heads skip its cost (0.1-0.2 ms a step).
"""

from __future__ import annotations

import warnings
from typing import get_args

import torch
from torch import nn

from shared.settings import DraftWeights


def int8_available() -> bool:
    """True where PyTorch can run dynamic int8 linear layers (the FBGEMM engine, x86 CPUs)."""
    return (
        "fbgemm" in torch.backends.quantized.supported_engines
        and hasattr(torch.ops.quantized, "linear_dynamic")
        and hasattr(torch, "quantize_per_channel")
    )


class Int8Linear:
    """`F.linear(x, W, b)` with W stored as symmetric int8, one fp32 scale per output row.

    Activations are quantized per call (asymmetric uint8, one scale for the whole input, 7 bits
    wide so that no FBGEMM kernel can overflow on CPUs without VNNI); accumulation is int32.
    Relative error of the product against fp32 is about 2% on a draft's layers.

    With `num_outliers` = k > 0, each call takes the k input channels of largest magnitude out of
    the int8 product and multiplies them in fp32 (LLM.int8()'s decomposition, with the channels
    chosen per call): one activation scale then serves the typical channels only. It reads k
    rows of a transposed fp32 copy of W per call.
    """

    __slots__ = ("num_outliers", "packed", "weight_t")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, num_outliers: int = 0
    ) -> None:
        if torch.backends.quantized.engine != "fbgemm":
            # The packed weight's format is the engine's; pick FBGEMM once, process-wide.
            torch.backends.quantized.engine = "fbgemm"
        w = weight.detach().float().cpu()
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zero_points = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            # PyTorch 2.13 marks quantized tensor creation deprecated; the packed weight is the
            # only way into FBGEMM's kernel. Should a release drop it, `int8_available` is
            # False there and `auto` falls back to the drafts' own weights.
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
        b = None if bias is None else bias.detach().float().cpu()
        self.packed = torch.ops.quantized.linear_prepack(qweight, b)
        self.num_outliers = min(num_outliers, w.shape[1])
        self.weight_t = w.t().contiguous() if self.num_outliers else None  # [in, out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x [n, in] -> [n, out], computed from fp32 activations, returned in x's dtype
        x32 = x.float().contiguous()
        if not self.num_outliers:
            return torch.ops.quantized.linear_dynamic(x32, self.packed, True).to(x.dtype)
        assert self.weight_t is not None
        outliers = x32.abs().amax(dim=0).topk(self.num_outliers).indices  # [k]
        typical = x32.index_fill(1, outliers, 0.0)
        y = torch.ops.quantized.linear_dynamic(typical, self.packed, True)
        y = y.addmm_(x32[:, outliers], self.weight_t[outliers])
        return y.to(x.dtype)


class Int8TokenLinear:
    """`F.linear(x, W, b)` with W stored as symmetric int8 (one scale per output row) and each
    row of x quantized on its own (symmetric int8, one scale per token): for targets.

    A target's speculative output must equal its plain decoding, so a token's result may not
    depend on the other tokens of its forward. Here it cannot: the scale is the row's own, the
    product accumulates in int32 exactly (`torch._int_mm`), and the rescaling is elementwise.
    `Int8Linear`'s one activation scale per call would round a tree's tokens by the largest
    value among them.
    """

    __slots__ = ("bias", "scales", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        w = weight.detach().float().cpu()
        self.scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [out]
        self.weight = (w / self.scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        self.bias = None if bias is None else bias.detach().float().cpu()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x [n, in] -> [n, out], returned in x's dtype
        x32 = x.float()
        row_scales = (x32.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12)  # [n, 1]
        xq = (x32 / row_scales).round_().to(torch.int8)
        y = torch._int_mm(xq, self.weight.t()).float().mul_(row_scales).mul_(self.scales)
        if self.bias is not None:
            y.add_(self.bias)
        return y.to(x.dtype)


def quantized_linear(module: nn.Linear, num_outliers: int = 0) -> Int8Linear:
    return Int8Linear(module.weight, module.bias, num_outliers)


def int8_token_available() -> bool:
    """True where PyTorch multiplies int8 matrices on the CPU (`torch._int_mm`)."""
    try:
        a = torch.ones(1, 8, dtype=torch.int8)
        return bool(torch._int_mm(a, a.t()).item() == 8)
    except (AttributeError, RuntimeError):
        return False


def int8_supported(device: str | torch.device, *, per_token: bool) -> bool:
    """Whether int8 weights run on `device`: a CPU with PyTorch's int8 matrix product (a
    target's `Int8TokenLinear`, `per_token`) or with its FBGEMM kernels (a draft's)."""
    if torch.device(device).type != "cpu":
        return False
    return int8_token_available() if per_token else int8_available()


HEAD_OUTLIER_CHANNELS = 8
DRAFT_WEIGHTS: tuple[str, ...] = get_args(DraftWeights)  # `engine.draft_weights`'s values


def uses_int8(setting: str, device: str | torch.device) -> bool:
    """Whether a draft on `device` runs int8 weights: `native` never, `int8` always (an error
    where the kernels are missing), `auto` on a CPU that has them."""
    if setting not in DRAFT_WEIGHTS:
        raise ValueError(f"draft weights must be one of {DRAFT_WEIGHTS}, not {setting!r}")
    supported = int8_supported(device, per_token=False)
    if setting == "int8" and not supported:
        raise ValueError(
            f"draft weights int8 need PyTorch's FBGEMM kernels on an x86 CPU, not {device}"
        )
    return setting != "native" and supported
