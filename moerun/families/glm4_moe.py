"""GLM-4 MoE (GLM-4.5, 4.6): DeepSeek-V3's routing (sigmoid scores, score-correction bias for the
choice, group-limited top-k, optional renormalisation, routed scaling) and ungated shared experts of
`moe_intermediate_size * n_shared_experts`, after `first_k_dense_replace` dense layers; attention with
q/k/v biases (`attention_bias`; none on o), RMSNorm per head on q and k (`use_qk_norm`), RoPE over the
first `partial_rotary_factor` of each head (moerun.decoder.rope).

transformers' checkpoints of the real models carry the multi-token-prediction layers after the last
decoder layer (`num_nextn_predict_layers`), which it does not load either; llama.cpp's files carry
them as the last `nextn_predict_layers` blocks, which moerun.checkpoint.gguf skips as llama.cpp does."""

import dataclasses

from moerun.decoder.config import ModelConfig
from moerun.decoder.rope import rotary_dims
from moerun.errors import ConfigError
from moerun.families import GGUFFacts, decoder_config
from moerun.families.moe_block import first, fused_expert_names, hf_glu, shared_mlp_names
from moerun.moe.layer import MoESpec
from moerun.moe.routing import DeepSeekV3Sigmoid

# its GGUF files (moerun.checkpoint.gguf, moerun.export): the MLP's pre-norm is ATTN_POST_NORM; the
# DeepSeek-style MoE keys (leading_dense_block_count, expert_shared_count, expert_weights_scale /
# _norm, expert_gating_func: sigmoid where absent, as llama.cpp's glm4moe loader assumes); RoPE over
# rope.dimension_count dims of each head. llama.cpp's glm4moe reads no expert-group keys: its files
# route without groups (n_group 1).
GGUF = GGUFFacts(
    "glm4moe",
    layer_names={"post_attention_norm.weight": "mlp_norm.weight"},
    deepseek_moe_keys=True,
    default_gating="sigmoid",
    partial_rotary=True,
)
MOE_NAMES = {
    **fused_expert_names(router="gate"),
    "router.score_bias": "gate.e_score_correction_bias",
    **shared_mlp_names("shared_experts"),
}


def moe_spec(config: dict) -> MoESpec:
    """transformers' Glm4MoeConfig defaults where a key is absent."""
    scoring = config.get("scoring_func", "sigmoid")  # a GGUF file's expert_gating_func
    if scoring != "sigmoid":
        raise ConfigError(f"GLM-4 MoE routes by sigmoid scores; scoring_func {scoring!r} is not supported.")
    experts = first(config, "n_routed_experts", "num_local_experts", "num_experts")
    k = config["num_experts_per_tok"]
    groups, kept = config.get("n_group", 1), config.get("topk_group", 1)
    if experts % groups or experts // groups < 2 or kept > groups or k > kept * (experts // groups):
        raise ConfigError(
            f"n_group={groups}, topk_group={kept} cannot route {k} of {experts} experts: the groups must "
            "split the experts evenly, at least 2 each, and the kept groups hold num_experts_per_tok."
        )
    return MoESpec(
        hidden=config["hidden_size"],
        intermediate=config["moe_intermediate_size"],
        num_experts=experts,
        routing=DeepSeekV3Sigmoid(
            k=k,
            n_group=groups,
            topk_group=kept,
            renormalize=bool(config.get("norm_topk_prob", True)),
            routed_scaling=config.get("routed_scaling_factor", 1.0),
        ),
        activation=hf_glu(config),
        score_bias=True,
        shared_intermediate=config["moe_intermediate_size"] * config.get("n_shared_experts", 1),
    )


def model_config(config: dict) -> ModelConfig:
    bias = bool(config.get("attention_bias"))
    qk_norm = "head" if config.get("use_qk_norm") else None
    attention = decoder_config.attention_spec(config, qkv_bias=bias, qk_norm=qk_norm)
    # transformers 5 keeps it in rope_parameters, older configs beside rope_theta; 0.5 by default
    rope_parameters = config.get("rope_parameters") or {}
    factor = rope_parameters.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5))
    dims = rotary_dims(attention.head_dim, factor)
    rope = dataclasses.replace(attention.rope, rotary_dims=dims if dims < attention.head_dim else None)
    dense = config.get("first_k_dense_replace", 1)
    moe_layers = [i >= dense for i in range(config["num_hidden_layers"])]
    return decoder_config.model_config(
        config, moe_spec(config), dataclasses.replace(attention, rope=rope), moe_layers
    )
