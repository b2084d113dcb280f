"""The Triton decode step: one token through its k experts, read through a slot table.

Owns the decode launches and their torch references (same signatures, `*_reference`):
`gate_up_experts` (gate and up of all k experts, one launch), `activate_weighted` (activation times
the routing weight), `down_experts` (down of all k experts plus the bias times the routing weight),
`sum_rows` (the ordered row sum) and `decode_step`, which chains them.

How activations reach the two projections is one spec, `ActivationFormat`: float rows, which
`_experts_gemv_kernel` multiplies with weights of any format dequantised in the kernel, or q8_1 rows
(moerun.quant.q8_1: blocks of 32 int8 with an fp16 scale and scaled sum), which the integer kernel of
`moerun.kernels.decode_q8_1` multiplies with the block formats of its Q8_1_GROUP_BYTES. The projections
take their input in either form (a tensor or a Q8_1) and launch through one launcher, `_gemv`;
`activate_weighted` writes its output in the form asked for; `decode_step` picks the form per projection.

Every launch takes tensors only: the slot table `slots` int32 [k] (index of each expert's weights in
the weight tensor's first dim: the expert ids when all experts are resident, cache slots when
streaming), `experts` int32 [k] (expert ids, for the resident biases), the routing `weights` fp32
[k] and x live in fixed buffers, so the step can be captured in a CUDA graph. Block sizes and
num_warps come in one `config` dict per launch (defaults from `moerun.kernels.configs`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moerun.activations import Activation
from moerun.kernels.activation import activate, activation_args
from moerun.kernels.configs import default_config, merge_config
from moerun.kernels.decode_q8_1 import (
    GEMV_Q8_1_CONFIG,
    Q8_1_GROUP_BYTES,
    QK,
    empty_q8_1,
    experts_gemv_q8_1_kernel,
    quantize_rows_q8_1,
    store_q8_1,
)
from moerun.kernels.weights import FORMAT_NAMES, KernelWeight, load_weight_tile
from moerun.quant.formats import get_format
from moerun.quant.q8_1 import Q8_1, dot_q8_1, quantize_q8_1

GEMV_CONFIG = default_config("decode_gate_up")
ACTIVATION_CONFIG = default_config("decode_activate")  # BLOCK_I: a multiple of 32
SUM_CONFIG = default_config("decode_sum")
DECODE_CONFIG = {
    "gate_up": GEMV_CONFIG,
    "activate": ACTIVATION_CONFIG,
    "down": GEMV_CONFIG,
    "gate_up_q8_1": GEMV_Q8_1_CONFIG,
    "down_q8_1": GEMV_Q8_1_CONFIG,
    "sum": SUM_CONFIG,
}


class ActivationFormat(enum.Enum):
    """How a projection's input activations reach its kernel."""

    FLOAT = "float"  # float rows (x in the compute dtype, a in fp32); weights of any format
    Q8_1 = "q8_1"  # q8_1 rows (a Q8_1); integer dot products, weights of a Q8_1_GROUP_BYTES format

    @classmethod
    def of(cls, rows: torch.Tensor | Q8_1) -> ActivationFormat:
        return cls.Q8_1 if isinstance(rows, Q8_1) else cls.FLOAT

    @classmethod
    def for_weight(cls, weight: KernelWeight, int8: bool) -> ActivationFormat:
        """Q8_1 where integer activations are asked for and the weight's format has a q8_1 kernel."""
        return cls.Q8_1 if int8 and weight.fmt in Q8_1_GROUP_BYTES else cls.FLOAT

    def config_key(self, projection: str) -> str:
        """The key of DECODE_CONFIG for `projection` ("gate_up" or "down") taking these activations."""
        return projection if self is ActivationFormat.FLOAT else f"{projection}_{self.value}"


