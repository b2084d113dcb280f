"""DeepSeek-V3: sigmoid scores with a score-correction bias for the choice, group-limited by each
group's top-2 sum; unbiased weights, optional renormalisation, routed scaling; ungated shared experts."""

import dataclasses

from moerun.decoder.config import ModelConfig
from moerun.families import decoder_config, deepseek_v2
from moerun.families.moe_block import first, fused_expert_names, hf_glu, shared_mlp_names
from moerun.moe.layer import MoESpec
from moerun.moe.routing import DeepSeekV3Sigmoid

# its GGUF files: llama.cpp's deepseek2, as DeepSeek-V2's, told apart by sigmoid gating
# (expert_gating_func 2); the score-correction bias is exp_probs_b.bias
GGUF = dataclasses.replace(deepseek_v2.GGUF, scoring="sigmoid")
MOE_NAMES = {
    **fused_expert_names(router="gate"),
    "router.score_bias": "gate.e_score_correction_bias",
    **shared_mlp_names("shared_experts"),
}


def moe_spec(config: dict) -> MoESpec:
    return MoESpec(
        hidden=config["hidden_size"],
        intermediate=config["moe_intermediate_size"],
        num_experts=first(config, "n_routed_experts", "num_local_experts", "num_experts"),
        routing=DeepSeekV3Sigmoid(
            k=config["num_experts_per_tok"],
            n_group=config["n_group"],
            topk_group=config["topk_group"],
            renormalize=bool(config.get("norm_topk_prob", True)),
            routed_scaling=config.get("routed_scaling_factor", 1.0),
        ),
        activation=hf_glu(config),
        score_bias=True,
        shared_intermediate=config["moe_intermediate_size"] * (config.get("n_shared_experts") or 0),
    )


def model_config(config: dict) -> ModelConfig:
    """MLA attention; the first `first_k_dense_replace` layers dense."""
    attention = decoder_config.mla_spec(config, interleaved_rope=bool(config.get("rope_interleave", True)))
    return decoder_config.model_config(
        config, moe_spec(config), attention, decoder_config.leading_dense_layers(config)
    )
