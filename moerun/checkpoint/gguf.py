"""GGUF files -> (ModelConfig, canonical tensors), for the GGUF archs of moerun's families (each family
file states its arch and quirks in `GGUF`, a moerun.families.GGUFFacts).

The metadata becomes a Hugging Face-style config dict that the family's own `model_config` reads, so
both formats share one mapping. Where GGUF metadata is silent, this module does what llama.cpp does
for the arch, as the family's GGUFFacts state it (whether top-k weights are renormalised, GPT-OSS's
clamped SwiGLU and sliding-window period, ...), and no sliding window for the other archs. Two
deliberate differences: llama.cpp rounds YaRN's correction range to whole dims
(ggml_rope_yarn_corr_dims), but GPT-OSS was trained without that rounding (`truncate: false` in its
config, as in OpenAI's reference code, vLLM and SGLang), so for gpt-oss the range is not rounded;
and DeepSeek-V2's expert groups are ranked as it was trained (see `_deepseek_moe`). deepseek2 files
are DeepSeek-V2's or V3's by their expert gating (`_model_type`).

Tensors: convert_hf_to_gguf.py permutes the q and k rows of `llama` models for ggml's interleaved
RoPE (LlamaModel.permute); moerun rotates halves as transformers does, so they are permuted back
(whole rows, so quantised bytes too); deepseek2's kv_b, split per head into attn_k_b and attn_v_b
by newer converters, is joined back. Gate and up experts are stored apart and fused here, gate rows
then up rows, or interleaved row by row for GPT-OSS; with `assemble=False` (expert streaming) the
expert ones are described instead (`ExpertPieces` over views of the file, read by the expert store).
Names that fit nothing are passed on as they are, so the model's check reports them as unexpected.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import torch

from moerun.checkpoint.gguf_experts import (
    GateUp,
    described,
    described_experts,
    fuse,
    gate_up_pieces,
    interleave_halves,
    per_expert_parts,
    rows,
    stacked_experts,
    unpermute,
)
from moerun.decoder.config import ModelConfig
from moerun.decoder.model import check_model_tensors
from moerun.errors import ConfigError, GGUFMetadataError, TensorError, in_file, quote
from moerun.families import FAMILIES, GGUFFacts, family
from moerun.families.fields import CheckedConfig, check_field
from moerun.loader import CheckpointError, GGUFFile
from moerun.moe.layer import StateDictError
from moerun.offload.pieces import ExpertPieces, stand_ins
from moerun.quant.dequant import dequantize
from moerun.quant.formats import QTensor, storage_free
from moerun.quant.halves import GateUpHalves

Tensor = torch.Tensor | QTensor

_TOP = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {  # name inside blk.{i} -> canonical name inside layers.{i}
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "mlp_norm.weight",
    **{
        f"attn_{g}.{kind}": f"attn.{c}.{kind}"
        for g, c in zip(("q", "k", "v", "output"), "qkvo", strict=True)
        for kind in ("weight", "bias")
    },
    "attn_q_norm.weight": "attn.q_norm.weight",
    "attn_k_norm.weight": "attn.k_norm.weight",
    "attn_sinks.weight": "attn.sinks",
    # multi-head latent attention (deepseek2): q through q_a / q_b (or attn_q), the latent and the
    # rotary key from kv_a_mqa, kv_b whole (older files) or split per head (`_MLA_KV_B`)
    "attn_q_a.weight": "attn.q_a.weight",
    "attn_q_a_norm.weight": "attn.q_a_norm.weight",
    "attn_q_b.weight": "attn.q_b.weight",
    "attn_kv_a_mqa.weight": "attn.kv_a.weight",
    "attn_kv_a_norm.weight": "attn.kv_a_norm.weight",
    "attn_kv_b.weight": "attn.kv_b.weight",
    "ffn_gate_inp.weight": "moe.router.weight",
    "ffn_gate_inp.bias": "moe.router.bias",
    "exp_probs_b.bias": "moe.router.score_bias",
    "ffn_gate_up_exps.weight": "moe.experts.gate_up",
    "ffn_gate_up_exps.bias": "moe.experts.gate_up_bias",
    "ffn_down_exps.weight": "moe.experts.down",
    "ffn_down_exps.bias": "moe.experts.down_bias",
    "ffn_down_shexp.weight": "moe.shared.down",
    "ffn_gate_inp_shexp.weight": "moe.shared.gate",
    "ffn_down.weight": "mlp.down",
}
_GATE_UP = {  # canonical name -> (gate part, up part), stored apart in GGUF
    "moe.experts.gate_up": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
    "moe.experts.gate_up_bias": ("ffn_gate_exps.bias", "ffn_up_exps.bias"),
    "moe.shared.gate_up": ("ffn_gate_shexp.weight", "ffn_up_shexp.weight"),
    "mlp.gate_up": ("ffn_gate.weight", "ffn_up.weight"),
}

# attn_k_b [heads, kv_lora_rank, nope] (each head's key rows, transposed) + attn_v_b [heads, v,
# kv_lora_rank] -> kv_b, as convert_hf_to_gguf.py's DeepseekV2Model splits it for the absorbed MLA
_MLA_KV_B = ("attn_k_b.weight", "attn_v_b.weight")


_REQUIRED = object()
_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_ROPE_TYPES = {"none": "default", "linear": "linear", "yarn": "yarn"}
_GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's llama_expert_gating_func_type
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
_PER_EXPERT = re.compile(r"ffn_(gate|up|down)\.(\d+)\.weight")  # llama.cpp's layout before merged experts
# metadata key (after "{arch}.") -> the config field whose rule (moerun.families.fields) it obeys
_AS_FIELD = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.key_length_mla": "head_dim",
    "attention.value_length": "v_head_dim",
    "attention.value_length_mla": "v_head_dim",
    "attention.kv_lora_rank": "kv_lora_rank",
    "rope.dimension_count": "head_dim",
    "context_length": "max_position_embeddings",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "feed_forward_length": "intermediate_size",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "rope.freq_base": "rope_theta",
    "rope.scaling.original_context_length": "original_max_position_embeddings",
    "rope.scaling.yarn_beta_fast": "beta_fast",
    "rope.scaling.yarn_beta_slow": "beta_slow",
    "attention.sliding_window": "sliding_window",
    "nextn_predict_layers": "num_nextn_predict_layers",
    "leading_dense_block_count": "first_k_dense_replace",
    "expert_shared_count": "n_shared_experts",
    "expert_weights_norm": "norm_topk_prob",
    "expert_group_count": "n_group",
    "expert_group_used_count": "topk_group",
    "rope.scaling.yarn_log_multiplier": "mscale_all_dim",  # 0.1 x mscale_all_dim, checked as a number
}
_ROPE_FIELDS = {"rope_theta", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale_all_dim"}
# config field -> the metadata key it is read from, for messages about the config built from them
_FROM_KEY = {
    ("rope_parameters." if field in _ROPE_FIELDS else "") + field: key
    for key, field in reversed(_AS_FIELD.items())
} | {
    "num_local_experts": "expert_count",
    "clip_qkv": "attention.clamp_kqv",
    "rope_parameters.factor": "rope.scaling.factor",
    "routed_scaling_factor": "expert_weights_scale",  # read unchecked: other archs refuse any but 0, 1
    "rope_parameters.mscale": "rope.scaling.yarn_log_multiplier",
    "q_lora_rank": "attention.q_lora_rank",
    "qk_rope_head_dim": "rope.dimension_count",
    "qk_nope_head_dim": "attention.key_length_mla",
}


def gguf_archs() -> dict[str, str]:
    """GGUF `general.architecture` -> moerun family (model_type); an arch that several families share
    (deepseek2: DeepSeek-V2 and V3) -> the first, and `_model_type` tells a file's apart."""
    archs: dict[str, str] = {}
    for name in FAMILIES:
        if facts := getattr(family(name), "GGUF", None):
            archs.setdefault(facts.arch, name)
    return archs