def check_table(slots: torch.Tensor, experts: torch.Tensor) -> int:
    if slots.dtype != torch.int32 or experts.dtype != torch.int32 or slots.shape != experts.shape:
        raise ValueError(
            f"slots and experts must be int32 tensors of the same shape [k]; got {slots.dtype} "
            f"{tuple(slots.shape)} and {experts.dtype} {tuple(experts.shape)}."
        )
    return slots.shape[0]


def check_bias(bias: torch.Tensor | None, n: int, what: str) -> torch.Tensor | None:
    if bias is not None and (bias.ndim != 2 or bias.shape[1] != n):
        raise ValueError(f"{what} bias must be [E, {n}]; got {tuple(bias.shape)}.")
    return None if bias is None else bias.contiguous()


def _quants(rows: torch.Tensor | Q8_1) -> torch.Tensor:
    """Float rows as they are, q8_1 rows' int8 quants: the tensor of the rows' shape and device."""
    return rows.qs if isinstance(rows, Q8_1) else rows


# ---------------------------------------------------------------- the projections


@triton.jit
def _experts_gemv_kernel(
    x_ptr, x_row_stride, slots_ptr, experts_ptr, weights_ptr, w_ptr, row_stride, expert_stride,
    table_ptr, bias_ptr, out_ptr, N, K,
    FMT: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Float activations: out[i, n] = sum_c W_{slots[i]}[n, c] * x[i, c] (+ bias[experts[i], n],
    times weights[i] with SCALE_BIAS). Grid (k, cdiv(N, BLOCK_N)).

    x: float [k, K] rows `x_row_stride` elements apart (0: one row shared by all k). slots, experts:
    int32 [k]. weights: fp32 [k]. w: KernelWeight data (any format load_weight_tile reads), table:
    its format's lookup table (KernelWeight.table). bias: float [E, N]. out: fp32 [k, N]."""
    i = tl.program_id(0)
    n_offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    w_expert = w_ptr + slot * expert_stride
    x_row = x_ptr + i * x_row_stride
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_offs = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_row + k_offs, mask=k_offs < K, other=0.0).to(tl.float32)  # [BK]
        tile = load_weight_tile(w_expert, row_stride, n_offs, k_offs, N, K, table_ptr, FMT)  # [BK, BN]
        acc += tl.sum(tile * xk[:, None], axis=0)
    if HAS_BIAS:
        expert = tl.load(experts_ptr + i).to(tl.int64)
        bias = tl.load(bias_ptr + expert * N + n_offs, mask=n_offs < N, other=0.0).to(tl.float32)
        if SCALE_BIAS:
            bias = bias * tl.load(weights_ptr + i)
        acc += bias
    tl.store(out_ptr + i * N + n_offs, acc, mask=n_offs < N)


