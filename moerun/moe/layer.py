"""The MoE layer: route -> plan -> experts -> combine (+ shared expert), on the run's backend.

Tensors are named canonically (`MoESpec.tensor_shapes`); converters from checkpoints and from
transformers' blocks produce these names, and `MoELayer.from_tensors` checks them all at once.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from moerun.activations import GLU, Activation
from moerun.errors import TensorError, shorten
from moerun.moe.backends import ActivationMode
from moerun.moe.backends.torch_backend import Norm, TorchBackend
from moerun.moe.backends.workspace import Workspace
from moerun.moe.experts import ExpertWeights
from moerun.moe.routing import (
    RouterCheck,
    RouterError,
    RouteSpec,
    raise_on_bad_router_logits,
    route,
    router_logits,
)
from moerun.moe.run import RunSpec
from moerun.moe.trace import layer_trace
from moerun.offload.stream import LayerStream
from moerun.placement import given_back, place
from moerun.quant.dequant import dequantize
from moerun.quant.formats import QTensor
from moerun.quant.halves import ExpertViews, GateUpHalves, file_views


@dataclass(frozen=True)
class MoESpec:
    hidden: int  # H
    intermediate: int  # I, per expert
    num_experts: int  # E
    routing: RouteSpec
    activation: Activation = field(default_factory=GLU)
    router_bias: bool = False
    score_bias: bool = False  # DeepSeek-V3's e_score_correction_bias (choice only)
    expert_bias: bool = False
    shared_intermediate: int = 0  # 0: no shared expert
    shared_gate: bool = False  # Qwen2-MoE: sigmoid(x · gate) scales the shared expert

    @property
    def top_k(self) -> int:
        return self.routing.k

    def tensor_shapes(self, held: int | None = None) -> dict[str, tuple[int, ...]]:
        """Canonical tensor name -> shape. Projections are [out, in], experts stacked first.
        `held`: the experts this process holds (expert parallelism: its share), default all E."""
        H, I, E = self.hidden, self.intermediate, self.num_experts
        X = E if held is None else held
        shapes = {"router.weight": (E, H), "experts.gate_up": (X, 2 * I, H), "experts.down": (X, H, I)}
        if self.router_bias:
            shapes["router.bias"] = (E,)
        if self.score_bias:
            shapes["router.score_bias"] = (E,)
        if self.expert_bias:
            shapes["experts.gate_up_bias"] = (X, 2 * I)
            shapes["experts.down_bias"] = (X, H)
        if self.shared_intermediate:
            S = self.shared_intermediate
            shapes["shared.gate_up"] = (2 * S, H)
            shapes["shared.down"] = (H, S)
            if self.shared_gate:
                shapes["shared.gate"] = (1, H)
        return shapes


class StateDictError(TensorError):
    """Tensors that do not fit a layer's spec (or a model's config)."""


# kept in fp32 whatever the compute dtype: routing runs in fp32
FP32_TENSORS = frozenset({"router.weight", "router.bias", "router.score_bias", "shared.gate"})
_EXPERT_PROJECTIONS = ("experts.gate_up", "experts.down")


class MoELayer:
    """One MoE block. Call it with x [T, H] or [B, T, H]; returns the same shape and dtype.

    `tensors` holds the canonical names (see MoESpec.tensor_shapes), placed as `from_tensors`
    places them: router tensors in fp32, the expert projections dense or as QTensor, everything
    else dense in the compute dtype. `run` (moerun.moe.run.RunSpec) says how it runs: the backend,
    streaming (the expert projections stay on the host and each step's experts are fetched into
    the shared expert cache's slots), expert parallelism (`tensors` hold only this rank's share of
    the experts, and each step's rows are exchanged with the other ranks before the combine)."""

    def __init__(
        self,
        spec: MoESpec,
        tensors: Mapping[str, torch.Tensor | QTensor],
        name: str = "moe",
        run: RunSpec | None = None,
    ):
        self.spec, self.name, self.tensors = spec, name, dict(tensors)
        self.run = run or layer_run(tensors)
        self.device, self.dtype = self.run.device, self.run.dtype
        ep = self.run.expert_parallel
        share = ep.shard(spec.num_experts) if ep is not None else None
        stream = None if self.run.expert_cache is None else LayerStream(self.run.expert_cache, name)
        self.experts = ExpertWeights(
            tensors["experts.gate_up"],
            tensors["experts.down"],
            (tensors.get("experts.gate_up_bias"), tensors.get("experts.down_bias")),
            dtype=self.dtype,
            layer_name=name,
            cache=self.run.dequant_cache,
            stream=stream,
            owned=None if share is None else range(share.start, share.stop),
        )
        self.parallel = ep
        self.backend = self.run.backend
        if reason := self.backend.unsupported(self.experts):
            warnings.warn(f"{reason}; such MoE layers run on the torch backend.", stacklevel=2)
            self.backend = TorchBackend()
        # prefill on a backend that needs every touched expert resident at once (one grouped GEMM)
        # goes through the torch backend's expert-by-expert path when the experts are streamed;
        # so do a rank's rows under expert parallelism
        by_expert = stream is None or self.backend.streams_prefill
        self.batch_backend = self.backend if by_expert else TorchBackend()
        self.rows_backend = self.backend if self.backend.streams_prefill else TorchBackend()
        self.workspace = Workspace()
        self._route_ms = 0.0

    @classmethod
    def from_tensors(
        cls,
        spec: MoESpec,
        tensors: Mapping[str, torch.Tensor | QTensor],
        name: str = "moe",
        run: RunSpec | None = None,
    ) -> MoELayer:
        """Check every tensor against the spec (all problems in one error), then place them and
        build the layer (`run` None: the torch backend in the dense experts' dtype, fp32 when every
        expert projection is quantised, on the router's device).

        Router tensors are kept in fp32; quantised expert projections stay quantised; the rest take
        the compute dtype. Streamed, the expert projections are left where they are (the store
        reads them) and every other tensor is copied off the checkpoint's map, so only the store
        touches the file. Expert parallelism: `tensors` hold this rank's share of the experts (cut
        by the model or the loader), and a rank other than 0 holds the rest as stand-ins."""
        run = run or layer_run(tensors)
        ep = run.expert_parallel
        held = ep.shard(spec.num_experts).size if ep is not None else None
        check_tensors(spec, tensors, name, held=held)
        streamed = run.expert_cache is not None
        placed = {}
        for key, tensor in tensors.items():
            if streamed and key in _EXPERT_PROJECTIONS:
                placed[key] = tensor
                continue
            if isinstance(tensor, GateUpHalves | ExpertViews):
                if _used_in_place(tensor, run):
                    placed[key] = tensor  # read in place by the native kernels
                    continue
                tensor = joined(tensor, run.dtype)
            if isinstance(tensor, QTensor) and key in _EXPERT_PROJECTIONS:
                # quantised experts stay where the file put them: no BLAS reads them, and the
                # quantised kernels' sums do not depend on an address
                placed[key] = QTensor(tensor.format, tensor.shape, tensor.data.to(run.device).contiguous())
            else:
                target = torch.float32 if key in FP32_TENSORS else run.dtype
                if run.serves_experts_only and not key.startswith("experts."):  # rank 0 routes
                    placed[key] = torch.empty(tensor.shape, dtype=target, device="meta")
                    continue
                if isinstance(tensor, QTensor):  # small non-expert tensors are used dense
                    tensor = dequantize(tensor)
                placed[key] = place(tensor, run.device, target, own=streamed)
        return cls(spec, placed, name=name, run=run)

    def __call__(
        self,
        x: torch.Tensor,
        after_fetch: Callable[[], None] | None = None,
        router_checks: list[RouterCheck] | None = None,
        norm: Norm | None = None,
    ) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.spec.hidden)  # [T, H]
        out = self.forward(x, after_fetch, router_checks, norm)
        return out.reshape(shape)

    def forward(
        self,
        x: torch.Tensor,
        after_fetch: Callable[[], None] | None = None,
        router_checks: list[RouterCheck] | None = None,
        norm: Norm | None = None,
    ) -> torch.Tensor:
        """x [T, H] -> the block's output [T, H] in x's dtype: route, share the inputs (expert
        parallelism), fetch (streaming), the experts and their ordered sum, the shared expert.

        `after_fetch` (streaming) runs once this step's first experts are fetched and pinned, before
        they compute: the model starts its prefetch for the next layer there. `router_checks`: the
        router-logit check is appended there, for the caller to read back with other layers' at once
        (a host sync per layer would stall a GPU); None: checked here. `norm` (the cpu backend's
        one-call decode step): x is the residual stream, normed by the route's native call."""
        spec, backend = self.spec, self.backend if x.shape[0] == 1 else self.batch_backend
        trace = layer_trace(self.name)
        with self._streamed_step():
            route_start = time.perf_counter()
            with trace.stage("route", x.device):
                h, ids, weights = self._route(backend, x, router_checks, norm, trace)
            self._route_ms = 1e3 * (time.perf_counter() - route_start)
            if self.parallel is not None:  # the other ranks start on their experts while this fetches
                self.parallel.share_inputs(h, ids, weights, self.name)
            if self.experts.stream is not None:  # the host stage: the step's experts into cache slots
                self._fetch(torch.unique(ids).tolist(), after_fetch)
            if self.parallel is not None:
                rows, plan = self._parallel_rows(h, ids, weights, trace)
                with trace.stage("combine", x.device):
                    out = self.rows_backend.combine(rows, plan, self.workspace)  # [T, H] fp32
            else:
                out = backend.experts(h, ids, weights, self.experts, spec.activation, self.workspace, trace)
            if spec.shared_intermediate:
                with trace.stage("shared", x.device):
                    out = out + backend.shared_expert(h, self.tensors, spec.activation)
        trace.finish(x.shape[0])
        return out.to(x.dtype)

    def _route(self, backend, x: torch.Tensor, router_checks, norm: Norm | None, trace):
        """-> (the tokens the experts read [T, H], ids [T, k] ascending, weights [T, k])."""
        spec, t = self.spec, self.tensors
        checks = router_checks if router_checks is not None else []
        h, logits, ids, weights = backend.route(x, spec.routing, t, self.name, checks, norm)  # [T, E]
        if router_checks is None:
            try:
                raise_on_bad_router_logits(checks)
            except RouterError:
                trace.router_figures(logits, None, None, spec.num_experts)
                raise
        if ids is None:  # a selection rule the backend's route does not make: torch's, on its logits
            weights, ids = route(spec.routing, logits, t.get("router.score_bias"))  # [T, k]
        trace.router_figures(logits, ids, weights, spec.num_experts)
        return h, ids, weights

    @contextlib.contextmanager
    def _streamed_step(self):
        """Around a step; streaming: its experts released after it, and its route and compute times
        (fetches left out) recorded in the cache's stats."""
        stream = self.experts.stream
        if stream is None:
            yield
            return
        self._route_ms = 0.0
        start, fetched = time.perf_counter(), stream.fetch_s
        try:
            yield
        finally:
            stream.end()
            total_ms = 1e3 * (time.perf_counter() - start)
            route_ms = self._route_ms
            stream.cache.record(route_ms, total_ms - route_ms - 1e3 * (stream.fetch_s - fetched))

    def _parallel_rows(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, trace):
        """Expert parallelism: the rows of this rank's experts (one contiguous span of the plan's),
        brought to rank 0 -> (rows [T*k, H] fp32: on rank 0 every rank's, the plan)."""
        backend = self.rows_backend  # expert by expert (torch's or the native kernels')
        with trace.stage("plan", x.device):
            plan = backend.batch_plan(ids, weights, self.spec.num_experts)
        start = time.perf_counter()
        with trace.stage("experts", x.device):
            rows = backend.expert_rows(
                x, plan, self.experts, self.spec.activation, self.workspace, self.experts.owned
            )  # [T*k, H] fp32, this rank's span set (the exchange brings the rest)
        self.parallel.record_experts(1e3 * (time.perf_counter() - start))
        with trace.stage("exchange", x.device):
            spans = self.parallel.spans(plan.offsets.tolist(), self.spec.num_experts)
            self.parallel.exchange(rows, spans, self.name)
        return rows, plan

    def serve_step(
        self,
        tokens: int,
        dtype: torch.dtype,
        predicted: bool = False,
        prefetch: Callable[[torch.Tensor], None] | None = None,
    ) -> bool:
        """Expert parallelism, a rank other than 0: this layer's part of rank 0's step of `tokens`
        tokens: its inputs received, its own experts' rows computed (fetched first when streamed)
        and sent back. `predicted`: the inputs carry the next MoE layer's expert mass, and
        `prefetch(mass)` (streaming) starts loading from it once this layer's experts are fetched.
        False where rank 0 called off the rest of the step instead."""
        spec = self.spec
        inputs = self.parallel.receive_inputs(
            tokens, spec.hidden, spec.top_k, dtype, self.name, self.device, predicted
        )
        if inputs is None:
            return False
        x, ids, weights, mass = inputs
        after_fetch = functools.partial(prefetch, mass) if prefetch is not None and mass is not None else None
        with self._streamed_step():  # rank 0 routed
            if self.experts.stream is not None:
                self._fetch(torch.unique(ids).tolist(), after_fetch)
            self._parallel_rows(x, ids, weights, layer_trace(self.name))
        return True

    def expert_mass(self, h: torch.Tensor) -> torch.Tensor:
        """This layer's routing probabilities for normed hidden states h [..., H], summed over the
        tokens -> [E] fp32: the prediction of which experts it will run (prefetch)."""
        t = self.tensors
        logits = router_logits(h.reshape(-1, self.spec.hidden), t["router.weight"], t.get("router.bias"))
        return logits.softmax(dim=-1).sum(dim=0)

    def _fetch(self, experts: list[int], after_fetch: Callable[[], None] | None) -> None:
        """Streaming: announce the step's experts this process computes (ascending) to the cache;
        the first group loads, then `after_fetch` runs."""
        self.experts.stream.begin([int(e) for e in self.experts.owned_of(experts)])
        if after_fetch is not None:
            after_fetch()