def gguf_facts(arch: str) -> GGUFFacts:
    """The GGUFFacts of the (first) family whose files have this `general.architecture`; families that
    share an arch share its layout facts and differ only in `scoring`."""
    return family(gguf_archs()[arch]).GGUF


def _model_type(gguf: GGUFFile, arch: str) -> str:
    """The family of a file of `arch`: the arch's own, or where families share it, the one whose
    `scoring` is the file's expert_gating_func (llama.cpp's default for the arch where it is absent)."""
    sharing = [
        name for name in FAMILIES if getattr(getattr(family(name), "GGUF", None), "arch", None) == arch
    ]
    if len(sharing) == 1:
        return sharing[0]
    scoring = _gating(gguf, arch, family(sharing[0]).GGUF.default_gating)
    by_scoring = {family(name).GGUF.scoring: name for name in sharing}
    if scoring not in by_scoring:
        raise CheckpointError(
            f"{gguf.path}: {arch} files with {scoring} expert gating are not supported; moerun reads "
            f"{', '.join(f'{s} ({n})' for s, n in by_scoring.items())}."
        )
    return by_scoring[scoring]


def _gating(gguf: GGUFFile, arch: str, default: str) -> str:
    """The file's expert_gating_func as a scoring function; absent or 0 (llama.cpp's "none"): `default`."""
    key = f"{arch}.expert_gating_func"
    gating = _single(gguf.metadata[key], key, gguf) if key in gguf.metadata else 0
    scoring = default if gating == 0 else _GATING.get(gating) if isinstance(gating, int) else None
    if scoring is None:
        raise GGUFMetadataError(
            f"{gguf.path}: {key} is {quote(gating)}; moerun knows "
            f"{', '.join(f'{k} ({v})' for k, v in _GATING.items())}."
        )
    return scoring


