"""GPT-OSS: router with bias, top-k -> softmax over the k; clamped SwiGLU on interleaved gate/up
columns with biases on both projections. transformers stores the expert weights [E, in, out]."""

from moerun.activations import GptOssSwiGLU
from moerun.decoder.config import ModelConfig
from moerun.families import GGUFFacts, decoder_config
from moerun.families.moe_block import first
from moerun.moe.layer import MoESpec
from moerun.moe.routing import TopKSoftmax

# its GGUF files (moerun.checkpoint.gguf, moerun.export)
GGUF = GGUFFacts(
    "gpt-oss",
    hf_experts_width_key="intermediate_size",
    layer_names={"post_attention_norm.weight": "mlp_norm.weight"},  # its ATTN_POST_NORM; no ffn_norm
    interleaved_gate_up=True,
    swiglu={"swiglu_alpha": 1.702, "swiglu_limit": 7.0},  # llama.cpp's SWIGLU_OAI_MOE constants
    swa_period=2,  # default of `gpt-oss.attention.sliding_window_pattern`: set_swa_pattern(2)
    yarn_truncate=False,
)
MOE_NAMES = {
    "router.weight": "router.weight",
    "router.bias": "router.bias",
    "experts.gate_up": "experts.gate_up_proj",
    "experts.gate_up_bias": "experts.gate_up_proj_bias",
    "experts.down": "experts.down_proj",
    "experts.down_bias": "experts.down_proj_bias",
}
TRANSPOSED = frozenset({"experts.gate_up_proj", "experts.down_proj"})


def moe_spec(config: dict) -> MoESpec:
    return MoESpec(
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        num_experts=first(config, "num_local_experts", "num_experts"),
        routing=TopKSoftmax(k=first(config, "num_experts_per_tok", "experts_per_token")),
        activation=GptOssSwiGLU(
            alpha=config.get("swiglu_alpha", 1.702), limit=config.get("swiglu_limit", 7.0)
        ),
        router_bias=True,
        expert_bias=True,
    )


# transformers' GptOssConfig default when a config.json has no rope_parameters
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def model_config(config: dict) -> ModelConfig:
    bias = bool(config.get("attention_bias", True))
    attention = decoder_config.attention_spec(config, DEFAULT_ROPE, qkv_bias=bias, o_bias=bias, sinks=True)
    n = config["num_hidden_layers"]
    layer_types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
    ]
    windows = decoder_config.windows_from_layer_types(config, layer_types, default_window=128)
    return decoder_config.model_config(config, moe_spec(config), attention, sliding_windows=windows)
