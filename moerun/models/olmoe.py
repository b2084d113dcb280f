"""OLMoE: softmax -> top-k, renormalised when `norm_topk_prob`; SiLU-GLU experts of
`intermediate_size`."""

from moerun.layer import MoESpec
from moerun.models.moe_block import first, fused_expert_names, hf_glu, norm_topk_routing

MOE_NAMES = fused_expert_names(router="gate")


def moe_spec(config: dict) -> MoESpec:
    return MoESpec(
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        num_experts=first(config, "num_experts", "num_local_experts"),
        routing=norm_topk_routing(config),
        activation=hf_glu(config),
    )
