"""y = x · Wᵀ (+ b): every projection of a model (attention, dense and shared MLPs, lm_head), with W
dense [out, in] or quantised (a QTensor of the file's bytes).

On a CPU with the native kernel layer (moerun.cpu; `native_linear`, the cpu backend's) the weights
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
Linear = Callable[..., torch.Tensor]  # (x, weight, bias=None) -> y: a backend's `linear`

# Rows of x up to which the MoE layer's dense experts go through the native kernels: each expert
# sees a few of the step's tokens, memory-bound work where they read its rows once for all of them.
NATIVE_ROWS = 16
# Rows of x up to which a dense projection goes through the native kernels (fp32 activations, the
# same bits for a row whatever the rows around it). On 2 Zen 4 cores their row kernel (blocks of
# rows x tokens, ~70-80 GMAC/s from 4 rows) beats torch's bf16 GEMM up to 4 rows (lm_head 50304 x
# 2048 at 4 rows: 7.7 ms against 10.3; 2048 x 2048: 0.25 ms against 0.30), ties at 8 on the lm_head
# and loses at 8 on 2048 x 2048 (0.46 ms against 0.39): oneDNN's brg_matmul:avx512_core_bf16 takes x
# in bf16 and does two multiply-adds a lane an instruction (docs/PERFORMANCE.md, 2026-12-02).
NATIVE_DENSE_ROWS = 4
_FORMAT_OF_DTYPE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def native_weight(weight: Weight) -> tuple[str, torch.Tensor]:
    """(format name, rows) as moerun.cpu takes them: quantised bytes or the dense tensor itself."""
    if isinstance(weight, QTensor):
        return weight.format.name, weight.data
    return _FORMAT_OF_DTYPE[weight.dtype], weight


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out] in x's dtype, in torch (dense weights)."""
    # torch's own choice of kernel: a 1-row bf16 torch.mv read the weight 1.4x faster than F.linear
    # on a Xeon but 3x slower on a Zen 5 (docs/PERFORMANCE.md), so neither is preferred here
    return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)


def native_linear(
    x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None, integer: bool = False
) -> torch.Tensor:
    """x [..., in] -> [..., out] in x's dtype, on the native kernels (computed in fp32) where the
    weight is quantised or x has few rows, else in torch; `integer`: int8 activations."""
    rows = x.numel() // x.shape[-1]
    if not isinstance(weight, QTensor) and rows > NATIVE_DENSE_ROWS:
        return linear(x, weight, bias)
    fmt, data = native_weight(weight)
    y = cpu.matmul(fmt, data, x.reshape(rows, x.shape[-1]).float(), integer=integer)  # [rows, out] fp32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])
