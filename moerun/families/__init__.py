"""Model families, one small file each, named after the Hugging Face `model_type`.

Each family module defines `moe_spec(config: dict) -> MoESpec` and `MOE_NAMES`, the map from
moerun's canonical tensor names to the names inside transformers' MoE block (a tuple means the
parts are concatenated along the output dimension; names in `TRANSPOSED` are stored [in, out]).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType

FAMILIES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
    "phimoe",
    "granitemoe",
    "glm4_moe",
)


@dataclass(frozen=True)
class GGUFFacts:
    """A family's GGUF files: their `general.architecture`, and what llama.cpp's loader for that arch
    assumes where the metadata is silent (src/models/<arch>.cpp and its hparams loader), so one file
    means one model in llama.cpp and here. Read by moerun.checkpoint.gguf and moerun.export."""

    arch: str
    renormalize_top_k: bool = False  # build_moe_ffn's norm_w: the k routing weights renormalised
    # the metadata key of the experts' width ("feed_forward_length": llama and olmoe share it with
    # the dense MLP); and the HF config key the family reads it from
    experts_width_key: str = "expert_feed_forward_length"
    hf_experts_width_key: str = "moe_intermediate_size"
    shared_expert: bool = False  # writes expert_shared_feed_forward_length
    permuted_qk: bool = False  # q and k rows permuted for ggml's interleaved RoPE (LlamaModel.permute)
    explicit_vocab_and_rope_dims: bool = False  # vocab_size and rope.dimension_count keys written
    clamp_kqv: bool = False  # attention.clamp_kqv read as the HF clip_qkv
    # gpt-oss: the MLP's pre-norm named post_attention_norm; expert gate/up rows interleaved (gate,
    # up, gate, ...) and possibly stored fused; clamped SwiGLU constants; sliding-window period; YaRN
    # trained without rounding its correction range
    layer_names: dict[str, str] = field(default_factory=dict)  # replaces: blk name -> canonical
    interleaved_gate_up: bool = False
    swiglu: dict[str, float] = field(default_factory=dict)
    swa_period: int | None = None
    yarn_truncate: bool = True
    # glm4moe (deepseek2 reads the same): the DeepSeek-style MoE keys leading_dense_block_count,
    # expert_shared_count, expert_weights_scale / _norm and expert_gating_func (`default_gating`
    # where that key is absent)
    deepseek_moe_keys: bool = False
    default_gating: str = "softmax"
    partial_rotary: bool = False  # rope.dimension_count may be the first part of each head (GLM-4)
    # deepseek2: multi-head latent attention (attention.q_lora_rank, kv_lora_rank, key_length(_mla),
    # value_length(_mla); kv_b whole or split per head into k_b / v_b; YaRN's mscale_all_dim as
    # rope.scaling.yarn_log_multiplier); expert_group_count / _used_count read; and, where families
    # share an arch, the gating (expert_gating_func) whose files are this family's
    mla: bool = False
    expert_groups: bool = False
    scoring: str | None = None


def family(model_type: str) -> ModuleType:
    if model_type not in FAMILIES:
        raise ValueError(f"Unknown architecture model_type={model_type!r}; moerun knows {list(FAMILIES)}.")
    return importlib.import_module(f"moerun.families.{model_type}")
