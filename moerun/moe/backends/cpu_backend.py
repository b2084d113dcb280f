"""The cpu backend: the MoE layer on moerun's native CPU kernels (moerun.cpu), weights in the file's
format.

Decode (one token) is ONE native call: a pointer table over the token's k experts (resident: rows
of the layer's [E, ...] tensors; streamed: the cache's slots, which never move), then gate/up of all
k, the activation with the routing weight, down and the ordered row sum in one parallel region.
Many tokens (a server's decode step, a prompt) are one native call too, each expert's rows read
once for all its tokens (the prefill GEMM where it has enough of them), except dense experts with
more rows than moerun.linear gives the native kernels: those gather each expert's rows into torch's
GEMM (oneDNN, faster on many rows), the combine summing each token's rows in plan order.
The activation mode (decided once at load, moerun.moe.backends.make_backend): activations quantised
per block to int8 for integer dot products, as llama.cpp does. The model's one-token decode step in
native calls (`one_call_decode`) is moerun.decoder.native_step, which routes through `route` with
the model's norm fused and runs the experts through `experts`.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from moerun import cpu
from moerun.activations import Activation
from moerun.cpu.library import FORMAT_IDS
from moerun.errors import TensorError
from moerun.linear import NATIVE_ROWS, native_linear, native_weight
from moerun.moe.backends.torch_backend import Norm, TorchBackend, batch_plan, combine, rows_by_expert
from moerun.moe.backends.workspace import Workspace
from moerun.moe.experts import ExpertWeights
from moerun.moe.plan import BatchedPlan
from moerun.moe.routing import RouterCheck, SoftmaxTopK, TopKSoftmax, check_logits
from moerun.moe.trace import LayerTrace
from moerun.quant.formats import QTensor
from moerun.quant.halves import ExpertViews, GateUpHalves
from moerun.quant.scales import first_nonfinite_block


@dataclass(frozen=True)
class _Column:
    """Where expert (or slot) i's part of one projection or bias lies: base + i * stride bytes, or
    `apart[i]` for matrices that lie apart (ExpertViews: each expert's tensor of a checkpoint)."""

    base: int
    stride: int
    apart: tuple[int, ...] = ()

    @classmethod
    def of(cls, stacked: torch.Tensor | ExpertViews | None) -> _Column:
        if stacked is None:
            return cls(0, 0)
        if isinstance(stacked, ExpertViews):
            return cls(0, 0, tuple(view.data_ptr() for view in stacked.views))
        return cls(stacked.data_ptr(), stacked.stride(0) * stacked.element_size())

    def at(self, i: int) -> int:
        if self.apart:
            return self.apart[i]
        return self.base + i * self.stride if self.base else 0


class _Table:
    """One layer's experts as the native decode step reads them. The tensors never move (resident
    weights, or the cache's slot pool), so their addresses are read once: `by_place` holds every
    expert's (or slot's) weight addresses (gate_up's gate half, its up half, the bytes between their
    rows, down), `by_expert` every expert's bias addresses. Resident gate and up stored apart
    (GateUpHalves), and experts whose matrices lie apart (ExpertViews), are read where the file put
    them; a joined gate_up [2I, H] (a slot, or a whole weight) is read as its halves: gate rows then
    up rows, or (`interleaved`) alternating rows."""

    def __init__(self, experts: ExpertWeights, interleaved: bool):
        I = experts.down.shape[-1]  # noqa: E741
        down = _stacked(experts, "down", experts.down)
        if isinstance(experts.gate_up, GateUpHalves):  # resident, as the file stores them
            halves = [native_weight(part) for part in (experts.gate_up.gate, experts.gate_up.up)]
            gate, up = (_Column.of(t) for _, t in halves)
            fmt, rows = halves[0]
            stride = _row_stride(rows)
        else:  # one joined weight [places, 2I, row]
            fmt, rows = _stacked(experts, "gate_up", experts.gate_up)
            gate = _Column.of(rows)
            up = _Column(gate.base + (1 if interleaved else I) * _row_stride(rows), gate.stride)
            stride = _row_stride(rows) * (2 if interleaved else 1)
        self.formats = [FORMAT_IDS[fmt], FORMAT_IDS[down[0]]]
        dn = _Column.of(down[1])
        # the kernels add fp32 biases, gate's then up's; kept here, as the columns point into them
        gate_up_bias, down_bias = experts.gate_up_bias, experts.down_bias
        if gate_up_bias is not None and interleaved:
            gate_up_bias = cpu.gate_then_up(gate_up_bias)
        self._biases = [None if b is None else b.float().contiguous() for b in (gate_up_bias, down_bias)]
        gub, dnb = (_Column.of(b) for b in self._biases)  # indexed by expert
        places, E = down[1].shape[0], experts.gate_up.shape[0]
        self.by_place = torch.tensor(
            [[gate.at(p), up.at(p), stride, dn.at(p)] for p in range(places)], dtype=torch.int64
        )
        self.by_expert = torch.tensor([[gub.at(e), dnb.at(e)] for e in range(E)], dtype=torch.int64)
        self.intermediate = I
        self._per_k: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stream = experts.stream  # by_place is indexed by its slots; None: by expert row
        # resident quantised experts are read where the file put them, so their scales are checked
        # here as each is first used (the expert store checks what it reads; torch's copies at load)
        self._unchecked = None
        if experts.stream is None and experts.quantised:
            self._checked_weights = (experts.layer_name, experts.gate_up, experts.down)
            self._unchecked = torch.ones(len(self.by_expert), dtype=torch.bool)
        self._share = None  # expert parallelism: expert id -> its row in the share's tensors
        if experts.owned is not None:
            self._share = torch.full((max(experts.owned) + 1,), -1, dtype=torch.long)
            self._share[torch.tensor(list(experts.owned))] = torch.arange(len(experts.owned))

    def held(self, experts: torch.Tensor) -> torch.Tensor:
        """Expert ids -> their rows in the tensors this table points into (the ids themselves, or with
        expert parallelism their places in this rank's share)."""
        return experts if self._share is None else self._share[experts]

    def rows(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pointer table int64 [k, 6] and formats int32 [k, 2] of `experts` (int64 [k]): their
        weights at their rows (`held`) or, streamed, at the cache slots they are fetched into now."""
        held = self.held(experts)
        if self._unchecked is not None and bool(self._unchecked[held].any()):
            self._check_scales(experts, held)
        places = held if self._stream is None else self._stream.slot_ids(experts).long()
        table = torch.cat([self.by_place[places], self.by_expert[held]], dim=1)
        return table, self.per_k(len(experts))[0]

    def _check_scales(self, experts: torch.Tensor, held: torch.Tensor) -> None:
        """Refuses an expert of `experts` not checked yet with a block whose fp16 scale is inf or NaN
        (every logit would be NaN), naming the layer, the expert, its projection and the block."""
        for e, row in zip(experts.tolist(), held.tolist(), strict=True):
            if not self._unchecked[row]:
                continue
            layer, gate_up, down = self._checked_weights
            parts = (
                (("gate", gate_up.gate), ("up", gate_up.up))
                if isinstance(gate_up, GateUpHalves)
                else (("gate_up", gate_up),)
            )
            for name, weight in (*parts, ("down", down)):
                if not isinstance(weight, QTensor):
                    continue
                block = first_nonfinite_block(weight.format, weight.data[row])
                if block is not None:
                    raise TensorError(
                        f"{layer}: expert {e}'s {name} weights ({weight.format.name}): "
                        f"block {block} has a scale that is not a number (inf or NaN); the file is damaged "
                        "or was written wrong."
                    )
            self._unchecked[row] = False
        if not self._unchecked.any():
            self._unchecked = None

    def per_k(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(formats int32 [k, 2], slot rows int32 [1, k] = 0 .. k-1), made once per k."""
        if k not in self._per_k:
            formats = torch.tensor([self.formats] * k, dtype=torch.int32)
            self._per_k[k] = formats, torch.arange(k, dtype=torch.int32).reshape(1, k)
        return self._per_k[k]


def _stacked(experts: ExpertWeights, projection: str, weight) -> tuple[str, torch.Tensor]:
    """(format name, [places, rows, row]) of a projection: the resident weight, or the cache's slot
    pool (in the file's block format, or the pool's dtype)."""
    if experts.stream is None:
        return native_weight(weight)
    pool = experts.stream.cache.pool_buffers(experts.stream.layer)[projection]
    if isinstance(weight, QTensor):
        return weight.format.name, pool
    return native_weight(pool)[0], pool


def _row_stride(rows: torch.Tensor | ExpertViews) -> int:
    """Bytes from one row of a [places, rows, row] weight to the next."""
    return rows.row_stride if isinstance(rows, ExpertViews) else rows.stride(-2) * rows.element_size()


_TABLES: weakref.WeakKeyDictionary[ExpertWeights, _Table] = weakref.WeakKeyDictionary()


def _table(experts: ExpertWeights, act: Activation) -> _Table:
    table = _TABLES.get(experts)
    if table is None:
        table = _TABLES[experts] = _Table(experts, act.interleaved)
    return table


def _native_rule(routing) -> tuple[str, int, bool]:
    """The native router call's selection rule for `routing` (kind, k, renormalise)."""
    if isinstance(routing, SoftmaxTopK):
        return "softmax_topk", routing.k, routing.renormalize
    if isinstance(routing, TopKSoftmax):
        return "topk_softmax", routing.k, False
    return "logits_only", 0, False


class CpuBackend(TorchBackend):
    """The native CPU kernels (moerun.cpu) for every linear and the MoE step, weights kept in the
    file's format; activations int8 or exact as make_backend decided."""

    name = "cpu"
    streams_prefill = True  # a step runs one native call per group of experts the cache holds
    native_linears = True
    one_call_decode = True
    reads_experts_in_place = True

    def unsupported(self, experts: ExpertWeights) -> str | None:
        if not cpu.available():
            return f"the native CPU kernels are not available ({cpu.unavailable_reason()})"
        return None

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype, on the native kernels (moerun.linear)."""
        return native_linear(x, weight, bias, self.int8_activations)

    def route(
        self,
        x: torch.Tensor,
        routing,
        t: Mapping[str, torch.Tensor],
        layer_name: str,
        checks: list[RouterCheck],
        norm: Norm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One native call: each token of x [T, H] routed alone (the same bits in any batch); with
        `norm` x is the residual stream (fp32) and the call applies the model's RMSNorm first,
        returning the normed tokens. The logits are checked here (RouterError naming the layer)."""
        kind, k, renormalize = _native_rule(routing)
        weight, eps = norm if norm is not None else (None, 0.0)
        router = t["router.weight"], t.get("router.bias")
        try:
            x32 = x.float().contiguous()
            h, logits, ids, weights = cpu.moe_route(x32, weight, eps, *router, kind, k, renormalize)
        except cpu.RouterLogitsNotFinite as exc:
            check_logits(exc.args[0].reshape(-1, exc.args[0].shape[-1]), layer_name)  # raises, naming it
            raise
        return (x if h is None else h), logits, ids, weights

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
        """One native call (`tokens_forward`: a call per group of streamed experts); one token's
        decode step by the shortest way there (`_one_token`), the same call."""
        with trace.stage("experts", x.device):
            if x.shape[0] == 1:
                return self._one_token(x, ids, weights, experts, act)
            return self.tokens_forward(x, ids, weights, experts, act, ws)

    def _one_token(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        experts: ExpertWeights,
        act: Activation,
    ) -> torch.Tensor:
        """One token x [1, H] and its k experts ids [1, k], ascending as every route gives them, with
        weights [1, k] -> [1, H] fp32: `tokens_forward`'s one call without its grouping (a decode
        step's experts are fetched together, the cache holding at least k slots a layer)."""
        table = _table(experts, act)
        ids = ids.reshape(-1)
        pointers, formats = table.rows(ids)
        slots = table.per_k(len(ids))[1]
        step = cpu.ExpertTable(pointers, formats, table.intermediate)
        routed = (slots, weights.float().reshape(1, -1).contiguous())
        return cpu.moe_decode_table(x.float().reshape(1, -1), step, routed, act, self.int8_activations)

    def tokens_forward(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        experts: ExpertWeights,
        act: Activation,
        ws: Workspace | None = None,
    ) -> torch.Tensor:
        """Tokens x [T, H] with each token's k distinct experts ids [T, k] and weights [T, k] (one
        token's decode step, a server's decode step, a prompt), in native calls: each of the step's
        distinct experts reads its rows once for all its tokens (the prefill GEMM where it has
        enough), each token's experts summed in ascending id, the plan order -> [T, H] fp32.
        Resident experts: one call. Streamed: one call per group of experts the cache holds at once
        (ascending, fetched in turn), each adding to the sums so far, which is the one call's
        sequence of additions: the same bits. Dense experts and more than NATIVE_ROWS tokens: each
        expert's rows through torch's GEMM instead (`ws` holds the buffers), resident and streamed
        alike. Activations are int8 or not as the backend was made."""
        dense = not experts.quantised
        if dense and x.shape[0] > NATIVE_ROWS:
            plan = batch_plan(ids, weights, experts.gate_up.shape[0])
            ws = ws if ws is not None else Workspace()
            return combine(self.expert_rows(x, plan, experts, act, ws), plan, ws)
        order = torch.argsort(ids, dim=1, stable=True)
        ids, weights = torch.gather(ids, 1, order), torch.gather(weights.float(), 1, order).contiguous()
        return self._decode_table(x.float().contiguous(), ids, weights, experts, act)

    def _decode_table(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        experts: ExpertWeights,
        act: Activation,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x fp32 [T, H], each token's experts ids [T, k] ascending and weights fp32 [T, k] -> [T, H]
        fp32 (into `out`), each token's weighted outputs summed in order, from 0: one native call, or
        streamed one per group of experts the cache holds at once."""
        table = _table(experts, act)
        stream = experts.stream
        groups = [torch.unique(ids)] if stream is None else [torch.tensor(g) for g in stream.groups()]
        out = out.zero_() if out is not None else torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
        for group in groups:  # ascending ids, each call adding onto the sums so far
            if stream is not None:
                stream.tensors(int(group[0]))  # fetches the group (the previous one released)
            at = torch.searchsorted(group, ids).clamp(max=len(group) - 1)  # [T, k]: index in the group
            slot_expert = torch.where(group[at] == ids, at, -1).to(torch.int32)
            pointers, formats = table.rows(group)
            step = cpu.ExpertTable(pointers, formats, table.intermediate)
            cpu.moe_decode_table(x, step, (slot_expert, weights), act, self.int8_activations, out=out)
        return out

    def expert_rows(
        self,
        x: torch.Tensor,
        plan: BatchedPlan,
        experts: ExpertWeights,
        act: Activation,
        ws: Workspace,
        only: Collection[int] | None = None,
    ) -> torch.Tensor:
        """x [T, H] -> weighted expert outputs [T*k, H] fp32, one row per assignment in plan order (a
        view of `ws`, valid until the next call); `only`: just these experts' rows, the others left unset;
        activations int8 or not as the backend decided.
        Where `tokens_forward` takes the native decode table (quantised experts, or up to NATIVE_ROWS
        tokens), so do these rows, an assignment a slot: each is that call's term w * y, so that their
        sum in plan order (expert parallelism: rows from several ranks) is its sum, the same bits."""
        dense = not experts.quantised
        if not dense or x.shape[0] <= NATIVE_ROWS:
            return self._table_rows(x, plan, experts, act, ws, only)

        def forward(rows: torch.Tensor, e: int) -> torch.Tensor:  # rows [R, H] -> [R, H]
            h = self.linear(rows, experts.stored("gate_up", e), experts.bias("gate_up", e))  # [R, 2I]
            a = act(h.float()).to(x.dtype)  # [R, I]
            return self.linear(a, experts.stored("down", e), experts.bias("down", e)).float()

        return rows_by_expert(x, plan, ws, forward, only)

    def _table_rows(
        self,
        x: torch.Tensor,
        plan: BatchedPlan,
        experts: ExpertWeights,
        act: Activation,
        ws: Workspace,
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
        computed = self._decode_table(tokens, ids.reshape(-1, 1), weights, experts, act, out)
        if out is None:
            rows[picked] = computed
        return rows

    def shared_expert(self, x: torch.Tensor, t: Mapping[str, torch.Tensor], act: Activation) -> torch.Tensor:
        """x [T, H] -> the shared expert's output [T, H] fp32 (times sigmoid(x · gate) when gated);
        activations int8 or not as the backend decided."""
        h = self.linear(x, t["shared.gate_up"])
        y = self.linear(act(h.float()).to(x.dtype), t["shared.down"]).float()
        gate = t.get("shared.gate")
        if gate is not None:
            y = y * torch.sigmoid(torch.nn.functional.linear(x.float(), gate))  # [T, 1]
        return y
