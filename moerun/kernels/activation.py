"""Expert activations inside kernels: the same functions as moerun.activations, in Triton.

A kernel computing output column j of the activation reads gate_up row `j * ROW_STEP` (gate) and
`j * ROW_STEP + UP_OFFSET` (up): (1, I) for the GLU kinds (gate in rows [0, I), up in [I, 2I)) and
(2, 1) for GPT-OSS's interleaved rows. `activation_args(act, intermediate)` gives the constexprs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moerun.activations import GLU, Activation, GptOssSwiGLU

_GLU_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
_GPT_OSS_CODE = 3
# the codes as the kernel compares them: compiled Triton reads no module globals but tl.constexpr ones
SILU, GELU, GELU_TANH = (tl.constexpr(code) for code in _GLU_CODES.values())


def activation_args(act: Activation, intermediate: int) -> dict:
    """Keyword arguments for a kernel taking ACT, ROW_STEP, UP_OFFSET, alpha and limit."""
    if isinstance(act, GptOssSwiGLU):
        return dict(ACT=_GPT_OSS_CODE, ROW_STEP=2, UP_OFFSET=1, alpha=act.alpha, limit=act.limit)
    if isinstance(act, GLU):
        return dict(ACT=_GLU_CODES[act.gate_fn], ROW_STEP=1, UP_OFFSET=intermediate, alpha=0.0, limit=0.0)
    raise TypeError(f"no kernel activation for {act!r}")


@triton.jit
def activate(gate, up, alpha, limit, ACT: tl.constexpr):
    """fp32 gate, up (same shape) -> fp32 activation."""
    if ACT == SILU:
        out = gate * tl.sigmoid(gate) * up
    elif ACT == GELU:
        out = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up
    elif ACT == GELU_TANH:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        out = gate * tl.sigmoid(2.0 * inner) * up  # 0.5 * (1 + tanh(y)) == sigmoid(2y)
    else:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    return out
