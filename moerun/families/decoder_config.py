"""Reading the decoder-stack part of a Hugging Face config (attention, RoPE, norms, which layers are
MoE, sliding windows) into a `ModelConfig`, written once for every family. Each family's
`model_config` passes what differs (q/k norm, biases, sinks, window layout)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from moerun.decoder.config import AttentionSpec, ConfigError, MLASpec, ModelConfig, RopeSpec
from moerun.families.moe_block import hf_glu
from moerun.moe.layer import MoESpec


def rope_spec(config: Mapping, default: Mapping | None = None) -> RopeSpec:
    """RoPE from `rope_parameters` (transformers 5) or the older `rope_theta` + `rope_scaling`."""
    given = dict(config.get("rope_parameters") or default or {})
    params = {key: value for key, value in given.items() if value is not None}  # null: not set
    legacy = config.get("rope_scaling") or {}
    for key, value in legacy.items():
        if value is not None:
            params.setdefault(key, value)
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    original, factor = params.get("original_max_position_embeddings"), params.get("factor")
    longrope = {}
    if kind == "longrope":  # as transformers: the boundary defaults to the context, factor to their ratio
        original = original or config.get("max_position_embeddings")
        if factor is None and original:
            factor = config.get("max_position_embeddings", original) / original
        longrope = {
            key: tuple(float(f) for f in params[key]) if key in params else None
            for key in ("short_factor", "long_factor")
        }
        longrope.update(short_mscale=params.get("short_mscale"), long_mscale=params.get("long_mscale"))
    return RopeSpec(
        theta=float(theta),
        kind=kind,
        factor=float(factor or 1.0),
        original_max_positions=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        **longrope,
    )


def attention_spec(config: Mapping, rope_default: Mapping | None = None, **variant) -> AttentionSpec:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return AttentionSpec(
        hidden=config["hidden_size"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rope=rope_spec(config, rope_default),
        norm_eps=config.get("rms_norm_eps", 1e-6),
        **variant,
    )


def mla_spec(config: Mapping, interleaved_rope: bool = True) -> MLASpec:
    """DeepSeek's multi-head latent attention from its config keys."""
    return MLASpec(
        hidden=config["hidden_size"],
        heads=config["num_attention_heads"],
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        rope=rope_spec(config),
        q_lora_rank=config.get("q_lora_rank"),
        bias=bool(config.get("attention_bias")),
        interleaved_rope=interleaved_rope,
    )


def leading_dense_layers(config: Mapping) -> tuple[bool, ...]:
    """DeepSeek's rule: the first `first_k_dense_replace` layers have a dense MLP, the rest MoE."""
    dense = config.get("first_k_dense_replace", 0)
    return tuple(i >= dense for i in range(config["num_hidden_layers"]))


def sparse_layers(config: Mapping) -> tuple[bool, ...]:
    """Qwen's rule: layer i is MoE unless listed in `mlp_only_layers`, and when (i + 1) is a
    multiple of `decoder_sparse_step`."""
    step, dense = config.get("decoder_sparse_step", 1) or 1, set(config.get("mlp_only_layers") or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(config["num_hidden_layers"]))


def sliding_window(config: Mapping, default: int | None = None) -> int | None:
    """The sliding window's length in positions; None (attend to all) where it is unset or 0."""
    return config.get("sliding_window", default) or None


def windows_from_layer_types(
    config: Mapping, layer_types: Sequence[str], default_window: int | None = None
) -> tuple[int | None, ...]:
    window = sliding_window(config, default_window)
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ConfigError(
            f"layer_types {sorted(unknown)} are not supported (sliding or full attention only)."
        )
    if len(layer_types) != config["num_hidden_layers"]:
        raise ConfigError(
            f"layer_types has {len(layer_types)} entries but num_hidden_layers is "
            f"{config['num_hidden_layers']}; it needs one per layer."
        )
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def eos_ids(config: Mapping) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)


def model_config(
    config: Mapping,
    moe: MoESpec,
    attention: AttentionSpec | MLASpec,
    moe_layers: Sequence[bool] | None = None,
    sliding_windows: Sequence[int | None] | None = None,
    **stack,
) -> ModelConfig:
    """`stack`: the ModelConfig fields a family sets itself (norm kind, lm_head bias, multipliers)."""
    n = config["num_hidden_layers"]
    return ModelConfig(
        model_type=config["model_type"],
        vocab_size=config["vocab_size"],
        hidden=config["hidden_size"],
        num_layers=n,
        attention=attention,
        moe=moe,
        moe_layers=tuple(moe_layers) if moe_layers is not None else (True,) * n,
        sliding_windows=tuple(sliding_windows) if sliding_windows is not None else (None,) * n,
        max_positions=config.get("max_position_embeddings", 4096),
        norm_eps=config.get("rms_norm_eps", 1e-6),
        dense_intermediate=config.get("intermediate_size", 0),
        dense_activation=hf_glu(config),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_ids(config),
        extra_layers=config.get("num_nextn_predict_layers", 0) or 0,
        **stack,
    )
