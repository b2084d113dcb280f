"""PhiMoE: sparsemixer top-2 routing (eval mode) with `router_jitter_noise` as its epsilon."""

from moerun.errors import ConfigError
from moerun.families.moe_block import first, fused_expert_names, hf_glu
from moerun.moe.layer import MoESpec
from moerun.moe.routing import SparseMixer

MOE_NAMES = fused_expert_names(router="router")


def moe_spec(config: dict) -> MoESpec:
    k = config.get("num_experts_per_tok", 2)
    if k != 2:
        raise ConfigError(
            f"PhiMoE's sparsemixer routes 2 experts per token; config has num_experts_per_tok={k}."
        )
    return MoESpec(
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        num_experts=first(config, "num_local_experts", "num_experts"),
        routing=SparseMixer(jitter_eps=config.get("router_jitter_noise", 0.01)),
        activation=hf_glu(config),
    )