def _used_in_place(weight: GateUpHalves | ExpertViews, run: RunSpec) -> bool:
    """Whether the layer keeps routed experts where the file put them (gate and up apart, or each
    expert's matrix on its own): on the CPU, for a backend whose kernels read them so, when they need
    no conversion to the compute dtype."""
    quantised = isinstance(weight, GateUpHalves) and weight.quantised
    return (
        run.device.type == "cpu"
        and run.backend.reads_experts_in_place
        and (quantised or weight.dtype == run.dtype)
    )


def joined(weight: GateUpHalves | ExpertViews, dtype: torch.dtype | None = None):
    """The experts as one [E, rows, H] weight in RAM (matrices that lie apart stacked in `dtype`; the
    rest keep theirs, converted when placed), the file map's pages of them given back."""
    out = weight.joined(dtype) if isinstance(weight, GateUpHalves) else weight.stacked(dtype)
    given_back(*file_views(weight))
    return out


def layer_run(
    tensors: Mapping[str, torch.Tensor | QTensor],
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    backend: str = "torch",
    activations: ActivationMode | None = None,
) -> RunSpec:
    """The run of a layer made on its own (tests, benchmarks, transformers' blocks): `backend` in
    `dtype` (default: the dense expert weights' dtype, fp32 when every expert projection is
    quantised) on `device` (default: the router's), `activations` as make_backend decides them."""
    device = device if device is not None else tensors["router.weight"].device
    return RunSpec.make(device, dtype or _compute_dtype(tensors), backend, activations)


