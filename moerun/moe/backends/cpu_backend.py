"""The cpu backend: the MoE layer on moerun's native CPU kernels (moerun.cpu), weights in the file's
format.

Decode (one token) is ONE native call: a pointer table over the token's k experts (resident: rows
of the layer's [E, ...] tensors; streamed: the cache's slots, which never move), then gate/up of all
k, the activation with the routing weight, down and the ordered row sum in one parallel region.
Many tokens (a server's decode step, a prompt) are one native call too, each expert's rows read
once for all its tokens (the prefill GEMM where it has enough of them), except dense experts with
more rows than moerun.linear gives the native kernels: those gather each expert's rows into torch's
GEMM (oneDNN, faster on many rows), the combine summing each token's rows in plan order.
`options.int8_activations`: activations quantised
per block to int8 for integer dot products, as llama.cpp does (None: on unless the compute dtype is
fp32, whose users ask for the exact numbers).
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from moerun import cpu
from moerun.activations import Activation
from moerun.cpu.library import FORMAT_IDS
from moerun.linear import NATIVE_ROWS, linear, native_weight
from moerun.moe.backends import KernelOptions
from moerun.moe.backends.torch_backend import batch_plan, combine, rows_by_expert, token_plan  # noqa: F401
from moerun.moe.backends.workspace import Workspace
from moerun.moe.experts import ExpertWeights
from moerun.moe.plan import BatchedPlan, TokenPlan
from moerun.moe.routing import SoftmaxTopK, TopKSoftmax, check_logits
from moerun.quant.formats import QTensor

STREAMS_PREFILL = True  # a step runs one native call per group of experts the cache holds


def unsupported(experts: ExpertWeights) -> str | None:
    """Why the native kernels cannot run these experts (None: they can)."""
    if not cpu.available():
        return f"the native CPU kernels are not available ({cpu.unavailable_reason()})"
    return None


@dataclass(frozen=True)
class _Column:
    """Where expert (or slot) i's part of one projection or bias lies: base + i * stride bytes."""

    base: int
    stride: int

    @classmethod
    def of(cls, stacked: torch.Tensor | None) -> _Column:
        if stacked is None:
            return cls(0, 0)
        return cls(stacked.data_ptr(), stacked.stride(0) * stacked.element_size())

    def at(self, i: int) -> int:
        return self.base + i * self.stride if self.base else 0


