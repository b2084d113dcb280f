"""Prefill through the experts: two grouped GEMMs over the padded plan, then the ordered combine.

Every block of `plan.block_m` rows belongs to one expert (moerun.kernels.device_plan), so one launch
covers all experts: program (b, n) computes columns [n*BLOCK_N, (n+1)*BLOCK_N) of block b with
block b's expert, and blocks past the used rows (block_experts == -1) exit at once.
1. `gate_up_activation`: a = act(x[token of row] · Wguᵀ + b), reading x rows through the plan (no
   gathered copy), dequantising the weight tiles in the kernel (moerun.kernels.weights), gate and
   up tiles of the same activation columns in one program, bias and activation in the epilogue.
2. `down_weighted`: rows = (a · Wdᵀ + b) · routing weight, fp32.
3. `combine_rows`: out[t] = Σ_s rows[inverse[t*k + s]], slots in order: one launch, no atomics.
`moe_prefill` chains them. Products accumulate in fp32; for bf16/f16 x the dot inputs are x's dtype
(weight tiles rounded to it), for fp32 x the dot is full fp32 ("ieee", no tf32).

Each launcher has a `*_reference` of the same signature in plain torch (dequantise, index, matmul),
sharing no code with the kernels. Block sizes and launch options come in one `config` dict; keys not
given take DEFAULT_CONFIG's values, and BLOCK_M must equal the plan's block_m.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerun.activations import Activation
from moerun.kernels.activation import activate, activation_args
from moerun.kernels.configs import default_config
from moerun.kernels.device_plan import DevicePlan
from moerun.kernels.weights import KernelWeight, load_weight_tile

# BLOCK_M: rows per block (the plan's block_m); BLOCK_N: output columns per program; BLOCK_K: the
# reduction step; the combine's BLOCK_T tokens and BLOCK_H columns per program
DEFAULT_CONFIG = default_config("prefill_gate_up") | default_config("prefill_combine")


def _config(plan: DevicePlan, config: dict | None) -> dict:
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    if config is None or "BLOCK_M" not in config:
        cfg["BLOCK_M"] = plan.block_m
    if cfg["BLOCK_M"] != plan.block_m:
        raise ValueError(
            f"config BLOCK_M={cfg['BLOCK_M']} but the plan was built with block_m={plan.block_m}: "
            "build the plan with the config's BLOCK_M."
        )
    return cfg


def _gemm_config(plan: DevicePlan, config: dict | None) -> dict:
    cfg = _config(plan, config)
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        size = cfg[key]
        if size < 16 or size & (size - 1):
            raise ValueError(f"config {key}={size}: tl.dot needs a power of two of at least 16.")
    return cfg


# ------------------------------------------------------------------------------------------ kernels
# How a tile product runs: fp32 x gets a full-precision fp32 dot; bf16/f16 x a dot of x's dtype with
# the weight tile rounded to it. The CPU interpreter multiplies bf16 bit patterns as integers, so on
# CPU tensors the half dot is done as an fp32 dot of the same rounded values (products of two halves
# are exact in fp32, so only the order of the fp32 sums can differ). Constexpr globals: compiled
# kernels may read no other globals.
NATIVE, IEEE_FP32, HALF_AS_FP32 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


def _dot_mode(x: torch.Tensor) -> int:
    if x.dtype == torch.float32:
        return IEEE_FP32.value
    return (HALF_AS_FP32 if x.device.type == "cpu" else NATIVE).value


@triton.jit
def _dot(a, w, acc, DOT: tl.constexpr):
    """a [BM, BK] (fp32/bf16/f16) · w [BK, BN] fp32 + acc [BM, BN] fp32."""
    if DOT == IEEE_FP32:
        acc = tl.dot(a, w, acc, input_precision="ieee")
    elif DOT == HALF_AS_FP32:
        acc = tl.dot(a.to(tl.float32), w.to(a.dtype).to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w.to(a.dtype), acc)
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H] fp32/bf16/f16, rows stride_x apart
    stride_x,
    sorted_rows_ptr,  # [max_rows] int32: assignment of each padded row (padding: num_assignments)
    block_experts_ptr,  # [max_blocks] int32: expert of each block, -1 unused
    w_ptr,  # gate_up of all experts: [E, 2I, H] float or uint8 block bytes
    w_row_stride,
    w_expert_stride,
    table_ptr,  # int8: the weights' format's lookup table (KernelWeight.table)
    bias_ptr,  # [E, 2I] any float dtype (unused without HAS_BIAS)
    bias_expert_stride,
    a_ptr,  # [max_rows, I] x's dtype: the activation of each padded row (0 on padding)
    stride_a,
    num_assignments,
    H,
    I,
    alpha,
    limit,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FMT: tl.constexpr,
    ACT: tl.constexpr,
    ROW_STEP: tl.constexpr,
    UP_OFFSET: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    assignment = tl.load(sorted_rows_ptr + rows)
    valid = assignment < num_assignments
    token = (assignment // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] activation columns
    gate_rows = cols * ROW_STEP
    up_rows = gate_rows + UP_OFFSET
    w_expert = w_ptr + expert.to(tl.int64) * w_expert_stride
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_offs = k0 + tl.arange(0, BLOCK_K)
        x_tile = tl.load(
            x_ptr + token[:, None] * stride_x + k_offs[None, :],
            mask=valid[:, None] & (k_offs[None, :] < H),
            other=0.0,
        )  # [BM, BK]
        # [BK, BN] tiles
        w_gate = load_weight_tile(w_expert, w_row_stride, gate_rows, k_offs, 2 * I, H, table_ptr, FMT)
        w_up = load_weight_tile(w_expert, w_row_stride, up_rows, k_offs, 2 * I, H, table_ptr, FMT)
        gate = _dot(x_tile, w_gate, gate, DOT)
        up = _dot(x_tile, w_up, up, DOT)
    col_mask = cols < I
    if HAS_BIAS:
        bias = bias_ptr + expert.to(tl.int64) * bias_expert_stride
        gate += tl.load(bias + gate_rows, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias + up_rows, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    a = activate(gate, up, alpha, limit, ACT)
    a = tl.where(valid[:, None], a, 0.0)
    tl.store(
        a_ptr + rows.to(tl.int64)[:, None] * stride_a + cols[None, :],
        a.to(a_ptr.dtype.element_ty),
        mask=col_mask[None, :],
    )


@triton.jit
def _down_kernel(
    a_ptr,  # [max_rows, I] fp32/bf16/f16
    stride_a,
    row_weights_ptr,  # [max_rows] fp32, 0 on padding
    block_experts_ptr,  # [max_blocks] int32, -1 unused
    w_ptr,  # down of all experts: [E, H, I] float or uint8 block bytes
    w_row_stride,
    w_expert_stride,
    table_ptr,  # int8: the weights' format's lookup table (KernelWeight.table)
    bias_ptr,  # [E, H] any float dtype (unused without HAS_BIAS)
    bias_expert_stride,
    out_ptr,  # [max_rows, H] fp32: (a · Wᵀ + b) * routing weight
    stride_out,
    H,
    I,
    HAS_BIAS: tl.constexpr,
    FMT: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    w_expert = w_ptr + expert.to(tl.int64) * w_expert_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_offs = k0 + tl.arange(0, BLOCK_K)
        a_tile = tl.load(
            a_ptr + rows[:, None] * stride_a + k_offs[None, :], mask=k_offs[None, :] < I, other=0.0
        )
        w_tile = load_weight_tile(w_expert, w_row_stride, cols, k_offs, H, I, table_ptr, FMT)  # [BK, BN]
        acc = _dot(a_tile, w_tile, acc, DOT)
    col_mask = cols < H
    if HAS_BIAS:
        bias = bias_ptr + expert.to(tl.int64) * bias_expert_stride
        acc += tl.load(bias + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    acc = acc * tl.load(row_weights_ptr + rows)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc, mask=col_mask[None, :])


@triton.jit
def _combine_kernel(
    rows_ptr,  # [max_rows, H] fp32
    stride_rows,
    inverse_ptr,  # [T*k] int32: padded row of each assignment
    out_ptr,  # [T, H] fp32
    stride_out,
    T,
    H,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    token_mask = tokens < T
    mask = token_mask[:, None] & (cols[None, :] < H)
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for s in tl.static_range(TOP_K):  # slots in order: the same sum as the reference, bit for bit
        row = tl.load(inverse_ptr + tokens * TOP_K + s, mask=token_mask, other=0).to(tl.int64)
        acc += tl.load(rows_ptr + row[:, None] * stride_rows + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * stride_out + cols[None, :], acc, mask=mask)


# ---------------------------------------------------------------------------------------- launchers
def _check_dtype(x: torch.Tensor) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the prefill kernels take fp32, bf16 or f16 activations, got {x.dtype}.")


def gate_up_activation(
    x: torch.Tensor,
    plan: DevicePlan,
    gate_up: KernelWeight,
    gate_up_bias: torch.Tensor | None,
    act: Activation,
    config: dict | None = None,
) -> torch.Tensor:
    """x [T, H] -> a [max_rows, I] in x's dtype: act(x[token] · W_eᵀ + b_e) per padded row, 0 on
    padding rows, unwritten in unused blocks. gate_up: [E, 2I, H]; gate_up_bias: [E, 2I] or None."""
    _check_dtype(x)
    cfg = _gemm_config(plan, config)
    x = x.contiguous()
    intermediate = gate_up.n // 2
    a = torch.empty(plan.max_rows, intermediate, dtype=x.dtype, device=x.device)
    grid = (plan.max_blocks, triton.cdiv(intermediate, cfg["BLOCK_N"]))
    bias = gate_up_bias.contiguous() if gate_up_bias is not None else x
    _gate_up_kernel[grid](
        x, x.stride(0), plan.sorted_rows, plan.block_experts,
        gate_up.data, gate_up.row_stride, gate_up.expert_stride, gate_up.table,
        bias, bias.stride(0), a, a.stride(0),
        plan.num_tokens * plan.top_k, gate_up.k, intermediate,
        TOP_K=plan.top_k, HAS_BIAS=gate_up_bias is not None, FMT=gate_up.fmt,
        **activation_args(act, intermediate), DOT=_dot_mode(x),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return a


def down_weighted(
    a: torch.Tensor,
    plan: DevicePlan,
    down: KernelWeight,
    down_bias: torch.Tensor | None,
    config: dict | None = None,
) -> torch.Tensor:
    """a [max_rows, I] -> rows [max_rows, H] fp32: (a · W_eᵀ + b_e) times each row's routing weight
    (0 on padding rows, unwritten in unused blocks). down: [E, H, I]; down_bias: [E, H] or None."""
    _check_dtype(a)
    cfg = _gemm_config(plan, config)
    a = a.contiguous()
    rows = torch.empty(plan.max_rows, down.n, dtype=torch.float32, device=a.device)
    grid = (plan.max_blocks, triton.cdiv(down.n, cfg["BLOCK_N"]))
    bias = down_bias.contiguous() if down_bias is not None else a
    _down_kernel[grid](
        a, a.stride(0), plan.row_weights, plan.block_experts,
        down.data, down.row_stride, down.expert_stride, down.table,
        bias, bias.stride(0), rows, rows.stride(0),
        down.n, down.k,
        HAS_BIAS=down_bias is not None, FMT=down.fmt, DOT=_dot_mode(a),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return rows


def combine_rows(rows: torch.Tensor, plan: DevicePlan, config: dict | None = None) -> torch.Tensor:
    """rows [max_rows, H] fp32 -> out [T, H] fp32: each token's rows summed in slot order."""
    cfg = _config(plan, config)
    hidden = rows.shape[1]
    out = torch.empty(plan.num_tokens, hidden, dtype=torch.float32, device=rows.device)
    grid = (triton.cdiv(plan.num_tokens, cfg["BLOCK_T"]), triton.cdiv(hidden, cfg["BLOCK_H"]))
    _combine_kernel[grid](
        rows, rows.stride(0), plan.inverse, out, out.stride(0), plan.num_tokens, hidden,
        TOP_K=plan.top_k, BLOCK_T=cfg["BLOCK_T"], BLOCK_H=cfg["BLOCK_H"], num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out


def moe_prefill(
    x: torch.Tensor,
    plan: DevicePlan,
    gate_up: KernelWeight,
    down: KernelWeight,
    biases: tuple[torch.Tensor | None, torch.Tensor | None],
    act: Activation,
    config: dict | None = None,
) -> torch.Tensor:
    """x [T, H] -> the routed experts' weighted sum [T, H] fp32. biases: (gate_up [E, 2I], down [E, H])."""
    a = gate_up_activation(x, plan, gate_up, biases[0], act, config)
    return combine_rows(down_weighted(a, plan, down, biases[1], config), plan, config)


# --------------------------------------------------------------------------------------- references
def _expert_rows(plan: DevicePlan) -> list[tuple[int, torch.Tensor]]:
    """(expert, its padded rows that hold assignments) for each expert with rows."""
    offsets, counts = plan.offsets.tolist(), plan.counts.tolist()
    return [
        (e, torch.arange(offsets[e], offsets[e] + counts[e], device=plan.offsets.device))
        for e in range(len(counts))
        if counts[e]
    ]


def gate_up_activation_reference(x, plan, gate_up, gate_up_bias, act, config=None) -> torch.Tensor:
    """gate_up_activation in torch; rows outside the experts' assignments are 0."""
    weight = gate_up.values().to(x.dtype).float()  # the dot reads weights in x's dtype
    a = torch.zeros(plan.max_rows, gate_up.n // 2, dtype=x.dtype, device=x.device)
    for e, rows in _expert_rows(plan):
        tokens = plan.sorted_rows[rows].long() // plan.top_k
        h = x[tokens].float() @ weight[e].T  # [R, 2I]
        if gate_up_bias is not None:
            h = h + gate_up_bias[e].float()
        a[rows] = act(h).to(x.dtype)
    return a


def down_weighted_reference(a, plan, down, down_bias, config=None) -> torch.Tensor:
    """down_weighted in torch; rows outside the experts' assignments are 0."""
    weight = down.values().to(a.dtype).float()
    out = torch.zeros(plan.max_rows, down.n, dtype=torch.float32, device=a.device)
    for e, rows in _expert_rows(plan):
        y = a[rows].float() @ weight[e].T  # [R, H]
        if down_bias is not None:
            y = y + down_bias[e].float()
        out[rows] = y * plan.row_weights[rows, None]
    return out


def combine_rows_reference(rows, plan, config=None) -> torch.Tensor:
    """combine_rows in torch: slot 0's rows, then each later slot's added in order."""
    inverse = plan.inverse.long().view(plan.num_tokens, plan.top_k)
    out = rows[inverse[:, 0]].clone()
    for s in range(1, plan.top_k):
        out += rows[inverse[:, s]]
    return out


def moe_prefill_reference(x, plan, gate_up, down, biases, act, config=None) -> torch.Tensor:
    """moe_prefill in torch."""
    a = gate_up_activation_reference(x, plan, gate_up, biases[0], act)
    return combine_rows_reference(down_weighted_reference(a, plan, down, biases[1]), plan)
