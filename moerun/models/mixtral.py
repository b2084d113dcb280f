"""Mixtral: softmax -> top-k, always renormalised; SiLU-GLU experts; no shared expert."""

from moerun.layer import MoESpec
from moerun.models.moe_block import first, fused_expert_names, hf_glu
from moerun.routing import SoftmaxTopK

MOE_NAMES = fused_expert_names(router="gate")


def moe_spec(config: dict) -> MoESpec:
    return MoESpec(
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        num_experts=first(config, "num_local_experts", "num_experts"),
        routing=SoftmaxTopK(k=config["num_experts_per_tok"], renormalize=True),
        activation=hf_glu(config),
    )
