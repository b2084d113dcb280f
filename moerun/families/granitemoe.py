"""GraniteMoE: top-k of the router logits, softmax over the k; SiLU-GLU experts."""

from moerun.families.moe_block import first, fused_expert_names, hf_glu
from moerun.moe.layer import MoESpec
from moerun.moe.routing import TopKSoftmax

MOE_NAMES = fused_expert_names(router="router")


def moe_spec(config: dict) -> MoESpec:
    return MoESpec(
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        num_experts=first(config, "num_local_experts", "num_experts"),
        routing=TopKSoftmax(k=config["num_experts_per_tok"]),
        activation=hf_glu(config),
    )
