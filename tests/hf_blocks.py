"""Tiny random transformers MoE blocks, one per family: the oracles for the layer tests."""

from __future__ import annotations

import torch

from moerun.benchmarks.peers import run_peer, transformers_block, transformers_config

H, I, E = 32, 24, 8

# model_type -> config overrides of the tiny block
TINY = {
    "mixtral": dict(num_local_experts=E, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=E,
        num_experts_per_tok=4,
        moe_intermediate_size=I,
        shared_expert_intermediate_size=40,
        norm_topk_prob=False,
    ),
    "qwen3_moe": dict(num_experts=E, num_experts_per_tok=3, moe_intermediate_size=I),
    "olmoe": dict(num_experts=E, num_experts_per_tok=4, norm_topk_prob=False),
    "gpt_oss": dict(num_local_experts=E, num_experts_per_tok=4, swiglu_limit=0.5),
    "deepseek_v2": dict(
        n_routed_experts=E,
        num_experts_per_tok=3,
        moe_intermediate_size=I,
        n_shared_experts=2,
        routed_scaling_factor=1.7,
        topk_method="greedy",
    ),
    "deepseek_v3": dict(
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=I,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
    "phimoe": dict(num_local_experts=E, num_experts_per_tok=2, router_jitter_noise=0.01),
    "granitemoe": dict(num_local_experts=E, num_experts_per_tok=2),
}


def make_block(model_type: str, seed: int = 0, **overrides):
    """(block, config dict): a tiny eager block of `model_type` with every tensor drawn at random."""
    config = dict(hidden_size=H, intermediate_size=I, **{**TINY[model_type], **overrides})
    block = transformers_block(model_type, transformers_config(model_type, config, "eager"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(block.named_parameters()) + list(block.named_buffers()):
            routing = "router" in name or name.startswith("gate.") or "bias" in name
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * (1.0 if routing else 0.3))
    return block, config


def run_block(block, x: torch.Tensor) -> torch.Tensor:
    return run_peer(block, x)
