"""Qwen3-MoE: softmax -> top-k, renormalised when `norm_topk_prob`; SiLU-GLU experts."""

from moerun.layer import MoESpec
from moerun.model.config import ModelConfig
from moerun.models import decoder
from moerun.models.moe_block import first, fused_expert_names, hf_glu, norm_topk_routing

GGUF_ARCH = "qwen3moe"  # general.architecture of its GGUF files (moerun.models.gguf_checkpoint)
MOE_NAMES = fused_expert_names(router="gate")


def moe_spec(config: dict) -> MoESpec:
    return MoESpec(
        hidden=config["hidden_size"],
        intermediate=config["moe_intermediate_size"],
        num_experts=first(config, "num_experts", "num_local_experts"),
        routing=norm_topk_routing(config),
        activation=hf_glu(config),
    )


def model_config(config: dict) -> ModelConfig:
    bias = bool(config.get("attention_bias"))
    attention = decoder.attention_spec(config, qkv_bias=bias, o_bias=bias, qk_norm="head")
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    n = config["num_hidden_layers"]
    return decoder.model_config(
        config, moe_spec(config), attention, decoder.sparse_layers(config), [window] * n
    )
