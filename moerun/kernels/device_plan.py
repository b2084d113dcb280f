"""The batched plan as the grouped-GEMM kernels read it, built on the device with no host read-back.

The T·k assignments (numbered `token * k + slot`) are grouped by expert ascending, stable inside an
expert, exactly as moerun.moe.plan.build_plan orders them; then each expert's group is padded to a whole
number of `block_m`-row blocks, so every block of rows belongs to one expert. The buffers have a
fixed size that covers the worst case for (T, k, E, block_m), so a launch over them is the same for
every routing and can be captured in a CUDA graph: `build_device_plan` uses only torch ops that
neither synchronise nor depend on values for their shapes (scatter_add_ counts, cumsum, a stable
sort, searchsorted, scatter_).

`build_device_plan_reference` restates the same plan with plain host loops, for the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DevicePlan:
    sorted_rows: torch.Tensor  # [max_rows] int32: assignment of each padded row; padding holds T*k
    row_weights: torch.Tensor  # [max_rows] fp32: routing weight of each padded row; 0 on padding
    block_experts: torch.Tensor  # [max_blocks] int32: expert of each block of block_m rows, -1 unused
    counts: torch.Tensor  # [E] int32: assignments routed to each expert
    offsets: torch.Tensor  # [E+1] int32: padded rows of expert e are [offsets[e], offsets[e+1])
    inverse: torch.Tensor  # [T*k] int32: padded row of each assignment
    block_m: int
    top_k: int
    num_tokens: int

    @property
    def max_rows(self) -> int:
        return self.sorted_rows.numel()

    @property
    def max_blocks(self) -> int:
        return self.block_experts.numel()


def plan_capacity(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> int:
    """max_rows: padded rows in the worst case (every expert with rows wastes block_m - 1 of them)."""
    assignments = num_tokens * top_k
    worst = assignments + min(num_experts, assignments) * (block_m - 1)
    return -(-worst // block_m) * block_m


def _check(ids: torch.Tensor, weights: torch.Tensor, num_experts: int, block_m: int) -> None:
    if ids.dim() != 2 or weights.shape != ids.shape:
        raise ValueError(
            f"the plan needs ids and weights of one shape [T, k]; "
            f"got {tuple(ids.shape)} and {tuple(weights.shape)}."
        )
    if block_m < 1 or num_experts < 1:
        raise ValueError(
            f"the plan needs block_m >= 1 and num_experts >= 1; got {block_m} and {num_experts}."
        )


def build_device_plan(ids: torch.Tensor, weights: torch.Tensor, num_experts: int, block_m: int) -> DevicePlan:
    """ids [T, k] int64 (each in [0, E)) and weights [T, k] -> the padded plan, on ids' device."""
    _check(ids, weights, num_experts, block_m)
    num_tokens, top_k = ids.shape
    assignments = num_tokens * top_k
    max_rows = plan_capacity(num_tokens, top_k, num_experts, block_m)
    device = ids.device
    flat_ids = ids.reshape(-1).long()  # [A]

    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    torch.cumsum(padded, dim=0, out=offsets[1:])  # padded row offsets
    starts = torch.cumsum(counts, dim=0) - counts  # unpadded row offsets

    order = torch.argsort(flat_ids, stable=True)  # [A]: assignment of each unpadded row
    expert_of_row = flat_ids[order]
    rank = torch.arange(assignments, device=device) - starts[expert_of_row]  # place inside its group
    padded_row = offsets[expert_of_row] + rank  # [A]

    sorted_rows = torch.full((max_rows,), assignments, dtype=torch.int64, device=device)
    sorted_rows.scatter_(0, padded_row, order)
    row_weights = torch.zeros(max_rows, dtype=torch.float32, device=device)
    row_weights.scatter_(0, padded_row, weights.reshape(-1).float()[order])
    inverse = torch.empty(assignments, dtype=torch.int64, device=device)
    inverse.scatter_(0, order, padded_row)

    # block b starts at row b * block_m; its expert is the e with offsets[e] <= start < offsets[e+1]
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    block_experts = torch.searchsorted(offsets[1:], block_starts, right=True)
    block_experts = torch.where(block_starts < offsets[-1], block_experts, -1)

    return DevicePlan(
        sorted_rows=sorted_rows.int(),
        row_weights=row_weights,
        block_experts=block_experts.int(),
        counts=counts.int(),
        offsets=offsets.int(),
        inverse=inverse.int(),
        block_m=block_m,
        top_k=top_k,
        num_tokens=num_tokens,
    )


def build_device_plan_reference(
    ids: torch.Tensor, weights: torch.Tensor, num_experts: int, block_m: int
) -> DevicePlan:
    """The same plan as build_device_plan, by host loops over the assignments."""
    _check(ids, weights, num_experts, block_m)
    num_tokens, top_k = ids.shape
    assignments = num_tokens * top_k
    max_rows = plan_capacity(num_tokens, top_k, num_experts, block_m)
    flat_ids = ids.reshape(-1).tolist()
    flat_weights = weights.reshape(-1).float().tolist()

    groups: list[list[int]] = [[] for _ in range(num_experts)]
    for a, e in enumerate(flat_ids):
        groups[e].append(a)  # assignments ascend inside each group: stable
    sorted_rows = [assignments] * max_rows
    row_weights = [0.0] * max_rows
    block_experts = [-1] * (max_rows // block_m)
    inverse = [0] * assignments
    offsets = [0]
    for e, group in enumerate(groups):
        start = offsets[-1]
        for i, a in enumerate(group):
            sorted_rows[start + i] = a
            row_weights[start + i] = flat_weights[a]
            inverse[a] = start + i
        blocks = -(-len(group) // block_m)
        for b in range(blocks):
            block_experts[start // block_m + b] = e
        offsets.append(start + blocks * block_m)

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=ids.device)

    return DevicePlan(
        sorted_rows=tensor(sorted_rows, torch.int32),
        row_weights=tensor(row_weights, torch.float32),
        block_experts=tensor(block_experts, torch.int32),
        counts=tensor([len(g) for g in groups], torch.int32),
        offsets=tensor(offsets, torch.int32),
        inverse=tensor(inverse, torch.int32),
        block_m=block_m,
        top_k=top_k,
        num_tokens=num_tokens,
    )
