"""The torch backend (`TorchBackend`): plain PyTorch, the reference for every other backend, and the
path where neither the native CPU kernels nor Triton run.

Only experts that have rows are touched. Projections run in the weights' dtype; the activation,
the routing weight and the combine run in fp32. The combine sums each token's rows in plan order
(its experts ascending) with one reduction: no atomics, no scatter-add, so equal inputs give
bitwise equal outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import torch
import torch.nn.functional as F

from moerun.activations import Activation
from moerun.linear import linear
from moerun.moe.backends.base import Backend
from moerun.moe.backends.workspace import Workspace
from moerun.moe.experts import ExpertWeights
from moerun.moe.plan import BatchedPlan, TokenPlan, build_plan, build_token_plan
from moerun.moe.routing import RouterCheck, deferred_check, router_logits
from moerun.moe.trace import LayerTrace

batch_plan = build_plan


def _expert_forward(x: torch.Tensor, experts: ExpertWeights, e: int, act: Activation) -> torch.Tensor:
    """x [R, H] through expert e -> [R, H] in the compute dtype."""
    gate_up, down = experts.dense(e)  # [2I, H], [H, I]
    h = F.linear(x.to(gate_up.dtype), gate_up, experts.bias("gate_up", e))  # [R, 2I]
    a = act(h.float()).to(down.dtype)  # [R, I]
    return F.linear(a, down, experts.bias("down", e))  # [R, H]


def expert_rows(
    x: torch.Tensor,
    plan: BatchedPlan,
    experts: ExpertWeights,
    act: Activation,
    ws: Workspace,
    only: Collection[int] | None = None,
) -> torch.Tensor:
    """x [T, H] -> weighted expert outputs [T*k, H] fp32, one row per assignment in plan order
    (a view of `ws`, valid until the next call); `only`: compute just these experts' rows, the
    others left unset (expert parallelism: another rank computes them, the exchange brings them).
    One token: `token_rows`, the decode step's matrix-vector products, so that the rows summed in
    plan order are `token_forward`'s sum, the same bits."""
    if x.shape[0] == 1:  # a token's assignments are its experts ascending, the plan's order
        token = TokenPlan(plan.row_experts.tolist(), plan.row_weights)
        out = ws.get("rows", (len(token.experts), x.shape[1]), torch.float32, x.device)
        return token_rows(x[0], token, experts, act, only, out)
    return rows_by_expert(x, plan, ws, lambda rows, e: _expert_forward(rows, experts, e, act), only)


def rows_by_expert(
    x: torch.Tensor,
    plan: BatchedPlan,
    ws: Workspace,
    forward: Callable[[torch.Tensor, int], torch.Tensor],
    only: Collection[int] | None = None,
) -> torch.Tensor:
    """The batched experts stage, expert by expert: each expert e with rows computes
    forward(its gathered rows [R, H], e) -> [R, H], weighted by the rows' routing weights into
    [T*k, H] fp32 in plan order (a view of `ws`, valid until the next call). `only`: just those
    experts, every other row left unset."""
    num_rows = plan.order.numel()
    rows = ws.get("rows", (num_rows, x.shape[1]), torch.float32, x.device)
    gathered = torch.index_select(
        x, 0, plan.row_tokens, out=ws.get("gathered", (num_rows, x.shape[1]), x.dtype, x.device)
    )  # [T*k, H]
    offsets = plan.offsets.tolist()
    for e in range(len(offsets) - 1):
        start, end = offsets[e], offsets[e + 1]
        if start == end or (only is not None and e not in only):
            continue
        y = forward(gathered[start:end], e)
        torch.mul(y, plan.row_weights[start:end, None], out=rows[start:end])
    return rows


def combine(rows: torch.Tensor, plan: BatchedPlan, ws: Workspace) -> torch.Tensor:
    """rows [T*k, H] fp32 in plan order -> out [T, H] fp32: each token's rows summed in plan order."""
    # a token's slots are ordered by expert id (see moerun.moe.routing.route), so its rows, read through
    # the inverse, come in plan order
    by_token = torch.index_select(
        rows, 0, plan.inverse, out=ws.get("by_token", rows.shape, rows.dtype, rows.device)
    )
    by_token = by_token.view(plan.num_tokens, plan.top_k, rows.shape[1])
    return by_token.sum(dim=1)


