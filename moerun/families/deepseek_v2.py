"""DeepSeek-V2: softmax scores, greedy or group-limited greedy top-k, routed scaling; ungated
shared experts of `moe_intermediate_size * n_shared_experts`."""

from moerun.decoder.config import ModelConfig
from moerun.errors import ConfigError
from moerun.families import GGUFFacts, decoder_config
from moerun.families.moe_block import first, fused_expert_names, hf_glu, shared_mlp_names
from moerun.moe.layer import MoESpec
from moerun.moe.routing import DeepSeekV2Softmax

# its GGUF files: llama.cpp's deepseek2, which DeepSeek-V3 shares; softmax gating (expert_gating_func 1,
# or absent: llama.cpp's default for the V2 files written before the key) tells V2's apart. The rows
# are as transformers stores them: ggml's normal RoPE rotates the interleaved pairs DeepSeek lays out.
GGUF = GGUFFacts(
    "deepseek2",
    explicit_vocab_and_rope_dims=True,
    deepseek_moe_keys=True,
    default_gating="softmax",
    mla=True,
    expert_groups=True,
    scoring="softmax",
)
MOE_NAMES = {**fused_expert_names(router="gate"), **shared_mlp_names("shared_experts")}


def moe_spec(config: dict) -> MoESpec:
    method = config.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ConfigError(
            f"DeepSeek-V2 topk_method={method!r} is not supported; "
            "expected 'greedy' or 'group_limited_greedy'."
        )
    group_limited = method == "group_limited_greedy"
    return MoESpec(
        hidden=config["hidden_size"],
        intermediate=config["moe_intermediate_size"],
        num_experts=first(config, "n_routed_experts", "num_experts", "num_local_experts"),
        routing=DeepSeekV2Softmax(
            k=config["num_experts_per_tok"],
            routed_scaling=config.get("routed_scaling_factor", 1.0),
            n_group=config["n_group"] if group_limited else 1,
            topk_group=config["topk_group"] if group_limited else 1,
            group_limited=group_limited,
        ),
        activation=hf_glu(config),
        shared_intermediate=config["moe_intermediate_size"] * (config.get("n_shared_experts") or 0),
    )


def model_config(config: dict) -> ModelConfig:
    """MLA attention (transformers' V2 always rotates interleaved pairs); the first
    `first_k_dense_replace` layers dense."""
    attention = decoder_config.mla_spec(config, interleaved_rope=True)
    return decoder_config.model_config(
        config, moe_spec(config), attention, decoder_config.leading_dense_layers(config)
    )
