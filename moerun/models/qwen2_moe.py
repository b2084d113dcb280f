"""Qwen2-MoE: Qwen routing plus a shared expert scaled by sigmoid(x · shared_expert_gate)."""

from moerun.activations import GLU
from moerun.layer import MoESpec
from moerun.models.moe_block import first, fused_expert_names, shared_mlp_names
from moerun.routing import SoftmaxTopK

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
        routing=SoftmaxTopK(
            k=config["num_experts_per_tok"], renormalize=bool(config.get("norm_topk_prob", False))
        ),
        activation=GLU.from_hf(config.get("hidden_act", "silu")),
        shared_intermediate=config["shared_expert_intermediate_size"],
        shared_gate=True,
    )
