"""The triton backend (`TritonBackend`): the torch backend's interface on the kernels of moerun.kernels.

Prefill: the plan is built on the device (no host read-back) and padded to the grouped GEMM's
block; two grouped GEMMs dequantise the weights in the kernel, then one kernel sums each token's
rows in slot order. Decode: one token's k experts through a slot table, four launches (gate/up of all
k experts, activation times routing weight, down of all k experts, the ordered row sum), captured on
CUDA in one CUDA graph per layer and replayed (moerun.kernels.graph). Streamed experts are read from
the expert cache's slots, which never move, so the same graph serves every token; streamed prefill
runs on the torch backend (see moerun.moe.layer).

Launch configs come from moerun.kernels.configs for each projection's shape, format and GPU. Layers
whose formats the kernels cannot read (`unsupported`) are run by the torch backend instead.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from moerun.activations import Activation
from moerun.kernels import decode, grouped_gemm
from moerun.kernels.configs import device_name, launch_config, plan_block_m
from moerun.kernels.device_plan import DevicePlan, build_device_plan
from moerun.kernels.graph import GraphedStep
from moerun.kernels.weights import FORMAT_NAMES, KernelWeight, kernel_weight
from moerun.moe.backends.torch_backend import TorchBackend
from moerun.moe.backends.workspace import Workspace
from moerun.moe.experts import ExpertWeights


def unsupported(experts: ExpertWeights) -> str | None:
    """Why the kernels cannot run these experts, or None when they can (they read every weight
    format: moerun.kernels.weights)."""
    if experts.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"the Triton kernels compute in fp32, bf16 or f16, not {experts.dtype}"
    return None


# --------------------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class DeviceTokenPlan:
    """One token's k experts ascending, as device tensors (no host read-back)."""

    experts: torch.Tensor  # int32 [k]
    weights: torch.Tensor  # fp32 [k], weight of each of `experts`


def token_plan(ids: torch.Tensor, weights: torch.Tensor, layer_name: str = "moe") -> DeviceTokenPlan:
    """ids [k] (or [1, k]) and weights -> the experts ascending with their weights. The router's
    top-k gives k distinct experts; that is not re-checked here, as checking would read the ids back."""
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    return DeviceTokenPlan(sorted_ids.to(torch.int32), weights.reshape(-1)[order].float())


