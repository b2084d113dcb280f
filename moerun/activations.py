"""Expert activations: each maps the fused gate/up projection [R, 2I] to [R, I].

The GLU kinds read gate from the first I columns and up from the last I; GPT-OSS's clamped SwiGLU
reads them interleaved (gate in even columns, up in odd), as its checkpoints store them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

_GATE_FUNCTIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

# Hugging Face `hidden_act` names and what they mean here.
HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}


@dataclass(frozen=True)
class GLU:
    """act(gate) * up, gate = columns [0, I), up = columns [I, 2I)."""

    gate_fn: Literal["silu", "gelu", "gelu_tanh"] = "silu"
    interleaved: ClassVar[bool] = False  # gate_up's columns (and rows) are gate's then up's

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return _GATE_FUNCTIONS[self.gate_fn](gate) * up

    @classmethod
    def from_hf(cls, hidden_act: str) -> GLU:
        if hidden_act not in HF_ACTIVATIONS:
            raise ValueError(f"hidden_act={hidden_act!r} is not supported; known: {sorted(HF_ACTIVATIONS)}.")
        return cls(HF_ACTIVATIONS[hidden_act])


@dataclass(frozen=True)
class GptOssSwiGLU:
    """GPT-OSS: gate = even columns clamped above at `limit`, up = odd columns clamped to ±limit,
    out = (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float = 1.702
    limit: float = 7.0
    interleaved: ClassVar[bool] = True  # gate_up's columns (and rows) alternate gate and up

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


Activation = GLU | GptOssSwiGLU