def _gemv(x, slots, experts, weights, w: KernelWeight, bias, config) -> torch.Tensor:
    """The projection `w` of the k experts of the slot table, one launch -> fp32 [k, N].

    x: float or Q8_1 rows, [K] (one row for all k) or [k, K] (row i for expert i). weights: fp32 [k],
    which scale the bias, or None (the bias as it is). The kernel is x's ActivationFormat's."""
    k = slots.shape[0]
    x_row_stride = 0 if _quants(x).ndim == 1 else w.k
    out = torch.empty(k, w.n, dtype=torch.float32, device=_quants(x).device)
    bias_ptr = out if bias is None else bias
    weights_ptr = slots if weights is None else weights  # not read without a scaled bias
    flags = dict(FMT=w.fmt, HAS_BIAS=bias is not None, SCALE_BIAS=weights is not None)
    name = FORMAT_NAMES[w.fmt]
    if ActivationFormat.of(x) is ActivationFormat.Q8_1:
        if w.fmt not in Q8_1_GROUP_BYTES:
            supported = ", ".join(FORMAT_NAMES[f] for f in Q8_1_GROUP_BYTES)
            raise ValueError(f"no q8_1 kernel for {name} weights; supported: {supported}.")
        cfg = merge_config(GEMV_Q8_1_CONFIG, config)
        experts_gemv_q8_1_kernel[(k, triton.cdiv(w.n, cfg["BLOCK_N"]))](
            x.qs.contiguous(), x.d.contiguous(), x.s.contiguous(), x_row_stride, slots, experts, weights_ptr,
            w.data, w.row_stride, w.expert_stride, w.table, bias_ptr, out, w.n, w.k,
            **flags, GROUP_BYTES=Q8_1_GROUP_BYTES[w.fmt], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
        )  # fmt: skip
        return out
    cfg = merge_config(GEMV_CONFIG, config)
    if cfg["BLOCK_K"] % get_format(name).block_size:
        raise ValueError(
            f"BLOCK_K={cfg['BLOCK_K']} must be a multiple of {name}'s block of {get_format(name).block_size}."
        )
    _experts_gemv_kernel[(k, triton.cdiv(w.n, cfg["BLOCK_N"]))](
        x.contiguous(), x_row_stride, slots, experts, weights_ptr, w.data, w.row_stride, w.expert_stride,
        w.table, bias_ptr, out, w.n, w.k,
        **flags, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out


def gate_up_experts(
    x: torch.Tensor | Q8_1,
    slots: torch.Tensor,
    experts: torch.Tensor,
    gate_up: KernelWeight,
    gate_up_bias: torch.Tensor | None,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """x [H], floats or their Q8_1 -> h fp32 [k, 2I] = W_{slots[i]} x (+ gate_up_bias[experts[i]]),
    one launch (with a Q8_1, integer dot products: see moerun.quant.q8_1.dot_q8_1)."""
    check_table(slots, experts)
    if _quants(x).shape != (gate_up.k,):
        raise ValueError(f"gate_up_experts takes one token x [{gate_up.k}]; got {tuple(_quants(x).shape)}.")
    bias = check_bias(gate_up_bias, gate_up.n, "gate_up")
    return _gemv(x, slots, experts, None, gate_up, bias, config)


def down_experts(
    a: torch.Tensor | Q8_1,
    slots: torch.Tensor,
    experts: torch.Tensor,
    down: KernelWeight,
    down_bias: torch.Tensor | None,
    weights: torch.Tensor,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """a [k, I] (already times the routing weights), fp32 or its Q8_1 -> y fp32 [k, H] =
    W_{slots[i]} a[i] (+ weights[i] * down_bias[experts[i]]), one launch."""
    k = check_table(slots, experts)
    if _quants(a).shape != (k, down.k):
        raise ValueError(f"down_experts takes a [{k}, {down.k}]; got {tuple(_quants(a).shape)}.")
    bias = check_bias(down_bias, down.n, "down")
    return _gemv(a, slots, experts, weights, down, bias, config)


def _product(w: KernelWeight, slot: int, x: torch.Tensor | Q8_1) -> torch.Tensor:
    """W_slot x, fp32 [N]: on the dequantised weights in fp32, or with a Q8_1 by dot_q8_1."""
    if isinstance(x, Q8_1):
        return dot_q8_1(FORMAT_NAMES[w.fmt], w.data[slot], x)
    return w.values(slot) @ x.float()


def _row(a: torch.Tensor | Q8_1, i: int) -> torch.Tensor | Q8_1:
    return Q8_1(qs=a.qs[i], d=a.d[i], s=a.s[i]) if isinstance(a, Q8_1) else a[i]


def gate_up_experts_reference(x, slots, experts, gate_up, gate_up_bias, config=None) -> torch.Tensor:
    rows = []
    for slot, e in zip(slots.tolist(), experts.tolist(), strict=True):
        h = _product(gate_up, slot, x)
        rows.append(h if gate_up_bias is None else h + gate_up_bias[e].float())
    return torch.stack(rows)


def down_experts_reference(a, slots, experts, down, down_bias, weights, config=None) -> torch.Tensor:
    rows = []
    for i, (slot, e) in enumerate(zip(slots.tolist(), experts.tolist(), strict=True)):
        y = _product(down, slot, _row(a, i))
        rows.append(y if down_bias is None else y + weights[i] * down_bias[e].float())
    return torch.stack(rows)


# ---------------------------------------------------------------- activation, row sum


@triton.jit
def _activate_kernel(
    h_ptr, weights_ptr, a_ptr, qs_ptr, d_ptr, s_ptr, I, alpha, limit,
    ACT: tl.constexpr, ROW_STEP: tl.constexpr, UP_OFFSET: tl.constexpr,
    Q8_1: tl.constexpr, GROUPS: tl.constexpr,
):  # fmt: skip
    """a[i, j] = weights[i] * act(h[i, gate j], h[i, up j]), written as fp32 or as q8_1.
    Grid (k, cdiv(I, 32 * GROUPS)); each program covers GROUPS blocks of 32 columns.

    h: fp32 [k, 2I]. weights: fp32 [k]. a: fp32 [k, I] (Q8_1 false). With Q8_1 (I a multiple of 32),
    as moerun.quant.q8_1.quantize_q8_1: qs int8 [k, I]; d, s fp32 [k, I / 32], fp16 values."""
    i = tl.program_id(0)
    blocks = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [G]
    cols = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]  # [G, 32]
    mask = cols < I
    h_row = h_ptr + i * 2 * I
    gate = tl.load(h_row + cols * ROW_STEP, mask=mask, other=0.0)
    up = tl.load(h_row + cols * ROW_STEP + UP_OFFSET, mask=mask, other=0.0)
    a = tl.load(weights_ptr + i) * activate(gate, up, alpha, limit, ACT)  # [G, 32]
    if Q8_1:
        store_q8_1(a, blocks, I, qs_ptr + i * I, d_ptr + i * (I // 32), s_ptr + i * (I // 32), GROUPS)
    else:
        tl.store(a_ptr + i * I + cols, a, mask=mask)


def activate_weighted(
    h: torch.Tensor,
    weights: torch.Tensor,
    act: Activation,
    output: ActivationFormat = ActivationFormat.FLOAT,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor | Q8_1:
    """h fp32 [k, 2I] -> a = weights[:, None] * act(h), fp32 [k, I] or (output Q8_1) its Q8_1, one launch.

    The q8_1 rows are bit-exact `quantize_q8_1` of the float a, except that a block whose scales
    overflow fp16 is written as inf instead of raising (no host read-back in the decode step)."""
    cfg = merge_config(ACTIVATION_CONFIG, config)
    if cfg["BLOCK_I"] % QK:
        raise ValueError(f"BLOCK_I={cfg['BLOCK_I']} must be a multiple of {QK}.")
    k, two_i = h.shape
    intermediate = two_i // 2
    q8_1 = output is ActivationFormat.Q8_1
    if q8_1 and intermediate % QK:
        raise ValueError(f"q8_1 activations need I a multiple of {QK}; got I={intermediate}.")
    h = h.contiguous()
    a = torch.empty(k, intermediate, dtype=torch.float32, device=h.device)
    q = empty_q8_1((k, intermediate), h.device) if q8_1 else Q8_1(a, a, a)
    grid = (k, triton.cdiv(intermediate, cfg["BLOCK_I"]))
    _activate_kernel[grid](
        h, weights, a, q.qs, q.d, q.s, intermediate, **activation_args(act, intermediate),
        Q8_1=q8_1, GROUPS=cfg["BLOCK_I"] // QK, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return q if q8_1 else a


def activate_weighted_reference(
    h, weights, act, output=ActivationFormat.FLOAT, config=None
) -> torch.Tensor | Q8_1:
    a = act(h.float()) * weights.float()[:, None]
    return quantize_q8_1(a) if output is ActivationFormat.Q8_1 else a


@triton.jit
def _sum_rows_kernel(y_ptr, out_ptr, R, H, BLOCK_H: tl.constexpr):
    """out[c] = y[0, c] + y[1, c] + ... + y[R-1, c], in that order. y: fp32 [R, H]; out: fp32 [H]."""
    offs = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.load(y_ptr + offs, mask=mask, other=0.0)
    for r in range(1, R):
        acc += tl.load(y_ptr + r * H + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc, mask=mask)


def sum_rows(y: torch.Tensor, config: Mapping[str, int] | None = None) -> torch.Tensor:
    """y fp32 [k, H] -> fp32 [H], rows summed in order 0..k-1 (deterministic), one launch."""
    cfg = merge_config(SUM_CONFIG, config)
    k, hidden = y.shape
    out = torch.empty(hidden, dtype=torch.float32, device=y.device)
    grid = (triton.cdiv(hidden, cfg["BLOCK_H"]),)
    _sum_rows_kernel[grid](y.contiguous(), out, k, hidden, BLOCK_H=cfg["BLOCK_H"], num_warps=cfg["num_warps"])
    return out


def sum_rows_reference(y, config=None) -> torch.Tensor:
    out = y[0].float().clone()
    for row in y[1:]:
        out += row
    return out


# ---------------------------------------------------------------- the step


class LayerWeights(NamedTuple):
    """One layer's experts as the decode launches read them: gate_up and down indexed by slot, and
    their biases (gate_up [E, 2I], down [E, H], indexed by expert) or None."""

    gate_up: KernelWeight
    down: KernelWeight
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


def decode_step(
    x: torch.Tensor,
    slots: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    layer: LayerWeights,
    act: Activation,
    use_q8_1: bool = False,
    config: Mapping[str, Mapping[str, int]] | None = None,
) -> torch.Tensor:
    """One token x [H] through its k experts -> sum_i weights[i] * expert_i(x), fp32 [H].

    slots, experts: int32 [k] (experts ascending, the plan order the rows are summed in); weights:
    fp32 [k]; layer: the experts' weights and biases. With use_q8_1, each
    projection whose format has a q8_1 kernel (Q8_1_GROUP_BYTES) takes its input as q8_1 and uses
    integer dot products; the others take floats (ActivationFormat.for_weight). config: launch name
    (the keys of DECODE_CONFIG) -> that launch's config; quantising x to q8_1 uses "activate"'s."""
    cfg = {**DECODE_CONFIG, **(config or {})}
    gate_up, down, gate_up_bias, down_bias = layer
    x_format = ActivationFormat.for_weight(gate_up, use_q8_1)
    a_format = ActivationFormat.for_weight(down, use_q8_1)
    if x_format is ActivationFormat.Q8_1:
        x = quantize_rows_q8_1(x, cfg["activate"])
    h = gate_up_experts(x, slots, experts, gate_up, gate_up_bias, cfg[x_format.config_key("gate_up")])
    a = activate_weighted(h, weights, act, a_format, cfg["activate"])
    y = down_experts(a, slots, experts, down, down_bias, weights, cfg[a_format.config_key("down")])
    return sum_rows(y, cfg["sum"])


def decode_step_reference(
    x, slots, experts, weights, layer: LayerWeights, act, use_q8_1=False, config=None
) -> torch.Tensor:
    gate_up, down, gate_up_bias, down_bias = layer
    x_format = ActivationFormat.for_weight(gate_up, use_q8_1)
    a_format = ActivationFormat.for_weight(down, use_q8_1)
    if x_format is ActivationFormat.Q8_1:
        x = quantize_q8_1(x)
    h = gate_up_experts_reference(x, slots, experts, gate_up, gate_up_bias)
    a = activate_weighted_reference(h, weights, act, a_format)
    y = down_experts_reference(a, slots, experts, down, down_bias, weights)
    return sum_rows_reference(y)
