"""OLMoE: softmax -> top-k, renormalised when `norm_topk_prob`; SiLU-GLU experts of
`intermediate_size`."""

from moerun.decoder.config import ModelConfig
from moerun.families import GGUFFacts, decoder_config
from moerun.families.moe_block import first, fused_expert_names, hf_glu, norm_topk_routing
from moerun.moe.layer import MoESpec

# its GGUF files (moerun.checkpoint.gguf, moerun.export)
GGUF = GGUFFacts(
    "olmoe",
    experts_width_key="feed_forward_length",
    hf_experts_width_key="intermediate_size",
    clamp_kqv=True,
)
MOE_NAMES = fused_expert_names(router="gate")


def moe_spec(config: dict) -> MoESpec:
    return MoESpec(
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        num_experts=first(config, "num_experts", "num_local_experts"),
        routing=norm_topk_routing(config),
        activation=hf_glu(config),
    )


def model_config(config: dict) -> ModelConfig:
    attention = decoder_config.attention_spec(
        config,
        qkv_bias=bool(config.get("attention_bias")),
        o_bias=bool(config.get("attention_bias")),
        qk_norm="full",
        clip_qkv=config.get("clip_qkv"),
    )
    return decoder_config.model_config(config, moe_spec(config), attention)
