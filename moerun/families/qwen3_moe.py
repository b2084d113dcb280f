"""Qwen3-MoE: softmax -> top-k, renormalised when `norm_topk_prob`; SiLU-GLU experts."""

from moerun.decoder.config import ModelConfig
from moerun.families import GGUFFacts, decoder_config
from moerun.families.moe_block import first, fused_expert_names, hf_glu, norm_topk_routing
from moerun.moe.layer import MoESpec

# its GGUF files (moerun.checkpoint.gguf, moerun.export)
GGUF = GGUFFacts("qwen3moe", renormalize_top_k=True)
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
    attention = decoder_config.attention_spec(config, qkv_bias=bias, o_bias=bias, qk_norm="head")
    window = decoder_config.sliding_window(config) if config.get("use_sliding_window") else None
    n = config["num_hidden_layers"]
    return decoder_config.model_config(
        config, moe_spec(config), attention, decoder_config.sparse_layers(config), [window] * n
    )