def gguf_name_tables(arch: str) -> tuple[dict[str, str], dict[str, str], dict[str, tuple[str, str]]]:
    """The name tables this reader maps by, for writers (moerun.export): GGUF top-level name ->
    canonical name, name inside blk.{i} -> canonical name inside layers.{i} (for `arch`), and canonical
    gate/up name -> its (gate, up) GGUF parts. Copies; the reader's own stay as they are."""
    return dict(_TOP), _layer_names(gguf_facts(arch)), dict(_GATE_UP)


def _layer_names(facts: GGUFFacts) -> dict[str, str]:
    """Name inside blk.{i} -> canonical name, with the arch's own names replacing the usual ones."""
    replaced = set(facts.layer_names.values())
    return {k: v for k, v in _LAYER.items() if v not in replaced} | facts.layer_names


def gguf_model_config(gguf: GGUFFile) -> ModelConfig:
    """The model a GGUF file describes, from its metadata and tensor names (no weight is read)."""
    arch = gguf.metadata.get("general.architecture")
    archs = gguf_archs()
    if not isinstance(arch, str) or arch not in archs:
        raise ConfigError(
            f"{gguf.path}: GGUF architecture {quote(arch)} is not supported; moerun reads {sorted(archs)}."
        )
    names = {field: f"metadata key {arch}.{key}" for field, key in _FROM_KEY.items()}
    model_type = _model_type(gguf, arch)
    try:
        config = _hf_config(gguf, arch, model_type, family(model_type).GGUF)
        model_config = family(model_type).model_config(CheckedConfig(config, names))
    except ConfigError as err:
        raise in_file(err, gguf.path) from None
    return dataclasses.replace(
        model_config, moe_layers=tuple(config["moe_layers"]), dense_intermediate=config["dense_intermediate"]
    )


# the routed experts' tensors: merged [E, out, in] (and biases [E, out]) or one per expert
GGUF_EXPERT_TENSOR = re.compile(r"blk\.\d+\.ffn_(gate|up|down|gate_up)(_exps\.(weight|bias)|\.\d+\.weight)")


