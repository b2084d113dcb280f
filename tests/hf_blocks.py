"""Tiny random transformers MoE blocks, one per family: the oracles for the layer tests."""

from __future__ import annotations

import torch
import transformers as tf

H, I, E = 32, 24, 8

# model_type -> (config class, block class path, config overrides)
BLOCKS = {
    "mixtral": ("MixtralConfig", "mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                dict(num_local_experts=E, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                  dict(num_experts=E, num_experts_per_tok=4, moe_intermediate_size=I,
                       shared_expert_intermediate_size=40, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
                  dict(num_experts=E, num_experts_per_tok=3, moe_intermediate_size=I)),
    "olmoe": ("OlmoeConfig", "olmoe.modeling_olmoe.OlmoeSparseMoeBlock",
              dict(num_experts=E, num_experts_per_tok=4, norm_topk_prob=False)),
    "gpt_oss": ("GptOssConfig", "gpt_oss.modeling_gpt_oss.GptOssMLP",
                dict(num_local_experts=E, num_experts_per_tok=4, swiglu_limit=0.5)),
    "deepseek_v2": ("DeepseekV2Config", "deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe",
                    dict(n_routed_experts=E, num_experts_per_tok=3, moe_intermediate_size=I, n_shared_experts=2,
                         routed_scaling_factor=1.7, topk_method="greedy")),
    "deepseek_v3": ("DeepseekV3Config", "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE",
                    dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=I, n_shared_experts=1,
                         n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
    "phimoe": ("PhimoeConfig", "phimoe.modeling_phimoe.PhimoeSparseMoeBlock",
               dict(num_local_experts=E, num_experts_per_tok=2, router_jitter_noise=0.01)),
    "granitemoe": ("GraniteMoeConfig", "granitemoe.modeling_granitemoe.GraniteMoeMoE",
                   dict(num_local_experts=E, num_experts_per_tok=2)),
}


def make_config(model_type: str, experts_implementation: str = "eager", **overrides):
    config_class, _, defaults = BLOCKS[model_type]
    config = getattr(tf, config_class)(hidden_size=H, intermediate_size=I, **{**defaults, **overrides})
    config._experts_implementation = experts_implementation
    return config


def make_block(model_type: str, seed: int = 0, experts_implementation: str = "eager", **overrides):
    """A block of `model_type` in eval mode with every parameter and buffer drawn at random."""
    module_path, class_name = BLOCKS[model_type][1].rsplit(".", 1)
    module = __import__(f"transformers.models.{module_path}", fromlist=[class_name])
    config = make_config(model_type, experts_implementation, **overrides)
    block = getattr(module, class_name)(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(block.named_parameters()) + list(block.named_buffers()):
            scale = 1.0 if ("router" in name or "gate.weight" in name or "bias" in name) else 0.3
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * scale)
    return block, config


def run_block(block, x: torch.Tensor) -> torch.Tensor:
    """x [T, H] through a transformers block (which wants [B, T, H]) -> [T, H]."""
    with torch.no_grad():
        out = block(x[None])
    out = out[0] if isinstance(out, tuple) else out
    return out[0]
