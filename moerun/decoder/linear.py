"""Linear projections of the decoder stack."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except that a single row on CPU goes through torch.mv: its bf16 path reads the
    weight ~1.4x faster than a 1-row GEMM on the machines we measured (docs/PERFORMANCE.md), and a
    decode step is one row."""
    if x.device.type == "cpu" and x.numel() == x.shape[-1] and x.dtype == weight.dtype:
        y = torch.mv(weight, x.reshape(-1))
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