def batch_plan(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> DevicePlan:
    return build_device_plan(ids, weights, num_experts, plan_block_m(device_name(ids.device)))


# ------------------------------------------------------------------------- weights as kernels read them
class _Prepared:
    """One layer's experts as the kernels read them, their launch configs and the decode graph."""

    def __init__(self, experts: ExpertWeights, device: torch.device, use_q8_1: bool):
        # no reference to `experts` itself: it is the key of the weak map this object is a value of
        self.biases = (experts.gate_up_bias, experts.down_bias)
        self.stream = experts.stream
        gpu = device_name(device)
        if self.stream is None:
            self.gate_up, self.down = kernel_weight(experts.gate_up), kernel_weight(experts.down)
        else:  # the cache's slot pool: slot s of the pool is what the kernels index
            pools = self.stream.cache.pool_buffers(self.stream.layer)
            self.gate_up = _pool_weight(experts.gate_up, pools["gate_up"])
            self.down = _pool_weight(experts.down, pools["down"])
        self.configs = {
            kernel: launch_config(kernel, FORMAT_NAMES[weight.fmt], weight.n, weight.k, gpu)
            for kernel, weight in (
                ("prefill_gate_up", self.gate_up),
                ("prefill_down", self.down),
                ("decode_gate_up", self.gate_up),
                ("decode_down", self.down),
            )
        }
        self.graph: GraphedStep | None = None
        # decode of formats with integer kernels (moerun.kernels.decode_q8_1: q8_0, q4_0, q4_1, q5_0,
        # q5_1, iq4_nl, q2_k..q6_k, iq4_xs, mxfp4) on q8_1 activations, as llama.cpp's mmvq does; the
        # other formats' projections keep float activations
        self.use_q8_1 = use_q8_1

    def slots(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """int32 [k]: where each expert's weights are in the tensors the kernels read."""
        if self.stream is None:
            return expert_ids
        return self.stream.slot_ids(expert_ids)

    def decode_graph(self, x: torch.Tensor, k: int, act: Activation, dtype: torch.dtype) -> GraphedStep:
        """The layer's decode step over fixed buffers (x in the compute `dtype`), made on first use."""
        if self.graph is None:
            device = x.device
            buffers = {
                "x": torch.zeros(x.shape, dtype=dtype, device=device),
                "slots": torch.zeros(k, dtype=torch.int32, device=device),
                "experts": torch.zeros(k, dtype=torch.int32, device=device),
                "weights": torch.zeros(k, dtype=torch.float32, device=device),
            }
            self.graph = GraphedStep(lambda **b: self._decode(act=act, **b), buffers)
        return self.graph

    def _decode(self, x, slots, experts, weights, act: Activation) -> torch.Tensor:
        """The decode step's device work: x [H] -> the weighted sum of its experts [H] fp32."""
        config = {"gate_up": self.configs["decode_gate_up"], "down": self.configs["decode_down"]}
        layer = decode.LayerWeights(self.gate_up, self.down, *self.biases)
        return decode.decode_step(x, slots, experts, weights, layer, act, self.use_q8_1, config)


def _pool_weight(weight, pool: torch.Tensor) -> KernelWeight:
    """A KernelWeight over the cache's slot pool [S, ...] holding slots shaped like `weight`'s experts."""
    described = kernel_weight(weight)
    return KernelWeight(pool, described.fmt, described.n, described.k, described.row_stride, pool[0].numel())


_PREPARED: weakref.WeakKeyDictionary[ExpertWeights, _Prepared] = weakref.WeakKeyDictionary()


def _prepared(experts: ExpertWeights, device: torch.device, backend: TritonBackend) -> _Prepared:
    """The layer's kernel state, made on first use by the layer's backend (whose activation mode
    never changes)."""
    prepared = _PREPARED.get(experts)
    if prepared is None:
        reason = unsupported(experts)
        if reason:
            raise ValueError(f"MoE layer {experts.layer_name!r}: {reason}; use backend='torch'.")
        use_q8_1 = backend.int8_activations
        prepared = _PREPARED[experts] = _Prepared(experts, device, use_q8_1)
    return prepared


class TritonBackend(TorchBackend):
    """The GPU kernels (moerun.kernels); the router and the shared expert in torch. With
    int8 activations decode reads q8_1 activations where the kernels have integer dot products."""

    name = "triton"
    streams_prefill = False  # one grouped GEMM reads every touched expert at once

    unsupported = staticmethod(unsupported)
    token_plan = staticmethod(token_plan)  # on the device: no host read-back
    batch_plan = staticmethod(batch_plan)

    def token_forward(
        self, x: torch.Tensor, plan: DeviceTokenPlan, experts: ExpertWeights, act: Activation
    ) -> torch.Tensor:
        """One token x [H] -> the weighted sum of its experts' outputs [H] fp32, summed in plan
        order: the layer's decode graph (a CUDA graph on the GPU), replayed."""
        p = _prepared(experts, x.device, self)
        step = p.decode_graph(x, plan.experts.numel(), act, experts.dtype)
        out = step.run(x=x, slots=p.slots(plan.experts), experts=plan.experts, weights=plan.weights)
        return out.clone()  # the graph's output buffer is rewritten by the next step

    def expert_rows(
        self,
        x: torch.Tensor,
        plan: DevicePlan,
        experts: ExpertWeights,
        act: Activation,
        ws: Workspace,
        only=None,
    ) -> torch.Tensor:
        """x [T, H] -> weighted expert outputs [max_rows, H] fp32 in padded plan order: two grouped
        GEMMs dequantising the weights in the kernel, the GLU in the first's epilogue and the routing
        weight in the second's."""
        if only is not None:
            raise ValueError("the triton backend computes every expert's rows; a share runs on torch's.")
        p = _prepared(experts, x.device, self)
        if p.stream is not None:
            raise ValueError(
                f"MoE layer {experts.layer_name!r}: streamed prefill runs on the torch backend "
                "(see moerun.moe.layer)."
            )
        x = x.to(experts.dtype)
        config = {**p.configs["prefill_gate_up"], "BLOCK_M": plan.block_m}
        a = grouped_gemm.gate_up_activation(x, plan, p.gate_up, experts.gate_up_bias, act, config)
        config = {**p.configs["prefill_down"], "BLOCK_M": plan.block_m}
        return grouped_gemm.down_weighted(a, plan, p.down, experts.down_bias, config)

    def combine(self, rows: torch.Tensor, plan: DevicePlan, ws: Workspace) -> torch.Tensor:
        """rows [max_rows, H] fp32 -> out [T, H] fp32: each token's rows summed in slot order."""
        return grouped_gemm.combine_rows(rows, plan, {"BLOCK_M": plan.block_m})
