"""The MoE layer: route -> plan -> experts -> combine (+ shared expert), on a chosen backend.

Tensors are named canonically (`MoESpec.tensor_shapes`); converters from checkpoints and from
transformers' blocks produce these names, and `MoELayer.from_tensors` checks them all at once.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from moerun.activations import GLU, Activation
from moerun.errors import TensorError, shorten
from moerun.moe.backends import DEFAULT_KERNEL_OPTIONS, Backend, KernelOptions, get_backend, torch_backend
from moerun.moe.backends.workspace import Workspace
from moerun.moe.experts import ExpertWeights
from moerun.moe.plan import TokenPlan
from moerun.moe.routing import (
    RouterCheck,
    RouterError,
    RouteSpec,
    check_logits,
    deferred_check,
    route,
    router_logits,
)
from moerun.moe.trace import layer_trace
from moerun.placement import place
from moerun.quant.cache import DequantCache
from moerun.quant.dequant import dequantize
from moerun.quant.formats import QTensor


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

    `tensors` holds the canonical names (see MoESpec.tensor_shapes): router tensors in fp32, the
    expert projections dense or as QTensor, everything else dense in the compute dtype."""

    def __init__(
        self,
        spec: MoESpec,
        tensors: Mapping[str, torch.Tensor | QTensor],
        name: str = "moe",
        backend: str | Backend = "torch",
        dtype: torch.dtype | None = None,
        dequant_cache: DequantCache | None = None,
        stream=None,
        options: KernelOptions = DEFAULT_KERNEL_OPTIONS,
        parallel=None,
        device: torch.device | str | None = None,
    ):
        """`stream` (a moerun.offload.LayerStream): the expert projections in `tensors` stay on the
        host and each step's experts are fetched into the shared expert cache's slots. `options`:
        how the kernels compute (moerun.moe.backends.KernelOptions). `parallel` (expert
        parallelism: a moerun.distributed.ExpertParallel): `tensors` hold only this rank's share of
        the experts (`parallel.shard(E).owned`), and each step's rows are exchanged with the other
        ranks before the combine."""
        self.spec = spec
        self.device = torch.device(device) if device is not None else tensors["router.weight"].device
        self.options = options
        self.name = name
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.tensors = dict(tensors)
        dense_experts = [
            t for k, t in tensors.items() if k in _EXPERT_PROJECTIONS and not isinstance(t, QTensor)
        ]
        self.dtype = dtype or (dense_experts[0].dtype if dense_experts else torch.float32)
        self.experts = ExpertWeights(
            tensors["experts.gate_up"],
            tensors["experts.down"],
            tensors.get("experts.gate_up_bias"),
            tensors.get("experts.down_bias"),
            dtype=self.dtype,
            layer_name=name,
            cache=dequant_cache,
            stream=stream,
            owned=parallel.shard(spec.num_experts).owned if parallel is not None else None,
        )
        self.parallel = parallel
        unsupported = getattr(self.backend, "unsupported", None)
        if unsupported is not None and (reason := unsupported(self.experts)):
            warnings.warn(f"{reason}; such MoE layers run on the torch backend.", stacklevel=2)
            self.backend = get_backend("torch")
        # prefill on a backend that needs every touched expert resident at once (one grouped GEMM)
        # goes through the torch backend's expert-by-expert path when the experts are streamed
        streams_prefill = stream is None or self.backend.STREAMS_PREFILL
        self.batch_backend = self.backend if streams_prefill else get_backend("torch")
        self.workspace = Workspace()
        self._route_ms = 0.0

    @classmethod
    def from_tensors(
        cls,
        spec: MoESpec,
        tensors: Mapping[str, torch.Tensor | QTensor],
        name: str = "moe",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        backend: str = "torch",
        dequant_cache: DequantCache | None = None,
        stream=None,
        options: KernelOptions = DEFAULT_KERNEL_OPTIONS,
        parallel=None,
    ) -> MoELayer:
        """Check every tensor against the spec (all problems in one error), then build the layer.

        Router tensors are kept in fp32; quantised expert projections stay quantised; the rest take
        `dtype` (default: the dense expert weights' dtype, or fp32 when all of them are quantised).
        With a `stream` the expert projections are left where they are (the store reads them) and
        every other tensor is copied off the checkpoint's map, so only the store touches the file.
        With `parallel`, `tensors` hold this rank's share of the experts, or all of them, cut here
        (views: the rest of a mapped file is never read; streamed: the store reads only the owned)."""
        held = None
        if parallel is not None:
            shard = parallel.shard(spec.num_experts)
            tensors, held = shard.cut(tensors), shard.size
        check_tensors(spec, tensors, name, held=held)
        dtype = dtype or _compute_dtype(tensors)
        # expert parallelism, a rank other than 0: it computes its experts' rows, nothing else
        serves_experts_only = parallel is not None and not parallel.leads
        placed = {}
        for key, tensor in tensors.items():
            if stream is not None and key in _EXPERT_PROJECTIONS:
                placed[key] = tensor
                continue
            if isinstance(tensor, QTensor) and key in _EXPERT_PROJECTIONS:
                # quantised experts stay where the file put them: no BLAS reads them, and the
                # quantised kernels' sums do not depend on an address
                placed[key] = QTensor(tensor.format, tensor.shape, tensor.data.to(device).contiguous())
                continue
            target = torch.float32 if key in FP32_TENSORS else dtype
            if serves_experts_only and not key.startswith("experts."):  # rank 0 routes, adds the shared
                placed[key] = torch.empty(tensor.shape, dtype=target, device="meta")
                continue
            if isinstance(tensor, QTensor):  # small non-expert tensors are used dense
                tensor = dequantize(tensor)
            placed[key] = place(tensor, device, target, own=stream is not None)
        return cls(
            spec,
            placed,
            name=name,
            backend=backend,
            dtype=dtype,
            dequant_cache=dequant_cache,
            stream=stream,
            options=options,
            parallel=parallel,
            device=device or "cpu",
        )

    def __call__(
        self,
        x: torch.Tensor,
        after_fetch: Callable[[], None] | None = None,
        router_checks: list[RouterCheck] | None = None,
    ) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.spec.hidden)  # [T, H]
        out = self.forward(x, after_fetch, router_checks)
        return out.reshape(shape)

    def forward(
        self,
        x: torch.Tensor,
        after_fetch: Callable[[], None] | None = None,
        router_checks: list[RouterCheck] | None = None,
    ) -> torch.Tensor:
        """`after_fetch` (streaming only) runs once this step's first experts are fetched and pinned,
        before they compute: the model starts its prefetch for the next layer there.
        `router_checks`: the router-logit check is appended there, for the caller to read back with
        other layers' at once (a host sync per layer would stall a GPU); None: checked here."""
        return self._streamed_step(self._forward, x, after_fetch, router_checks)

    def _streamed_step(self, step: Callable, x: torch.Tensor, after_fetch: Callable[[], None] | None, *args):
        """step(x, after_fetch, *args); streaming: the step's experts released after it and its
        route and compute times (fetches left out) recorded in the cache's stats."""
        stream = self.experts.stream
        if stream is None:
            return step(x, None, *args)
        start, fetched = time.perf_counter(), stream.fetch_s
        try:
            return step(x, after_fetch, *args)
        finally:
            stream.end()
            total_ms = 1e3 * (time.perf_counter() - start)
            route_ms = self._route_ms
            stream.cache.record(route_ms, total_ms - route_ms - 1e3 * (stream.fetch_s - fetched))

    def _forward(
        self, x: torch.Tensor, after_fetch: Callable[[], None] | None, router_checks: list[RouterCheck] | None
    ) -> torch.Tensor:
        spec, t = self.spec, self.tensors
        backend = self.backend if x.shape[0] == 1 else self.batch_backend
        trace = layer_trace(self.name)
        route_start = time.perf_counter()
        with trace.stage("route", x.device):
            if hasattr(backend, "route_tokens"):  # native: each token routed alone, checked at once
                logits, ids, weights = backend.route_tokens(x, spec.routing, t, self.name)  # [T, E], [T, k]
            else:
                logits, ids = router_logits(x, t["router.weight"], t.get("router.bias")), None  # [T, E] fp32
                if router_checks is not None:  # the caller reads every layer's check back at once
                    router_checks.append(deferred_check(logits, self.name))
                else:
                    try:
                        check_logits(logits, self.name)
                    except RouterError:
                        trace.router_figures(logits, None, None, spec.num_experts)
                        raise
            if ids is None:
                weights, ids = route(spec.routing, logits, t.get("router.score_bias"))  # [T, k]
            trace.router_figures(logits, ids, weights, spec.num_experts)
        self._route_ms = 1e3 * (time.perf_counter() - route_start)
        if self.parallel is not None:  # the other ranks start on their experts while this fetches
            self.parallel.share_inputs(x, ids, weights, self.name)
        if self.experts.stream is not None:  # the host stage: the step's experts into cache slots
            self._fetch(self.owned_of(torch.unique(ids).tolist()), after_fetch)
        if self.parallel is not None:
            rows, plan = self._parallel_rows(x, ids, weights, trace)
            with trace.stage("combine", x.device):
                out = torch_backend.combine(rows, plan, self.workspace)  # [T, H] fp32
        elif x.shape[0] == 1:
            with trace.stage("plan", x.device):
                plan = backend.token_plan(ids, weights, self.name)
            with trace.stage("experts", x.device):  # the experts and their ordered sum
                out = backend.token_forward(x[0], plan, self.experts, spec.activation, self.options)[None]
        elif hasattr(backend, "tokens_forward"):  # the step's experts and their sums in native calls
            with trace.stage("experts", x.device):
                out = backend.tokens_forward(
                    x, ids, weights, self.experts, spec.activation, self.options, self.workspace
                )
        else:
            with trace.stage("plan", x.device):
                plan = backend.batch_plan(ids, weights, spec.num_experts)
            with trace.stage("experts", x.device):
                rows = backend.expert_rows(
                    x, plan, self.experts, spec.activation, self.workspace, self.options
                )  # [T*k, H] fp32
            with trace.stage("combine", x.device):
                out = backend.combine(rows, plan, self.workspace)  # [T, H] fp32
        if spec.shared_intermediate:
            with trace.stage("shared", x.device):
                out = out + backend.shared_expert(x, t, spec.activation, self.options)
        trace.finish(x.shape[0])
        return out.to(x.dtype)

    def _parallel_rows(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, trace):
        """Expert parallelism: the rows of this rank's experts (one contiguous span of the plan's),
        brought to rank 0 -> (rows [T*k, H] fp32: on rank 0 every rank's, the plan)."""
        # expert by expert (torch's or the native kernels'); a grouped-GEMM backend: torch's rows
        backend = self.batch_backend if self.batch_backend.STREAMS_PREFILL else torch_backend
        with trace.stage("plan", x.device):
            plan = torch_backend.batch_plan(ids, weights, self.spec.num_experts)
        start = time.perf_counter()
        with trace.stage("experts", x.device):
            rows = backend.expert_rows(
                x, plan, self.experts, self.spec.activation, self.workspace, self.options, self.experts.owned
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
        trace = layer_trace(self.name)

        def step(x: torch.Tensor, after_fetch: Callable[[], None] | None) -> None:
            if self.experts.stream is not None:
                self._fetch(self.owned_of(torch.unique(ids).tolist()), after_fetch)
            self._parallel_rows(x, ids, weights, trace)

        self._route_ms = 0.0  # rank 0 routed
        after_fetch = functools.partial(prefetch, mass) if prefetch is not None and mass is not None else None
        self._streamed_step(step, x, after_fetch)
        return True

    @property
    def decodes_natively(self) -> bool:
        """Whether `decode_token` runs here: the layer is on the cpu backend (native kernels), and
        this process runs the model (with expert parallelism: rank 0)."""
        return hasattr(self.backend, "route_token") and (self.parallel is None or self.parallel.leads)

    def decode_token(
        self,
        x: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        after_fetch: Callable[[], None] | None = None,
    ) -> None:
        """One token's decode step on the native CPU kernels, x float32 [H] updated in place:
        x += this block(rms_norm(x, norm)), with norm float32 [H] the model's norm before it. Its
        norm, router and routing are one native call, the experts a second (streamed experts are
        fetched between the two), so a streamed layer computes the resident one's bits."""
        self._streamed_step(self._decode_token, x, after_fetch, norm, eps)

    def _decode_token(
        self, x: torch.Tensor, after_fetch: Callable[[], None] | None, norm: torch.Tensor, eps: float
    ) -> None:
        spec, t, backend = self.spec, self.tensors, self.backend
        trace = layer_trace(self.name)
        route_start = time.perf_counter()
        h, logits, ids, weights = backend.route_token(x, norm, eps, spec.routing, t, self.name)
        if ids is None:  # a selection rule the native call does not have: torch's, on its logits
            weights, ids = route(spec.routing, logits[None], t.get("router.score_bias"))
        trace.router_figures(logits[None], ids.reshape(1, -1), weights.reshape(1, -1), spec.num_experts)
        self._route_ms = 1e3 * (time.perf_counter() - route_start)
        plan = TokenPlan(ids.reshape(-1).tolist(), weights.reshape(-1))  # both rules give ids ascending
        if self.parallel is not None:  # the other ranks start on their experts while this fetches
            ids, weights = ids.reshape(1, -1), weights.reshape(1, -1).float()
            self.parallel.share_inputs(h[None], ids, weights, self.name)
        if self.experts.stream is not None:
            self._fetch(self.owned_of(plan.experts), after_fetch)
        if self.parallel is not None:
            rows, batch_plan = self._parallel_rows(h[None], ids, weights, trace)
            out = torch_backend.combine(rows, batch_plan, self.workspace)[0]  # [H] fp32
        else:
            out = backend.token_forward(h, plan, self.experts, spec.activation, self.options)  # [H] fp32
        if spec.shared_intermediate:
            integer = self.options.int8_on_cpu(self.dtype)
            out = out + backend.shared_expert(h[None], t, spec.activation, self.options, integer)[0]
        x += out

    def owned_of(self, experts: list[int]) -> list[int]:
        """Those of `experts` this process computes: all of them, or with expert parallelism its own."""
        if self.parallel is None:
            return experts
        share = self.parallel.shard(self.spec.num_experts)
        return [e for e in experts if share.start <= e < share.stop]

    def _fetch(self, experts: list[int], after_fetch: Callable[[], None] | None) -> None:
        """Streaming: announce the step's experts (ascending) to the cache; the first group loads."""
        self.experts.stream.begin([int(e) for e in experts])
        if after_fetch is not None:
            after_fetch()


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
        if key in tensors and not isinstance(tensors[key], QTensor) and not tensors[key].is_floating_point()
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