def _compute_dtype(tensors: Mapping[str, torch.Tensor | QTensor]) -> torch.dtype:
    """The dense expert weights' dtype; fp32 when every expert projection is quantised."""
    for key in _EXPERT_PROJECTIONS:
        if key in tensors and not isinstance(tensors[key], QTensor):
            return tensors[key].dtype
    return torch.float32


def tensor_problems(
    expected: Mapping[str, tuple[int, ...]],
    tensors: Mapping[str, torch.Tensor | QTensor],
    sources: Mapping[str, str] | None = None,
    limit: int | None = None,
) -> list[str]:
    """Every missing, unexpected, mis-shaped and non-floating tensor against `expected` shapes, as
    parts of one message. `sources` maps a canonical name to the checkpoint name it comes from; name
    lists longer than `limit` are cut short."""

    def label(key: str) -> str:
        source = sources.get(key, key) if sources else key
        return shorten(key, 80) + (f" ({shorten(source, 80)})" if source != key else "")

    def listed(names: list[str]) -> str:
        if limit is not None and len(names) > limit:
            names = [*names[:limit], f"... ({len(names) - limit} more)"]
        return ", ".join(names)

    missing = [label(key) for key in expected if key not in tensors]
    unexpected = [shorten(key, 80) for key in tensors if key not in expected]
    misshaped = [
        f"{label(key)} is {tuple(tensors[key].shape)}, expected {shape}"
        for key, shape in expected.items()
        if key in tensors and tuple(tensors[key].shape) != shape
    ]
    if limit is not None and len(misshaped) > limit:
        misshaped = [*misshaped[:limit], f"... ({len(misshaped) - limit} more)"]
    not_float = [
        label(key)
        for key in expected
        if key in tensors
        and not isinstance(tensors[key], QTensor | GateUpHalves)
        and not tensors[key].is_floating_point()
    ]
    problems = []
    if missing:
        problems.append("missing " + listed(missing))
    if unexpected:
        problems.append("unexpected " + listed(unexpected))
    if misshaped:
        problems.append("mis-shaped: " + "; ".join(misshaped))
    if not_float:
        problems.append("not floating point: " + listed(not_float))
    return problems


def check_tensors(
    spec: MoESpec,
    tensors: Mapping[str, torch.Tensor],
    name: str,
    sources: Mapping[str, str] | None = None,
    held: int | None = None,
) -> None:
    """Raise one StateDictError listing every missing, unexpected and mis-shaped tensor.

    `sources` maps a canonical name to the checkpoint name it came from, for the message; `held`:
    the experts the tensors hold (expert parallelism: a rank's share; default all)."""
    problems = tensor_problems(spec.tensor_shapes(held), tensors, sources)
    if problems:
        raise StateDictError(
            f"Tensors for MoE layer {name!r} do not fit its config: " + " | ".join(problems) + "."
        )
