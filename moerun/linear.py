"""y = x · Wᵀ (+ b): every projection of a model (attention, dense and shared MLPs, lm_head), with W
dense [out, in] or quantised (a QTensor of the file's bytes).

On a CPU with the native kernel layer (moerun.cpu; `native=True`, chosen once at load) the weights
stay in the file's format: a few rows of x (decode, a server's small batches) and every quantised
weight go through its kernels, `integer` choosing int8 activations or exact fp32 ones. Many rows of
a dense weight go through torch's GEMM (oneDNN), which is compute-bound work the native layer does
not beat yet. The choice depends only on shapes and formats, never on the CPU, so two machines run
the same path. Without the native layer the weights are dense (quantised ones are dequantised at
load) and torch computes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moerun import cpu
from moerun.quant.formats import QTensor

Weight = torch.Tensor | QTensor
Linear = Callable[..., torch.Tensor]  # linear, or linear with native and integer bound

# Rows of x up to which the MoE layer's dense experts go through the native kernels: each expert
# sees a few of the step's tokens, memory-bound work where they read its rows once for all of them.
NATIVE_ROWS = 16
# Rows of x up to which a dense projection goes through the native kernels. Their dense row kernel
# computes ~30 GMAC/s on 2 Zen 5 cores whatever the rows (bf16, 8192 x 2048: 0.77 ms at 1 row, 4.1 ms
# at 8), so past two rows torch's GEMM is faster (the 50304-row lm_head: at 4 rows 14 ms, native 17;
# at 8, 16 ms and 29).
NATIVE_DENSE_ROWS = 2
_FORMAT_OF_DTYPE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def native_weight(weight: Weight) -> tuple[str, torch.Tensor]:
    """(format name, rows) as moerun.cpu takes them: quantised bytes or the dense tensor itself."""
    if isinstance(weight, QTensor):
        return weight.format.name, weight.data
    return _FORMAT_OF_DTYPE[weight.dtype], weight


def linear(
    x: torch.Tensor,
    weight: Weight,
    bias: torch.Tensor | None = None,
    native: bool = False,
    integer: bool = False,
) -> torch.Tensor:
    """x [..., in] -> [..., out] in x's dtype (computed in fp32 on the native path)."""
    rows = x.numel() // x.shape[-1]
    if native and (isinstance(weight, QTensor) or rows <= NATIVE_DENSE_ROWS):
        fmt, data = native_weight(weight)
        y = cpu.matmul(fmt, data, x.reshape(rows, x.shape[-1]).float(), integer=integer)  # [rows, out] fp32
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])
    # torch's own choice of kernel: a 1-row bf16 torch.mv read the weight 1.4x faster than F.linear
    # on a Xeon but 3x slower on a Zen 5 (docs/PERFORMANCE.md), so neither is preferred here
    return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)