class _Table:
    """One layer's experts as the native decode step reads them. The tensors never move (resident
    weights, or the cache's slot pool), so their addresses are read once: `by_place` holds every
    expert's (or slot's) weight addresses, `by_expert` every expert's bias addresses."""

    def __init__(self, experts: ExpertWeights):
        if experts.stream is None:
            stacked = [native_weight(w) for w in (experts.gate_up, experts.down)]
        else:  # the cache's slot pool [S, ...], in the compute dtype or the file's format
            pools = experts.stream.cache.pool_buffers(experts.stream.layer)
            stacked = [
                (_format(w, pools[p]), pools[p])
                for w, p in ((experts.gate_up, "gate_up"), (experts.down, "down"))
            ]
        self.formats = [FORMAT_IDS[fmt] for fmt, _ in stacked]
        gu, dn = (_Column.of(t) for _, t in stacked)  # indexed by expert, or by slot
        # the kernels add fp32 biases; kept here, as the columns point into them
        self._biases = [
            None if b is None else b.float().contiguous() for b in (experts.gate_up_bias, experts.down_bias)
        ]
        gub, dnb = (_Column.of(b) for b in self._biases)  # indexed by expert
        places, E = stacked[0][1].shape[0], experts.gate_up.shape[0]
        self.by_place = torch.tensor([[gu.at(p), dn.at(p)] for p in range(places)], dtype=torch.int64)
        self.by_expert = torch.tensor([[gub.at(e), dnb.at(e)] for e in range(E)], dtype=torch.int64)
        self.intermediate = experts.down.shape[-1]
        self._per_k: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._share = None  # expert parallelism: expert id -> its row in the share's tensors
        if experts.owned is not None:
            self._share = torch.full((max(experts.owned) + 1,), -1, dtype=torch.long)
            self._share[torch.tensor(experts.owned)] = torch.arange(len(experts.owned))

    def held(self, experts: torch.Tensor) -> torch.Tensor:
        """Expert ids -> their rows in the tensors this table points into (the ids themselves, or with
        expert parallelism their places in this rank's share)."""
        return experts if self._share is None else self._share[experts]

    def rows(self, experts: torch.Tensor, places: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pointer table int64 [k, 4] and formats int32 [k, 2] of `experts` (int64 [k]), whose
        weights are at `places` (their rows, `held`, or their cache slots)."""
        table = torch.cat([self.by_place[places], self.by_expert[self.held(experts)]], dim=1)
        return table, self.per_k(len(experts))[0]

    def per_k(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(formats int32 [k, 2], slot rows int32 [1, k] = 0 .. k-1), made once per k."""
        if k not in self._per_k:
            formats = torch.tensor([self.formats] * k, dtype=torch.int32)
            self._per_k[k] = formats, torch.arange(k, dtype=torch.int32).reshape(1, k)
        return self._per_k[k]


def _format(weight, pool: torch.Tensor) -> str:
    """The format name of a streamed projection's slots: the file's block format, or the pool's dtype."""
    return weight.format.name if isinstance(weight, QTensor) else native_weight(pool)[0]


_TABLES: weakref.WeakKeyDictionary[ExpertWeights, _Table] = weakref.WeakKeyDictionary()


def _table(experts: ExpertWeights) -> _Table:
    table = _TABLES.get(experts)
    if table is None:
        table = _TABLES[experts] = _Table(experts)
    return table


def _native_rule(routing) -> tuple[str, int, bool]:
    """The native router call's selection rule for `routing` (kind, k, renormalise)."""
    if isinstance(routing, SoftmaxTopK):
        return "softmax_topk", routing.k, routing.renormalize
    if isinstance(routing, TopKSoftmax):
        return "topk_softmax", routing.k, False
    return "logits_only", 0, False


def route_token(
    x: torch.Tensor,
    norm: torch.Tensor | None,
    eps: float,
    routing,
    t: Mapping[str, torch.Tensor],
    layer_name: str,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One token x float32 [H] (or tokens [T, H]) -> (h = rms_norm(x, norm), or None without a norm;
    router logits [E]; ids [k] ascending and weights [k], or None, None for a rule the native call
    does not have) in one native call; RouterError naming the layer when a logit is NaN or inf."""
    kind, k, renormalize = _native_rule(routing)
    try:
        return cpu.moe_route(x, norm, eps, t["router.weight"], t.get("router.bias"), kind, k, renormalize)
    except cpu.RouterLogitsNotFinite as exc:
        check_logits(exc.args[0].reshape(-1, exc.args[0].shape[-1]), layer_name)  # raises, naming the layer
        raise


def route_tokens(
    x: torch.Tensor, routing, t: Mapping[str, torch.Tensor], layer_name: str
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Tokens x [T, H] (already normed) -> (router logits [T, E], ids [T, k] ascending, weights
    [T, k]; or None, None for a rule the native call does not have), each token's alone: a token is
    routed to the same bits in any batch."""
    _, logits, ids, weights = route_token(x.float().contiguous(), None, 0.0, routing, t, layer_name)
    return logits, ids, weights


def token_forward(
    x: torch.Tensor, plan: TokenPlan, experts: ExpertWeights, act: Activation, options: KernelOptions
) -> torch.Tensor:
    """One token x [H] -> the weighted sum of its experts' outputs [H] fp32, summed in plan order."""
    table = _table(experts)
    ids = torch.tensor(plan.experts, dtype=torch.int64)
    places = table.held(ids) if experts.stream is None else experts.stream.slot_ids(ids).long()
    pointers, formats = table.rows(ids, places)
    k = len(plan.experts)
    slots = table.per_k(k)[1]
    out = cpu.moe_decode_table(
        x.float().reshape(1, -1),
        pointers,
        formats,
        table.intermediate,
        slots,
        plan.weights.float().reshape(1, k).contiguous(),
        act,
        integer=options.int8_on_cpu(experts.dtype),
    )
    return out[0]


def tokens_forward(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: ExpertWeights,
    act: Activation,
    options: KernelOptions,
    ws: Workspace | None = None,
) -> torch.Tensor:
    """Many tokens, x [T, H] with each token's k distinct experts ids [T, k] and weights [T, k]
    (a server's decode step, a prompt), in native calls: each of the step's distinct experts reads
    its rows once for all its tokens (the prefill GEMM where it has enough), each token's experts
    summed in ascending id, the plan order -> [T, H] fp32. Resident experts: one call. Streamed:
    one call per group of experts the cache holds at once (ascending, fetched in turn), each adding
    to the sums so far, which is the one call's sequence of additions: the same bits. Dense experts
    and more than NATIVE_ROWS tokens: each expert's rows through torch's GEMM instead (`ws` holds
    the buffers), resident and streamed alike."""
    dense = not isinstance(experts.gate_up, QTensor) and not isinstance(experts.down, QTensor)
    if dense and x.shape[0] > NATIVE_ROWS:
        plan = batch_plan(ids, weights, experts.gate_up.shape[0])
        ws = ws if ws is not None else Workspace()
        return combine(expert_rows(x, plan, experts, act, ws, options), plan, ws)
    order = torch.argsort(ids, dim=1, stable=True)
    ids, weights = torch.gather(ids, 1, order), torch.gather(weights.float(), 1, order).contiguous()
    return _decode_table(
        x.float().contiguous(), ids, weights, experts, act, options.int8_on_cpu(experts.dtype)
    )


def _decode_table(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: ExpertWeights,
    act: Activation,
    integer: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x fp32 [T, H], each token's experts ids [T, k] ascending and weights fp32 [T, k] -> [T, H]
    fp32 (into `out`), each token's weighted outputs summed in order, from 0: one native call, or
    streamed one per group of experts the cache holds at once."""
    table = _table(experts)
    stream = experts.stream
    groups = [torch.unique(ids)] if stream is None else [torch.tensor(g) for g in stream.groups()]
    out = out if out is not None else torch.empty(x.shape[0], x.shape[1], dtype=torch.float32)
    for i, group in enumerate(groups):  # ascending ids
        if stream is None:
            places = table.held(group)
        else:
            stream.tensors(int(group[0]))  # fetches the group (the previous one released)
            places = stream.slot_ids(group).long()
        at = torch.searchsorted(group, ids).clamp(max=len(group) - 1)  # [T, k]: index in the group
        slot_expert = torch.where(group[at] == ids, at, -1).to(torch.int32)
        pointers, formats = table.rows(group, places)
        cpu.moe_decode_table(
            x,
            pointers,
            formats,
            table.intermediate,
            slot_expert,
            weights,
            act,
            integer,
            out=out,
            accumulate=i > 0,
        )
    return out


def expert_rows(
    x: torch.Tensor,
    plan: BatchedPlan,
    experts: ExpertWeights,
    act: Activation,
    ws: Workspace,
    options: KernelOptions,
    only: Collection[int] | None = None,
) -> torch.Tensor:
    """x [T, H] -> weighted expert outputs [T*k, H] fp32, one row per assignment in plan order (a
    view of `ws`, valid until the next call); `only`: just these experts' rows, the others left unset.
    Where `tokens_forward` takes the native decode table (quantised experts, or up to NATIVE_ROWS
    tokens), so do these rows, an assignment a slot: each is that call's term w * y, so that their
    sum in plan order (expert parallelism: rows from several ranks) is its sum, the same bits."""
    integer = options.int8_on_cpu(experts.dtype)
    dense = not isinstance(experts.gate_up, QTensor) and not isinstance(experts.down, QTensor)
    if not dense or x.shape[0] <= NATIVE_ROWS:
        return _table_rows(x, plan, experts, act, ws, integer, only)

    def forward(rows: torch.Tensor, e: int) -> torch.Tensor:  # rows [R, H] -> [R, H]
        h = linear(rows, experts.stored("gate_up", e), experts.bias("gate_up", e), True, integer)  # [R, 2I]
        a = act(h.float()).to(x.dtype)  # [R, I]
        return linear(a, experts.stored("down", e), experts.bias("down", e), True, integer).float()

    return rows_by_expert(x, plan, ws, forward, only)


def _table_rows(
    x: torch.Tensor,
    plan: BatchedPlan,
    experts: ExpertWeights,
    act: Activation,
    ws: Workspace,
    integer: bool,
    only: Collection[int] | None,
) -> torch.Tensor:
    """expert_rows through the native decode table: every assignment (of `only`'s experts) one
    token of one slot, so its row is 0 + w * y, the decode step's term."""
    num_rows, E = plan.order.numel(), plan.offsets.numel() - 1
    rows = ws.get("rows", (num_rows, x.shape[1]), torch.float32, x.device)
    row_experts = plan.row_experts
    wanted = sorted(only) if only is not None else list(range(E))
    if not wanted:
        return rows
    if wanted == list(range(wanted[0], wanted[-1] + 1)):  # a span of experts: a span of rows, in place
        offsets = plan.offsets.tolist()
        start, stop = offsets[wanted[0]], offsets[wanted[-1] + 1]
        picked, out = slice(start, stop), rows[start:stop]
    else:
        picked = torch.isin(row_experts, torch.tensor(wanted, dtype=torch.long)).nonzero().view(-1)
        out = None
    ids = row_experts[picked]
    if ids.numel() == 0:
        return rows
    tokens = x.float()[plan.row_tokens[picked]].contiguous()
    weights = plan.row_weights[picked].float().reshape(-1, 1).contiguous()
    computed = _decode_table(tokens, ids.reshape(-1, 1), weights, experts, act, integer, out)
    if out is None:
        rows[picked] = computed
    return rows


def shared_expert(
    x: torch.Tensor,
    t: Mapping[str, torch.Tensor],
    act: Activation,
    options: KernelOptions,
    integer: bool | None = None,
) -> torch.Tensor:
    """x [T, H] -> the shared expert's output [T, H] fp32 (times sigmoid(x · gate) when gated).
    `integer`: int8 activations or not (default: as `options` say for x's dtype)."""
    integer = options.int8_on_cpu(x.dtype) if integer is None else integer
    h = linear(x, t["shared.gate_up"], native=True, integer=integer)
    y = linear(act(h.float()).to(x.dtype), t["shared.down"], native=True, integer=integer).float()
    gate = t.get("shared.gate")
    if gate is not None:
        y = y * torch.sigmoid(torch.nn.functional.linear(x.float(), gate))  # [T, 1]
    return y
