"""Frozen specs of a whole model: RoPE, attention, and the decoder stack around the MoE layers.

Family files (`moerun.families.<model_type>`) build a `ModelConfig` from a checkpoint's config;
nothing else reads checkpoint config keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moerun.activations import GLU
from moerun.errors import ConfigError
from moerun.moe.layer import MoESpec

__all__ = ["AttentionSpec", "ConfigError", "MLASpec", "ModelConfig", "RopeSpec"]


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding over each head, or over its first `rotary_dims` (GLM-4) (`kind`: default,
    linear, yarn or longrope, as transformers names them).

    longrope (Phi-3, Phi-3.5-MoE): frequency i is divided by short_factor[i], or by long_factor[i]
    in a forward pass whose sequence reaches past `original_max_positions` (all its positions);
    cos and sin are scaled by short_mscale / long_mscale where given (PhiMoE), else by
    `attention_factor`, else by sqrt(1 + ln factor / ln original_max_positions)."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    original_max_positions: int | None = None  # yarn, longrope
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    rotary_dims: int | None = None  # partial rotary: the first this many dims of a head; None: all
    short_factor: tuple[float, ...] | None = None  # longrope: one divisor per frequency
    long_factor: tuple[float, ...] | None = None
    short_mscale: float | None = None  # longrope (PhiMoE): the cos/sin scale up to / past the boundary
    long_mscale: float | None = None
    # longrope: False keeps short_factor past the boundary too (transformers' PhiMoE recomputes its
    # frequencies from short_factor in every forward; only its mscale switches)
    long_frequencies: bool = True

    def __post_init__(self):
        if self.kind not in ("default", "linear", "yarn", "longrope"):
            raise ConfigError(
                f"rope_type {self.kind!r} is not supported; moerun knows default, linear, yarn and longrope."
            )
        if self.kind in ("yarn", "longrope") and self.original_max_positions is None:
            raise ConfigError(
                f"rope_type {self.kind!r} needs original_max_position_embeddings in rope_parameters."
            )
        if self.kind == "longrope" and (self.short_factor is None or self.long_factor is None):
            raise ConfigError("rope_type 'longrope' needs short_factor and long_factor in rope_parameters.")


@dataclass(frozen=True)
class AttentionSpec:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rope: RopeSpec
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # "head": RMSNorm per head (Qwen3); "full": over all heads (OLMoE)
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to ±clip_qkv
    sinks: bool = False  # GPT-OSS: a learned logit per head that joins every softmax
    norm_eps: float = 1e-6
    softmax_scale: float | None = None  # the scores' scale (GraniteMoE's own); None: 1/sqrt(head_dim)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes = {"q.weight": (q, self.hidden), "k.weight": (kv, self.hidden), "v.weight": (kv, self.hidden)}
        shapes["o.weight"] = (self.hidden, q)
        if self.qkv_bias:
            shapes.update({"q.bias": (q,), "k.bias": (kv,), "v.bias": (kv,)})
        if self.o_bias:
            shapes["o.bias"] = (self.hidden,)
        if self.qk_norm == "head":
            shapes.update({"q_norm.weight": (self.head_dim,), "k_norm.weight": (self.head_dim,)})
        elif self.qk_norm == "full":
            shapes.update({"q_norm.weight": (q,), "k_norm.weight": (kv,)})
        if self.sinks:
            shapes["sinks"] = (self.heads,)
        return shapes

    def cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) of what the KV cache holds per position: keys, values."""
        return (self.kv_heads, self.head_dim), (self.kv_heads, self.head_dim)


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3): q through a low-rank `q_a` -> norm -> `q_b`
    (or one `q` projection when `q_lora_rank` is None); keys and values from one latent of
    `kv_lora_rank` per position (`kv_a`, normed) through `kv_b`, plus one rotary key of
    `qk_rope_head_dim` shared by every head. The KV cache holds the latent and the rotary key,
    not per-head keys and values."""

    hidden: int
    heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeSpec
    q_lora_rank: int | None = None
    bias: bool = False  # q_a, kv_a and o carry biases (attention_bias)
    interleaved_rope: bool = True  # rotary pairs (x0, x1), (x2, x3), ... as DeepSeek lays them out
    norm_eps: float = 1e-6  # the q_a and kv_a norms'
    # what the other attention variants have and MLA does not
    qk_norm = None
    clip_qkv = None
    sinks = False

    @property
    def kv_heads(self) -> int:
        return self.heads

    @property
    def head_dim(self) -> int:
        """RoPE's width: the rotary part of each head."""
        return self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1 / sqrt(q/k head width), times YaRN's mscale squared where `mscale_all_dim` is set."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        rope = self.rope
        if rope.kind != "default" and rope.mscale_all_dim and rope.factor > 1:
            m = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
            scale *= m * m
        return scale

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        h, qk = self.heads, self.qk_nope_head_dim + self.qk_rope_head_dim
        shapes: dict[str, tuple[int, ...]] = {}
        if self.q_lora_rank is None:
            shapes["q.weight"] = (h * qk, self.hidden)
        else:
            shapes["q_a.weight"] = (self.q_lora_rank, self.hidden)
            shapes["q_a_norm.weight"] = (self.q_lora_rank,)
            shapes["q_b.weight"] = (h * qk, self.q_lora_rank)
        shapes["kv_a.weight"] = (self.kv_lora_rank + self.qk_rope_head_dim, self.hidden)
        shapes["kv_a_norm.weight"] = (self.kv_lora_rank,)
        shapes["kv_b.weight"] = (h * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)
        shapes["o.weight"] = (self.hidden, h * self.v_head_dim)
        if self.bias:
            if self.q_lora_rank is not None:
                shapes["q_a.bias"] = (self.q_lora_rank,)
            shapes["kv_a.bias"] = (self.kv_lora_rank + self.qk_rope_head_dim,)
            shapes["o.bias"] = (self.hidden,)
        return shapes

    def cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The latent and the rotary key, one "head" each."""
        return (1, self.kv_lora_rank), (1, self.qk_rope_head_dim)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only MoE transformer: embed -> layers (pre-norm attention, pre-norm MoE or dense
    GLU MLP) -> norm -> lm_head. Canonical tensor names in `tensor_shapes`."""

    model_type: str
    vocab_size: int
    hidden: int
    num_layers: int
    attention: AttentionSpec | MLASpec
    moe: MoESpec
    moe_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP
    sliding_windows: tuple[int | None, ...]  # per layer: keys within the last N positions, or all
    max_positions: int
    norm_eps: float = 1e-6
    dense_intermediate: int = 0
    dense_activation: GLU = GLU()
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # layers a checkpoint holds after the decoder's (DeepSeek-V3's and GLM-4.5's multi-token-
    # prediction blocks), which generation does not run: their tensors are skipped at load
    extra_layers: int = 0
    norm: str = "rms"  # every norm of the stack: "rms" (RMSNorm) or "layer" (LayerNorm with a bias: PhiMoE)
    lm_head_bias: bool = False  # PhiMoE's lm_head_bias
    # GraniteMoE: the embeddings times `embedding_multiplier`, each block's output times
    # `residual_multiplier` before it joins the residual stream, the logits divided by `logits_scaling`
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    def __post_init__(self):
        if len(self.moe_layers) != self.num_layers or len(self.sliding_windows) != self.num_layers:
            raise ConfigError("moe_layers and sliding_windows need one entry per layer.")
        if self.norm not in ("rms", "layer"):
            raise ConfigError(f"norm {self.norm!r} is not supported; moerun knows 'rms' and 'layer'.")
        attention, moe = self.attention, self.moe
        if attention.heads % attention.kv_heads:
            raise ConfigError(
                f"num_attention_heads={attention.heads} is not a multiple of "
                f"num_key_value_heads={attention.kv_heads}."
            )
        if attention.head_dim < 2 or attention.head_dim % 2:
            raise ConfigError(
                f"the head dimension is {attention.head_dim} (head_dim, or hidden_size / "
                "num_attention_heads); RoPE needs an even number of at least 2."
            )
        if not 1 <= moe.top_k <= moe.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={moe.top_k} must lie in [1, {moe.num_experts}], the number of experts."
            )
        if moe.intermediate < 1:
            raise ConfigError(f"the experts' intermediate size is {moe.intermediate}; it must be at least 1.")

    def tensor_shapes(self, held: int | None = None) -> dict[str, tuple[int, ...]]:
        """Canonical tensor name -> shape; `held`: the experts of each MoE layer this process holds
        (expert parallelism: its share), default all."""
        H = self.hidden
        norm = ("weight", "bias") if self.norm == "layer" else ("weight",)
        shapes = {"embed.weight": (self.vocab_size, H), **{f"norm.{k}": (H,) for k in norm}}
        if not self.tie_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, H)
        if self.lm_head_bias:
            shapes["lm_head.bias"] = (self.vocab_size,)
        for i in range(self.num_layers):
            p = f"layers.{i}."
            shapes.update({f"{p}{which}_norm.{k}": (H,) for which in ("attn", "mlp") for k in norm})
            shapes.update({p + "attn." + k: s for k, s in self.attention.tensor_shapes().items()})
            if self.moe_layers[i]:
                shapes.update({p + "moe." + k: s for k, s in self.moe.tensor_shapes(held).items()})
            else:
                shapes[p + "mlp.gate_up"] = (2 * self.dense_intermediate, H)
                shapes[p + "mlp.down"] = (H, self.dense_intermediate)
        return shapes