class _ExpertsOnly:
    """A GGUF file as a rank that computes only its experts reads it (expert parallelism, every rank
    but 0): every tensor but the routed experts' is a storage-free stand-in, so what the loader makes
    of them (fused, joined, dequantised) is one too, and nothing of them is read or copied."""

    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf

    def __getattr__(self, name: str):
        return getattr(self.gguf, name)

    def __contains__(self, name: str) -> bool:
        return name in self.gguf

    def tensor(self, name: str) -> Tensor:
        t = self.gguf.tensor(name)
        return t if GGUF_EXPERT_TENSOR.fullmatch(name) else storage_free(t)


def gguf_model(
    gguf: GGUFFile, assemble: bool = True, share=None, experts_only: bool = False
) -> tuple[ModelConfig, dict[str, Tensor | ExpertPieces]]:
    """The file's model config and canonical tensors; `assemble=False` leaves the routed gate/up
    experts described (`ExpertPieces`) instead of fused in RAM. `share` (expert parallelism, with
    `assemble`: a moerun.distributed.ExpertShard): every MoE layer's expert tensors hold only its
    experts, cut before anything is copied. `experts_only` (expert parallelism, every rank but 0,
    which never computes the rest): every other tensor a storage-free stand-in, nothing of it read."""
    model_config = gguf_model_config(gguf)
    arch = gguf.metadata["general.architecture"]
    source = _ExpertsOnly(gguf) if experts_only else gguf
    tensors = _canonical_tensors(source, arch, model_config, assemble, share)
    held = None
    if share is not None:  # what was not copied is cut here: views of the file
        tensors, held = share.cut(tensors), share.size
    try:
        check_model_tensors(model_config, stand_ins(tensors), held=held)
    except StateDictError:  # again, saying what the missing tensors are called in the file
        names = {k: _gguf_names(k, arch) for k in model_config.tensor_shapes() if k not in tensors}
        check_model_tensors(model_config, stand_ins(tensors), names, where=str(gguf.path), held=held)
    return model_config, tensors


