"""The Triton decode step: one token through its k experts, read through a slot table.

Owns the decode launches and their torch references (same signatures, `*_reference`):
`gate_up_experts` (gate and up of all k experts, one launch), `activate_weighted` (activation times
the routing weight, optionally written as q8_1 rows), `down_experts` (down of all k experts plus the
bias times the routing weight), `sum_rows` (the ordered row sum) and `decode_step`, which chains
them with, for block formats, the integer q8_1 variants of the two projections from
`moerun.kernels.decode_q8_1`.

Every launch takes tensors only: the slot table `slots` int32 [k] (index of each expert's weights in
the weight tensor's first dim: the expert ids when all experts are resident, cache slots when
streaming), `experts` int32 [k] (expert ids, for the resident biases), the routing `weights` fp32
[k] and x live in fixed buffers, so the step can be captured in a CUDA graph. Block sizes and
num_warps come in one `config` dict per launch (defaults below; JSON per shape/format/GPU later).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from moerun.activations import Activation
from moerun.kernels.activation import activate, activation_args
from moerun.kernels.configs import default_config
from moerun.kernels.decode_q8_1 import (
    GEMV_Q8_1_CONFIG,
    Q8_1_GROUP_BYTES,
    QK,
    check_bias,
    check_table,
    down_experts_q8_1,
    down_experts_q8_1_reference,
    empty_q8_1,
    gate_up_experts_q8_1,
    gate_up_experts_q8_1_reference,
    merge_config,
    quantize_rows_q8_1,
    store_q8_1,
)
from moerun.kernels.weights import FORMAT_NAMES, KernelWeight, load_weight_tile
from moerun.quant.formats import get_format
from moerun.quant.q8_1 import Q8_1, quantize_q8_1

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


# ---------------------------------------------------------------- float path


@triton.jit
def _experts_gemv_kernel(
    x_ptr, x_row_stride, slots_ptr, experts_ptr, weights_ptr, w_ptr, row_stride, expert_stride,
    bias_ptr, out_ptr, N, K,
    FMT: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[i, n] = sum_c W_{slots[i]}[n, c] * x[i, c] (+ bias[experts[i], n], times weights[i] with
    SCALE_BIAS). Grid (k, cdiv(N, BLOCK_N)).

    x: float [k, K] rows `x_row_stride` elements apart (0: one row shared by all k). slots, experts:
    int32 [k]. weights: fp32 [k]. w: KernelWeight data (any format load_weight_tile reads).
    bias: float [E, N]. out: fp32 [k, N]."""
    i = tl.program_id(0)
    n_offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    w_expert = w_ptr + slot * expert_stride
    x_row = x_ptr + i * x_row_stride
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_offs = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_row + k_offs, mask=k_offs < K, other=0.0).to(tl.float32)  # [BK]
        tile = load_weight_tile(w_expert, row_stride, n_offs, k_offs, N, K, FMT)  # [BK, BN]
        acc += tl.sum(tile * xk[:, None], axis=0)
    if HAS_BIAS:
        expert = tl.load(experts_ptr + i).to(tl.int64)
        bias = tl.load(bias_ptr + expert * N + n_offs, mask=n_offs < N, other=0.0).to(tl.float32)
        if SCALE_BIAS:
            bias = bias * tl.load(weights_ptr + i)
        acc += bias
    tl.store(out_ptr + i * N + n_offs, acc, mask=n_offs < N)


