"""The torch backend: plain PyTorch, the reference for every other backend and the CPU path.

Only experts that have rows are touched. Projections run in the weights' dtype; the activation,
the routing weight and the combine run in fp32. The combine sums each token's rows in plan order
(its experts ascending) with one reduction: no atomics, no scatter-add, so equal inputs give
bitwise equal outputs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from moerun.activations import Activation
from moerun.plan import BatchedPlan, TokenPlan


def _expert_forward(x: torch.Tensor, t: Mapping[str, torch.Tensor], e: int, act: Activation) -> torch.Tensor:
    """x [R, H] through expert e -> [R, H] in the weights' dtype."""
    gate_up_bias = t.get("experts.gate_up_bias")
    down_bias = t.get("experts.down_bias")
    gate_up = t["experts.gate_up"][e]  # [2I, H]
    down = t["experts.down"][e]  # [H, I]
    h = F.linear(x.to(gate_up.dtype), gate_up, None if gate_up_bias is None else gate_up_bias[e])  # [R, 2I]
    a = act(h.float()).to(down.dtype)  # [R, I]
    return F.linear(a, down, None if down_bias is None else down_bias[e])  # [R, H]


def expert_rows(x: torch.Tensor, plan: BatchedPlan, t: Mapping[str, torch.Tensor],
                act: Activation) -> torch.Tensor:
    """x [T, H] -> weighted expert outputs [T*k, H] fp32, one row per assignment in plan order."""
    rows = torch.empty(plan.order.numel(), x.shape[1], dtype=torch.float32, device=x.device)
    gathered = x.index_select(0, plan.row_tokens)  # [T*k, H]
    offsets = plan.offsets.tolist()
    for e in range(len(offsets) - 1):
        start, end = offsets[e], offsets[e + 1]
        if start == end:
            continue
        y = _expert_forward(gathered[start:end], t, e, act)
        torch.mul(y.float(), plan.row_weights[start:end, None], out=rows[start:end])
    return rows


def combine(rows: torch.Tensor, plan: BatchedPlan) -> torch.Tensor:
    """rows [T*k, H] fp32 in plan order -> out [T, H] fp32: each token's rows summed in plan order."""
    token_rows = plan.inverse.view(plan.num_tokens, plan.top_k).sort(dim=1).values  # [T, k] ascending rows
    return rows[token_rows].sum(dim=1)


def token_rows(x: torch.Tensor, plan: TokenPlan, t: Mapping[str, torch.Tensor], act: Activation) -> torch.Tensor:
    """One token x [H] -> weighted outputs [k, H] fp32 of its experts, ascending."""
    rows = torch.empty(len(plan.experts), x.shape[0], dtype=torch.float32, device=x.device)
    x = x[None]  # [1, H]
    for i, e in enumerate(plan.experts):
        torch.mul(_expert_forward(x, t, e, act)[0].float(), plan.weights[i], out=rows[i])
    return rows


def combine_token(rows: torch.Tensor) -> torch.Tensor:
    """[k, H] fp32 -> [H] fp32, summed in plan order."""
    return rows.sum(dim=0)


def shared_expert(x: torch.Tensor, t: Mapping[str, torch.Tensor], act: Activation) -> torch.Tensor:
    """x [T, H] -> the shared expert's output [T, H] fp32 (times sigmoid(x · gate) when gated)."""
    gate_up, down = t["shared.gate_up"], t["shared.down"]
    y = F.linear(act(F.linear(x.to(gate_up.dtype), gate_up).float()).to(down.dtype), down).float()
    gate = t.get("shared.gate")
    if gate is not None:
        y = y * torch.sigmoid(F.linear(x.float(), gate))  # [T, 1]
    return y
