"""Mixtral: softmax -> top-k, always renormalised; SiLU-GLU experts; no shared expert."""

from moerun.decoder.config import ModelConfig
from moerun.families import GGUFFacts, decoder_config
from moerun.families.moe_block import first, fused_expert_names, hf_glu
from moerun.moe.layer import MoESpec
from moerun.moe.routing import SoftmaxTopK

# its GGUF files (moerun.checkpoint.gguf, moerun.export)
GGUF = GGUFFacts(
    "llama",
    renormalize_top_k=True,
    experts_width_key="feed_forward_length",
    hf_experts_width_key="intermediate_size",
    permuted_qk=True,
    explicit_vocab_and_rope_dims=True,
)
MOE_NAMES = fused_expert_names(router="gate")


def moe_spec(config: dict) -> MoESpec:
    return MoESpec(
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        num_experts=first(config, "num_local_experts", "num_experts"),
        routing=SoftmaxTopK(k=config["num_experts_per_tok"], renormalize=True),
        activation=hf_glu(config),
    )


def model_config(config: dict) -> ModelConfig:
    window = decoder_config.sliding_window(config)
    n = config["num_hidden_layers"]
    return decoder_config.model_config(
        config, moe_spec(config), decoder_config.attention_spec(config), sliding_windows=[window] * n
    )