def _gemv(x, x_row_stride, slots, experts, weights, w: KernelWeight, bias, scale_bias, k, config):
    cfg = merge_config(GEMV_CONFIG, config)
    name = FORMAT_NAMES[w.fmt]
    if cfg["BLOCK_K"] % get_format(name).block_size:
        raise ValueError(
            f"BLOCK_K={cfg['BLOCK_K']} must be a multiple of {name}'s block of {get_format(name).block_size}."
        )
    out = torch.empty(k, w.n, dtype=torch.float32, device=x.device)
    grid = (k, triton.cdiv(w.n, cfg["BLOCK_N"]))
    _experts_gemv_kernel[grid](
        x, x_row_stride, slots, experts, weights, w.data, w.row_stride, w.expert_stride,
        out if bias is None else bias, out, w.n, w.k,
        FMT=w.fmt, HAS_BIAS=bias is not None, SCALE_BIAS=scale_bias,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out


def gate_up_experts(
    x: torch.Tensor,
    slots: torch.Tensor,
    experts: torch.Tensor,
    gate_up: KernelWeight,
    gate_up_bias: torch.Tensor | None,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """x float [H] -> h fp32 [k, 2I] = W_{slots[i]} x (+ gate_up_bias[experts[i]]), one launch."""
    k = check_table(slots, experts)
    if x.shape != (gate_up.k,):
        raise ValueError(f"gate_up_experts takes one token x [{gate_up.k}]; got {tuple(x.shape)}.")
    bias = check_bias(gate_up_bias, gate_up.n, "gate_up")
    return _gemv(x.contiguous(), 0, slots, experts, slots, gate_up, bias, False, k, config)


def down_experts(
    a: torch.Tensor,
    slots: torch.Tensor,
    experts: torch.Tensor,
    down: KernelWeight,
    down_bias: torch.Tensor | None,
    weights: torch.Tensor,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """a fp32 [k, I] (already times the routing weights) -> y fp32 [k, H] = W_{slots[i]} a[i]
    (+ weights[i] * down_bias[experts[i]]), one launch."""
    k = check_table(slots, experts)
    if a.shape != (k, down.k):
        raise ValueError(f"down_experts takes a [{k}, {down.k}]; got {tuple(a.shape)}.")
    bias = check_bias(down_bias, down.n, "down")
    return _gemv(a.contiguous(), down.k, slots, experts, weights, down, bias, True, k, config)


def gate_up_experts_reference(x, slots, experts, gate_up, gate_up_bias, config=None) -> torch.Tensor:
    rows = []
    for slot, e in zip(slots.tolist(), experts.tolist(), strict=True):
        h = gate_up.values(slot) @ x.float()
        rows.append(h if gate_up_bias is None else h + gate_up_bias[e].float())
    return torch.stack(rows)


def down_experts_reference(a, slots, experts, down, down_bias, weights, config=None) -> torch.Tensor:
    rows = []
    for i, (slot, e) in enumerate(zip(slots.tolist(), experts.tolist(), strict=True)):
        y = down.values(slot) @ a[i].float()
        rows.append(y if down_bias is None else y + weights[i] * down_bias[e].float())
    return torch.stack(rows)


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
    q8_1: bool = False,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor | Q8_1:
    """h fp32 [k, 2I] -> a = weights[:, None] * act(h), fp32 [k, I], or (q8_1) its Q8_1, one launch.

    The q8_1 rows are bit-exact `quantize_q8_1` of the float a, except that a block whose scales
    overflow fp16 is written as inf instead of raising (no host read-back in the decode step)."""
    cfg = merge_config(ACTIVATION_CONFIG, config)
    if cfg["BLOCK_I"] % QK:
        raise ValueError(f"BLOCK_I={cfg['BLOCK_I']} must be a multiple of {QK}.")
    k, two_i = h.shape
    intermediate = two_i // 2
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


def activate_weighted_reference(h, weights, act, q8_1=False, config=None) -> torch.Tensor | Q8_1:
    a = act(h.float()) * weights.float()[:, None]
    return quantize_q8_1(a) if q8_1 else a


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


def decode_step(
    x: torch.Tensor,
    slots: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: KernelWeight,
    down: KernelWeight,
    biases: tuple[torch.Tensor | None, torch.Tensor | None],
    act: Activation,
    use_q8_1: bool = False,
    config: Mapping[str, Mapping[str, int]] | None = None,
) -> torch.Tensor:
    """One token x [H] through its k experts -> sum_i weights[i] * expert_i(x), fp32 [H].

    slots, experts: int32 [k] (experts ascending, the plan order the rows are summed in); weights:
    fp32 [k]; biases: (gate_up_bias [E, 2I] | None, down_bias [E, H] | None). With use_q8_1, each
    projection whose format has a q8_1 kernel (Q8_1_GROUP_BYTES) takes its input as q8_1 and uses
    integer dot products; the others stay on the float path. config: launch name (the keys of
    DECODE_CONFIG) -> that launch's config; quantising x to q8_1 uses "activate"'s."""
    cfg = {**DECODE_CONFIG, **(config or {})}
    gate_up_bias, down_bias = biases
    gate_up_int = use_q8_1 and gate_up.fmt in Q8_1_GROUP_BYTES
    down_int = use_q8_1 and down.fmt in Q8_1_GROUP_BYTES
    if gate_up_int:
        xq = quantize_rows_q8_1(x, cfg["activate"])
        h = gate_up_experts_q8_1(xq, slots, experts, gate_up, gate_up_bias, cfg["gate_up_q8_1"])
    else:
        h = gate_up_experts(x, slots, experts, gate_up, gate_up_bias, cfg["gate_up"])
    a = activate_weighted(h, weights, act, q8_1=down_int, config=cfg["activate"])
    if down_int:
        y = down_experts_q8_1(a, slots, experts, down, down_bias, weights, cfg["down_q8_1"])
    else:
        y = down_experts(a, slots, experts, down, down_bias, weights, cfg["down"])
    return sum_rows(y, cfg["sum"])


def decode_step_reference(
    x, slots, experts, weights, gate_up, down, biases, act, use_q8_1=False, config=None
) -> torch.Tensor:
    gate_up_bias, down_bias = biases
    if use_q8_1 and gate_up.fmt in Q8_1_GROUP_BYTES:
        h = gate_up_experts_q8_1_reference(quantize_q8_1(x), slots, experts, gate_up, gate_up_bias)
    else:
        h = gate_up_experts_reference(x, slots, experts, gate_up, gate_up_bias)
    down_int = use_q8_1 and down.fmt in Q8_1_GROUP_BYTES
    a = activate_weighted_reference(h, weights, act, q8_1=down_int)
    if down_int:
        y = down_experts_q8_1_reference(a, slots, experts, down, down_bias, weights)
    else:
        y = down_experts_reference(a, slots, experts, down, down_bias, weights)
    return sum_rows_reference(y)
