"""Qwen2-MoE: Qwen routing plus a shared expert scaled by sigmoid(x · shared_expert_gate)."""

from moerun.layer import MoESpec
from moerun.models.moe_block import first, fused_expert_names, hf_glu, norm_topk_routing, shared_mlp_names

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
