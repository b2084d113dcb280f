"""RMSNorm and LayerNorm (PhiMoE), computed in fp32 and returned in the input's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] * rsqrt(mean(x^2) + eps) * weight [D]."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """(x [..., D] - mean) * rsqrt(variance + eps) * weight [D] + bias [D], as torch's nn.LayerNorm."""
    return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps).to(x.dtype)


def normed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """A model's norm: RMSNorm without a bias (ModelConfig.norm "rms"), LayerNorm with one ("layer")."""
    return rms_norm(x, weight, eps) if bias is None else layer_norm(x, weight, bias, eps)
