"""PhiMoE (Phi-3.5-MoE): sparsemixer top-2 routing (eval mode) with `router_jitter_noise` as its
epsilon; LayerNorms with biases, attention and lm_head biases, an optional sliding window.

Phi-3.5-MoE's own checkpoints use RoPE "longrope" as transformers 5's PhiMoE computes it: the
short_factor frequencies at every length, cos and sin scaled by short_mscale, or by long_mscale in a
forward pass whose sequence is longer than original_max_position_embeddings (moerun.decoder.rope)."""

import dataclasses

from moerun.decoder.config import ModelConfig
from moerun.errors import ConfigError
from moerun.families import decoder_config
from moerun.families.moe_block import first, fused_expert_names, hf_glu
from moerun.moe.layer import MoESpec
from moerun.moe.routing import SparseMixer

MOE_NAMES = fused_expert_names(router="router")
# the block's names in checkpoints saved in the original format -> transformers' (its conversion_mapping);
# the per-expert w1/w2/w3 are stacked by moerun.checkpoint.hf
ORIGINAL_NAMES = {"gate.weight": "router.weight"}


def moe_spec(config: dict) -> MoESpec:
    k = config.get("num_experts_per_tok", 2)
    if k != 2:
        raise ConfigError(
            f"PhiMoE's sparsemixer routes 2 experts per token; config has num_experts_per_tok={k}."
        )
    return MoESpec(
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        num_experts=first(config, "num_local_experts", "num_experts"),
        routing=SparseMixer(jitter_eps=config.get("router_jitter_noise", 0.01)),
        activation=hf_glu(config),
    )


def model_config(config: dict) -> ModelConfig:
    bias = bool(config.get("attention_bias"))
    attention = decoder_config.attention_spec(config, qkv_bias=bias, o_bias=bias)
    if attention.rope.kind == "longrope":  # transformers' PhiMoE never uses long_factor
        rope = dataclasses.replace(attention.rope, long_frequencies=False)
        attention = dataclasses.replace(attention, rope=rope)
    window = decoder_config.sliding_window(config)
    n = config["num_hidden_layers"]
    return decoder_config.model_config(
        config,
        moe_spec(config),
        attention,
        sliding_windows=[window] * n,
        norm="layer",  # nn.LayerNorm(eps=rms_norm_eps) before attention, before the MoE block, at the end
        lm_head_bias=bool(config.get("lm_head_bias")),
    )
