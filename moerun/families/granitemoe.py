"""GraniteMoE: top-k of the router logits, softmax over the k; SiLU-GLU experts. Around them a
Mixtral-like stack with four multipliers: the embeddings times `embedding_multiplier`, attention
scores times `attention_multiplier` (instead of 1/sqrt(head_dim)), each block's output times
`residual_multiplier`, the logits divided by `logits_scaling`."""

from moerun.decoder.config import ModelConfig
from moerun.families import decoder_config
from moerun.families.moe_block import first, fused_expert_names, hf_glu
from moerun.moe.layer import MoESpec
from moerun.moe.routing import TopKSoftmax

MOE_NAMES = fused_expert_names(router="router")
# the block's names in checkpoints saved in the original format -> transformers' (its conversion_mapping)
ORIGINAL_NAMES = {
    "input_linear.weight": "experts.gate_up_proj",
    "output_linear.weight": "experts.down_proj",
    "router.layer.weight": "router.weight",
}


def moe_spec(config: dict) -> MoESpec:
    return MoESpec(
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        num_experts=first(config, "num_local_experts", "num_experts"),
        routing=TopKSoftmax(k=config["num_experts_per_tok"]),
        activation=hf_glu(config),
    )


def model_config(config: dict) -> ModelConfig:
    bias = bool(config.get("attention_bias"))
    attention = decoder_config.attention_spec(
        config, qkv_bias=bias, o_bias=bias, softmax_scale=float(config.get("attention_multiplier", 1.0))
    )
    return decoder_config.model_config(
        config,
        moe_spec(config),
        attention,
        embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(config.get("residual_multiplier", 1.0)),
        logits_scaling=float(config.get("logits_scaling", 1.0)),
    )