def token_rows(
    x: torch.Tensor,
    plan: TokenPlan,
    experts: ExpertWeights,
    act: Activation,
    only: Collection[int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token x [H] -> weighted outputs [k, H] fp32 of its experts, ascending (into `out`);
    `only`: just these experts' rows, the others left unset."""
    rows = (
        out
        if out is not None
        else torch.empty(len(plan.experts), x.shape[0], dtype=torch.float32, device=x.device)
    )
    for i, e in enumerate(plan.experts):
        if only is not None and e not in only:
            continue
        # matrix-vector products: on CPU torch.mv's bf16 path reads weights ~1.4x faster than a
        # 1-row F.linear, and quantised weights are dequantised tile by tile
        h = experts.matvec("gate_up", e, x)  # [2I]
        if (bias := experts.bias("gate_up", e)) is not None:
            h = h + bias
        y = experts.matvec("down", e, act(h.float()))  # [H]
        if (bias := experts.bias("down", e)) is not None:
            y = y + bias
        torch.mul(y, plan.weights[i], out=rows[i])
    return rows


def combine_token(rows: torch.Tensor) -> torch.Tensor:
    """[k, H] fp32 -> [H] fp32, summed in plan order."""
    return rows.sum(dim=0)


def token_forward(x: torch.Tensor, plan: TokenPlan, experts: ExpertWeights, act: Activation) -> torch.Tensor:
    """One token x [H] -> the weighted sum of its experts' outputs [H] fp32, summed in plan order."""
    return combine_token(token_rows(x, plan, experts, act))


def shared_expert(x: torch.Tensor, t: Mapping[str, torch.Tensor], act: Activation) -> torch.Tensor:
    """x [T, H] -> the shared expert's output [T, H] fp32 (times sigmoid(x · gate) when gated)."""
    gate_up, down = t["shared.gate_up"], t["shared.down"]
    y = F.linear(act(F.linear(x.to(gate_up.dtype), gate_up).float()).to(down.dtype), down).float()
    gate = t.get("shared.gate")
    if gate is not None:
        y = y * torch.sigmoid(F.linear(x.float(), gate))  # [T, 1]
    return y


Norm = tuple[torch.Tensor, float]  # (RMSNorm weight fp32 [H], epsilon) fused into the route


class TorchBackend(Backend):
    """The reference: plain PyTorch on any device, activations never quantised."""

    name = "torch"
    streams_prefill = True  # prefill visits experts one by one, so a stream can fetch them in groups

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype (moerun.linear)."""
        return linear(x, weight, bias)

    def route(
        self,
        x: torch.Tensor,
        routing,
        t: Mapping[str, torch.Tensor],
        layer_name: str,
        checks: list[RouterCheck],
        norm: Norm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Tokens x [T, H] (normed) -> (the tokens routed, router logits [T, E] fp32, and ids [T, k]
        and weights [T, k] where the backend selects them, else None, None: the layer applies
        `routing`). The logits' NaN/inf check is appended to `checks`, for the caller to read back
        with other layers' at once (a host sync per layer would stall a GPU). `norm`: only the cpu
        backend fuses the model's norm into the route."""
        if norm is not None:
            raise ValueError(f"the {self.name} backend routes normed tokens; only cpu fuses the norm.")
        logits = router_logits(x, t["router.weight"], t.get("router.bias"))  # [T, E] fp32
        checks.append(deferred_check(logits, layer_name))
        return x, logits, None, None

    def experts(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        experts: ExpertWeights,
        act: Activation,
        ws: Workspace,
        trace: LayerTrace,
    ) -> torch.Tensor:
        """Tokens x [T, H], each routed to ids [T, k] (distinct) with weights [T, k] -> the weighted
        sum of each token's expert outputs [T, H] fp32, summed in plan order (its experts ascending).
        One token: matrix-vector products; many: the batched plan, rows by expert, the combine.
        `trace` times the stages (MOERUN_TRACE)."""
        if x.shape[0] == 1:
            with trace.stage("plan", x.device):
                token = self.token_plan(ids, weights, experts.layer_name)
            with trace.stage("experts", x.device):  # the experts and their ordered sum
                return self.token_forward(x[0], token, experts, act)[None]
        with trace.stage("plan", x.device):
            plan = self.batch_plan(ids, weights, experts.gate_up.shape[0])
        with trace.stage("experts", x.device):
            rows = self.expert_rows(x, plan, experts, act, ws)  # [T*k, H] fp32
        with trace.stage("combine", x.device):
            return self.combine(rows, plan, ws)

    # the stages are this module's functions; the other backends override those their kernels run
    token_plan = staticmethod(build_token_plan)  # (ids [1, k], weights, layer name) -> TokenPlan
    batch_plan = staticmethod(build_plan)  # (ids [T, k], weights [T, k], num experts) -> BatchedPlan
    token_forward = staticmethod(token_forward)  # (x [H], plan, experts, act) -> [H] fp32
    expert_rows = staticmethod(expert_rows)  # (x, plan, experts, act, ws, only=None) -> rows
    combine = staticmethod(combine)  # (rows, plan, ws) -> [T, H] fp32
    shared_expert = staticmethod(shared_expert)  # (x, tensors, act) -> [T, H] fp32
