"""Plans: which rows each expert computes, and how rows come back to tokens.

An assignment is one (token, slot) pair, numbered `token * k + slot`. The batched plan orders the
T·k assignments by expert id ascending, stable inside an expert (so ties keep token order); the
single-token plan is the decode case: one token's k distinct experts, ascending.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchedPlan:
    order: torch.Tensor  # [T*k] int64: assignment number of each row, grouped by expert ascending
    offsets: torch.Tensor  # [E+1] int64: rows of expert e are order[offsets[e]:offsets[e+1]]
    row_weights: torch.Tensor  # [T*k] fp32: routing weight of each row
    inverse: torch.Tensor  # [T*k] int64: row of each assignment (order[inverse] == arange)
    top_k: int

    @property
    def row_tokens(self) -> torch.Tensor:
        """[T*k] int64: the token each row reads."""
        return self.order // self.top_k

    @property
    def num_tokens(self) -> int:
        return self.order.numel() // self.top_k

    @property
    def row_experts(self) -> torch.Tensor:
        """[T*k] int64 on the CPU: the expert each row goes to (ascending, as the rows are grouped)."""
        counts = self.offsets.diff().cpu()
        return torch.repeat_interleave(torch.arange(counts.numel()), counts)


def build_plan(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> BatchedPlan:
    """ids [T, k] int64 and weights [T, k] -> the batched plan over `num_experts` experts."""
    tokens, top_k = ids.shape
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(counts, dim=0, out=offsets[1:])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=ids.device)
    return BatchedPlan(
        order=order,
        offsets=offsets,
        row_weights=weights.reshape(-1)[order].float(),
        inverse=inverse,
        top_k=top_k,
    )


@dataclass(frozen=True)
class TokenPlan:
    experts: list[int]  # the token's k distinct experts, ascending (host ints: decode loops over them)
    weights: torch.Tensor  # [k] fp32, weight of each of `experts`


def build_token_plan(ids: torch.Tensor, weights: torch.Tensor, layer_name: str = "moe") -> TokenPlan:
    """One token's ids [k] (or [1, k]) and weights -> its experts ascending with their weights."""
    ids = ids.reshape(-1)
    weights = weights.reshape(-1)
    sorted_ids, order = torch.sort(ids, stable=True)
    experts = sorted_ids.tolist()
    if len(set(experts)) != len(experts):
        raise ValueError(
            f"Layer {layer_name!r} routed one token to experts {experts}: {len(set(experts))} distinct, "
            f"expected k={len(experts)}."
        )
    return TokenPlan(experts=experts, weights=weights[order].float())