def _hf_config(gguf: GGUFFile, arch: str, model_type: str, facts: GGUFFacts) -> dict:
    """The GGUF metadata as the config.json keys the family's `model_config` reads."""
    md, names = gguf.metadata, set(gguf.tensor_names())

    def get(key: str, default=_REQUIRED):
        name = f"{arch}.{key}"
        if name not in md:
            if default is _REQUIRED:
                raise GGUFMetadataError(f"{gguf.path}: metadata key {name} is missing.")
            return default
        value = _single(md[name], name, gguf)
        return check_field(_AS_FIELD[key], value, f"metadata key {name}") if key in _AS_FIELD else value

    blocks, hidden, heads = get("block_count"), get("embedding_length"), get("attention.head_count")
    n = blocks - get("nextn_predict_layers", 0)  # the last blocks predict further tokens: skipped
    if n < 1:
        raise GGUFMetadataError(
            f"{gguf.path}: {arch}.nextn_predict_layers leaves none of the {blocks} blocks to decode."
        )
    experts = get("expert_count", 0)
    if not experts:
        raise CheckpointError(f"{gguf.path}: a {arch} model without experts; moerun runs MoE models only.")
    mla = _mla(get) if facts.mla else {}
    head_dim = mla["qk_rope_head_dim"] if mla else get("attention.key_length", hidden // heads)
    rope_dims = _rope_dims(gguf, arch, get("rope.dimension_count", head_dim), head_dim, facts)
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{gguf.path}: has no token_embd.weight tensor.")
    if not facts.deepseek_moe_keys and get("expert_weights_scale", 0.0) not in (0, 1):
        raise CheckpointError(f"{gguf.path}: {arch}.expert_weights_scale is not supported for {arch}.")
    ff = get("feed_forward_length", 0)
    dense = [
        i
        for i in range(n)
        if f"blk.{i}.ffn_gate_inp.weight" not in names and f"blk.{i}.ffn_up.weight" in names
    ]
    expert_ff = get(facts.experts_width_key, ff)  # as llama.cpp
    # llama.cpp loads attention biases when the file has them; none for MLA
    bias = "blk.0.attn_q.bias" in names and not mla
    config = {
        "model_type": model_type,
        "vocab_size": _vocab_size(gguf),
        "hidden_size": hidden,
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "intermediate_size": expert_ff if facts.hf_experts_width_key == "intermediate_size" else ff,
        "moe_intermediate_size": expert_ff,
        "shared_expert_intermediate_size": get("expert_shared_feed_forward_length", ff),
        "num_experts": experts,
        "num_local_experts": experts,
        "num_experts_per_tok": get("expert_used_count"),
        "norm_topk_prob": facts.renormalize_top_k,
        "rope_parameters": _rope(gguf, arch, get, facts),
        "tie_word_embeddings": "output.weight" not in names,
        **_token_ids(md),
        "qkv_bias": bias,
        "attention_bias": bias,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in names,  # read where the arch makes it optional
        "clip_qkv": (get("attention.clamp_kqv", 0.0) or None) if facts.clamp_kqv else None,
        "use_sliding_window": False,
        "sliding_window": None,
        "mlp_only_layers": dense,
        "moe_layers": [i not in dense for i in range(n)],
        "dense_intermediate": ff,
    }
    if facts.swa_period is not None:
        config.update(_sliding_layers(gguf, arch, get, facts.swa_period, n))
    if facts.partial_rotary:
        config["rope_parameters"]["partial_rotary_factor"] = rope_dims / head_dim
    if facts.deepseek_moe_keys:
        config.update(_deepseek_moe(gguf, arch, get, facts))
    config.update(mla)
    config.update(facts.swiglu)
    return config


def _rope_dims(gguf: GGUFFile, arch: str, rope_dims: int, head_dim: int, facts: GGUFFacts) -> int:
    """The rotated dims of each head: all of them, or fewer where the arch rotates part of a head."""
    if rope_dims != head_dim and not (facts.partial_rotary and rope_dims < head_dim):
        what = "more than the head" if facts.partial_rotary else "part of each head"
        raise CheckpointError(
            f"{gguf.path}: {arch}.rope.dimension_count is {rope_dims} for heads of {head_dim}; RoPE over "
            f"{what} is not supported."
        )
    return rope_dims


def _vocab_size(gguf: GGUFFile) -> int:
    embed = gguf.info("token_embd.weight").shape
    if len(embed) != 2:
        raise TensorError(f"{gguf.path}: token_embd.weight has shape {embed}, not [vocab, hidden].")
    return embed[0]


def _token_ids(md: dict) -> dict:
    """bos_token_id and eos_token_id (every end-of-sequence id the metadata names, in order)."""
    eos = [check_field("token_id", md[k], f"metadata key {k}") for k in _EOS_KEYS if k in md]
    bos = md.get("tokenizer.ggml.bos_token_id")
    return {
        "bos_token_id": None if bos is None else check_field("token_id", bos, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": sorted(set(eos), key=eos.index),
    }


def _sliding_layers(gguf: GGUFFile, arch: str, get, period: int, n: int) -> dict:
    """sliding_window and layer_types of an arch with sliding-window layers: one flag per layer in
    the metadata, or a period (llama.cpp's set_swa_pattern: every period-th layer full)."""
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = gguf.metadata.get(key, period)
    if isinstance(pattern, np.ndarray | list):  # one flag per layer
        if len(pattern) != n:
            raise GGUFMetadataError(f"{gguf.path}: {key} has {len(pattern)} flags for {n} layers.")
        sliding = [bool(s) for s in pattern]
    else:
        period = check_field("sliding_window_pattern", pattern, f"metadata key {key}")
        sliding = [i % period < period - 1 for i in range(n)]
    return {
        "sliding_window": get("attention.sliding_window"),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
    }


def _deepseek_moe(gguf: GGUFFile, arch: str, get, facts: GGUFFacts) -> dict:
    """The DeepSeek-style MoE keys as config.json keys; where a key is absent, what llama.cpp
    assumes (no dense layers, no renormalisation, `facts.default_gating`, no expert groups), except
    expert_weights_scale: absent or 0 (llama.cpp's "not set") scales by 1, as transformers'
    routed_scaling_factor does.

    One deliberate difference (the module docstring's YaRN one aside): llama.cpp ranks expert groups
    by the sum of their top-2 scores whatever the gating, as DeepSeek-V3 does; DeepSeek-V2's softmax
    files are routed as DeepSeek-V2 was trained and as transformers routes it (group_limited_greedy:
    each group's best score)."""
    scoring = _gating(gguf, arch, facts.default_gating)
    norm = get("expert_weights_norm", False)
    if facts.scoring == "softmax" and norm:
        raise CheckpointError(
            f"{gguf.path}: {arch}.expert_weights_norm is true in a softmax-gated (DeepSeek-V2) file; "
            "DeepSeek-V2 does not renormalise its top-k weights, and moerun does not support it."
        )
    config = {
        "first_k_dense_replace": get("leading_dense_block_count", 0),
        "n_shared_experts": get("expert_shared_count", 0),
        "routed_scaling_factor": get("expert_weights_scale", 0.0) or 1.0,
        "norm_topk_prob": norm,
        "scoring_func": scoring,
    }
    if facts.expert_groups:
        groups = get("expert_group_count", 1)
        config.update(n_group=groups, topk_group=get("expert_group_used_count", groups))
        config["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"  # DeepSeek-V2's
    return config


def _mla(get) -> dict:
    """deepseek2's latent attention as config.json keys. Files written since llama.cpp split kv_b for
    the absorbed form give each head's q/k and v widths as key_length_mla / value_length_mla (their
    key_length / value_length are the latent's: kv_lora_rank + rope, kv_lora_rank; head_count_kv 1);
    older files give them as key_length / value_length. A q_lora_rank of 0 or none: q projected
    directly. ggml's normal RoPE rotates interleaved pairs, as DeepSeek lays them out."""
    rope = get("rope.dimension_count")
    k_mla, v_mla = get("attention.key_length_mla", 0), get("attention.value_length_mla", 0)
    if k_mla and v_mla:
        qk, v = k_mla, v_mla
    else:
        qk, v = get("attention.key_length"), get("attention.value_length")
    return {
        "q_lora_rank": get("attention.q_lora_rank", 0) or None,
        "kv_lora_rank": get("attention.kv_lora_rank"),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": qk - rope,
        "v_head_dim": v,
        "attention_bias": False,
        "rope_interleave": True,
    }


def _rope(gguf: GGUFFile, arch: str, get, facts: GGUFFacts) -> dict:
    kind = get("rope.scaling.type", "none")
    if not isinstance(kind, str) or kind not in _ROPE_TYPES:
        raise ConfigError(
            f"{gguf.path}: {arch}.rope.scaling.type {quote(kind)} is not supported; "
            f"moerun knows {list(_ROPE_TYPES)}."
        )
    rope = {"rope_type": _ROPE_TYPES[kind], "rope_theta": float(get("rope.freq_base", 10000.0))}
    if kind != "none":  # a factor of 0 is llama.cpp's "not set"; the config's own rule checks the rest
        rope["factor"] = get("rope.scaling.factor", 0.0) or get("rope.scale_linear", 0.0) or 1.0
    if kind == "yarn":
        rope["original_max_position_embeddings"] = get(
            "rope.scaling.original_context_length", get("context_length")
        )
        rope["beta_fast"] = get("rope.scaling.yarn_beta_fast", 32.0)
        rope["beta_slow"] = get("rope.scaling.yarn_beta_slow", 1.0)
        rope["truncate"] = facts.yarn_truncate  # see the module docstring
    if kind == "yarn" and facts.mla:
        rope.update(_mla_yarn(gguf, arch, get))
    return rope


def _mla_yarn(gguf: GGUFFile, arch: str, get) -> dict:
    """deepseek2's YaRN as llama.cpp runs it: cos and sin unscaled (ggml's own YaRN factor cancelled)
    and the scores times (1 + 0.1 mscale_all_dim ln factor)^2, mscale_all_dim written x 0.1 as
    rope.scaling.yarn_log_multiplier; in transformers' terms mscale = mscale_all_dim, or no mscale
    and an attention_factor of 1 where the key is absent."""
    if get("rope.scaling.yarn_attn_factor", 1.0) != 1.0:
        raise CheckpointError(
            f"{gguf.path}: {arch}.rope.scaling.yarn_attn_factor is not supported for {arch} (only 1)."
        )
    log_mul = get("rope.scaling.yarn_log_multiplier", 0.0)
    if not log_mul:
        return {"attention_factor": 1.0}
    return {"mscale": log_mul / 0.1, "mscale_all_dim": log_mul / 0.1}


def _single(value, key: str, gguf: GGUFFile):
    """A per-layer array whose entries all agree -> that value; moerun has no per-layer head counts."""
    if isinstance(value, np.ndarray | list):
        values = value.tolist() if isinstance(value, np.ndarray) else value
        if not values or any(isinstance(v, list) for v in values):
            raise GGUFMetadataError(
                f"{gguf.path}: metadata key {key} is the array {quote(values)}, not a number."
            )
        if len(set(values)) != 1:
            raise GGUFMetadataError(
                f"{gguf.path}: metadata key {key} differs between layers, which moerun does not support."
            )
        return values[0]
    return value


def _canonical_tensors(
    gguf: GGUFFile, arch: str, config: ModelConfig, assemble: bool = True, share=None
) -> dict[str, Tensor | ExpertPieces]:
    facts = gguf_facts(arch)
    layer_names = _layer_names(facts)
    tensors: dict[str, Tensor | ExpertPieces] = {}
    blocks: dict[int, dict[str, str]] = {}  # layer -> name inside the block -> file name
    per_expert: dict[int, dict[str, dict[int, str]]] = {}  # old layout: layer -> proj -> expert -> name
    # the blocks after the decoder's (nextn_predict_layers: next-token prediction), which llama.cpp
    # loads and never runs
    count = f"{arch}.block_count"
    skipped = range(config.num_layers, _single(gguf.metadata[count], count, gguf))
    for name in gguf.tensor_names():
        if (m := _BLOCK.fullmatch(name)) and int(m.group(1)) in skipped:
            continue
        if m:
            if old := _PER_EXPERT.fullmatch(m.group(2)):
                per_expert.setdefault(int(m.group(1)), {}).setdefault(old[1], {})[int(old[2])] = name
            else:
                blocks.setdefault(int(m.group(1)), {})[m.group(2)] = name
        else:
            tensors[_TOP.get(name, name)] = gguf.tensor(name)
    for layer, by_projection in per_expert.items():
        gate, up, down = per_expert_parts(gguf, f"blk.{layer}.", by_projection)
        if share is not None and len(gate) == share.num_experts:  # only the share's are stacked
            gate, up, down = (p[share.start : share.stop] for p in (gate, up, down))
        joined = (
            stacked_experts(gguf, gate, up, down, by_projection)
            if assemble
            else described_experts(gate, up, down)
        )
        tensors.update({f"layers.{layer}.moe.experts.{k}": v for k, v in joined.items()})
    for layer, block in sorted(blocks.items()):
        prefix = f"layers.{layer}."
        for canonical, (gate, up) in _GATE_UP.items():
            if gate in block and up in block:
                interleave = facts.interleaved_gate_up and canonical.startswith("moe.experts")
                parts = GateUp((block.pop(gate), block.pop(up)), expert="exps" in gate, interleave=interleave)
                describe = not assemble and canonical == "moe.experts.gate_up"
                tensors[prefix + canonical] = described(gguf, parts) if describe else fuse(gguf, parts, share)
        for dim, rel in ((-2, "ffn_gate_up_exps.weight"), (-1, "ffn_gate_up_exps.bias")):
            if facts.interleaved_gate_up and rel in block:  # stored fused as gate rows then up rows
                t = gguf.tensor(block.pop(rel))
                if share is not None:
                    t = share.cut_one(t)
                if dim == -1:
                    tensors[prefix + layer_names[rel]] = interleave_halves(t, dim)
                    continue
                half = t.shape[-2] // 2
                gate, up = rows(t, 0, half), rows(t, half, 2 * half)
                tensors[prefix + layer_names[rel]] = (
                    GateUpHalves(gate, up, interleaved=True)  # used in place
                    if assemble
                    else gate_up_pieces(gate, up, interleave=True)  # described for the store
                )
        if all(rel in block for rel in _MLA_KV_B):
            tensors[prefix + "attn.kv_b.weight"] = _joined_kv_b(gguf, tuple(block.pop(r) for r in _MLA_KV_B))
        for rel, name in block.items():
            canonical = layer_names.get(rel)
            tensors[prefix + canonical if canonical else name] = gguf.tensor(name)
        shared_gate = tensors.get(prefix + "moe.shared.gate")
        if isinstance(shared_gate, torch.Tensor) and shared_gate.dim() == 1:
            tensors[prefix + "moe.shared.gate"] = shared_gate[None]  # llama.cpp stores it [H]
        if facts.permuted_qk:
            attention = config.attention
            for proj, heads in (("q", attention.heads), ("k", attention.kv_heads)):
                for kind in ("weight", "bias"):
                    t = tensors.get(f"{prefix}attn.{proj}.{kind}")
                    if t is not None and t.shape[0] == heads * attention.head_dim:  # else: reported
                        tensors[f"{prefix}attn.{proj}.{kind}"] = unpermute(t, heads)
    return tensors


def _joined_kv_b(gguf: GGUFFile, names: tuple[str, str]) -> torch.Tensor:
    """attn_k_b [heads, kv_lora_rank, nope] and attn_v_b [heads, v, kv_lora_rank] -> kv_b
    [heads * (nope + v), kv_lora_rank]: each head's key rows, then its value rows, as transformers'
    kv_b_proj. Dequantised where stored quantised: k_b's rows run along nope, kv_b's along the latent."""
    k_b, v_b = (gguf.tensor(n) for n in names)
    k_b, v_b = (dequantize(t) if isinstance(t, QTensor) else t for t in (k_b, v_b))
    if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise TensorError(
            f"{gguf.path}: {names[0]} is {tuple(k_b.shape)} and {names[1]} is {tuple(v_b.shape)}; they "
            "must be [heads, kv_lora_rank, qk_nope_head_dim] and [heads, v_head_dim, kv_lora_rank]."
        )
    if k_b.dtype != v_b.dtype:
        k_b, v_b = k_b.float(), v_b.float()
    kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [heads, nope + v, kv_lora_rank], a copy
    for name in names:
        gguf.release(name)
    return kv_b.reshape(-1, kv_b.shape[-1])


def _gguf_names(canonical: str, arch: str) -> str:
    """The GGUF name(s) a canonical tensor comes from, for error messages."""
    if canonical in _TOP.values():
        return next(g for g, c in _TOP.items() if c == canonical)
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", canonical)
    if not m:
        return canonical
    layer, rel = m.groups()
    if rel in _GATE_UP:
        return " + ".join(f"blk.{layer}.{part}" for part in _GATE_UP[rel])
    if rel == "attn.kv_b.weight":
        return f"blk.{layer}.attn_kv_b.weight (or {' + '.join(f'blk.{layer}.{p}' for p in _MLA_KV_B)})"
    table = _layer_names(gguf_facts(arch))
    return next((f"blk.{layer}.{g}" for g, c in table.items() if c == rel), canonical)
