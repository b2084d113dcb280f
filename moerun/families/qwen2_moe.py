"""Qwen2-MoE: Qwen routing plus a shared expert scaled by sigmoid(x · shared_expert_gate)."""

from moerun.decoder.config import ModelConfig
from moerun.families import GGUFFacts, decoder_config
from moerun.families.moe_block import first, fused_expert_names, hf_glu, norm_topk_routing, shared_mlp_names
from moerun.moe.layer import MoESpec

# its GGUF files (moerun.checkpoint.gguf, moerun.export)
GGUF = GGUFFacts("qwen2moe", shared_expert=True)
MOE_NAMES = {
    **fused_expert_names(router="gate"),
    **shared_mlp_names("shared_expert"),
    "shared.gate": "shared_expert_gate.weight",
}


def moe_spec(config: dict) -> MoESpec:
    return MoESpec(
        hidden=config["hidden_size"],
        intermediate=config["moe_intermediate_size"],
        num_experts=first(config, "num_experts", "num_local_experts"),
        routing=norm_topk_routing(config),
        activation=hf_glu(config),
        shared_intermediate=config["shared_expert_intermediate_size"],
        shared_gate=True,
    )


def model_config(config: dict) -> ModelConfig:
    attention = decoder_config.attention_spec(config, qkv_bias=bool(config.get("qkv_bias", True)))
    n = config["num_hidden_layers"]
    layer_types = config.get("layer_types") or [
        "sliding_attention"
        if (i + 1) % 2 and i < config.get("max_window_layers", n) and config.get("use_sliding_window")
        else "full_attention"
        for i in range(n)
    ]
    windows = decoder_config.windows_from_layer_types(config, layer_types)
    return decoder_config.model_config(
        config, moe_spec(config), attention, decoder_config.sparse_layers(config), windows
    )
