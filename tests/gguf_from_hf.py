"""Write a tiny transformers model (`hf_models.make_model`) as a GGUF file the way llama.cpp's
convert_hf_to_gguf.py does for its arch: the same metadata keys, tensor names (gguf-py's
tensor_mapping), q/k rows permuted for `llama` (LlamaModel.permute), experts merged per projection
[E, out, in] with gate and up apart (GPT-OSS's interleaved gate/up split into even and odd rows), the
Qwen2-MoE shared-expert gate stored [H], GPT-OSS's and GLM-4 MoE's MLP norm named post_attention_norm,
GLM-4 MoE's and DeepSeek-V3's score-correction bias as exp_probs_b.bias, GLM-4 MoE's
multi-token-prediction layers (made up here: the tiny models have none) as blocks after the decoder's,
DeepSeek-V2/V3's kv_b split per head into attn_k_b (transposed) and attn_v_b with their MLA keys,
or (`legacy_mla`) kept whole with the keys of the files written before that split. One addition:
OLMoE's clip_qkv is written as `olmoe.attention.clamp_kqv` (the converter drops it).

Expert projections may be quantised with moerun's quantisers (bit-exact with ggml's reference ones),
or, in a format moerun reads but does not write (the i-quants made with an importance matrix), stored
as random valid blocks of about the tensor's spread; the writer returns what the file then holds,
decoded by the gguf package's numpy dequantisers, under transformers' names and layouts, so a test can
load it back into the transformers model and compare like with like.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path

import gguf
import numpy as np
import torch

from moerun.quant.formats import FORMATS, QTensor
from moerun.quant.quantize import READ_ONLY, quantize

ARCHS = {
    "mixtral": gguf.MODEL_ARCH.LLAMA,
    "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "olmoe": gguf.MODEL_ARCH.OLMOE,
    "gpt_oss": gguf.MODEL_ARCH.GPT_OSS,
    "glm4_moe": gguf.MODEL_ARCH.GLM4_MOE,
    "deepseek_v2": gguf.MODEL_ARCH.DEEPSEEK2,
    "deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2,
}
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
_ATTENTION = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")


def write_gguf(
    model,
    path: Path,
    experts: str = "f32",
    up: str | None = None,
    down: str | None = None,
    attention: str = "f32",
    skip: Collection[str] = (),
    per_expert: bool = False,
    fuse_gate_up: bool = False,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
    nextn_blocks: int = 0,
    legacy_mla: bool = False,
    per_tensor: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Write `model` to `path`: gate experts in format `experts`, up in `up`, down in `down` (both
    default to `experts`), attention projections in `attention` ("f32" or a block format); tensors
    named in `skip` are left out; `per_expert` writes the old one-tensor-per-expert layout and
    `fuse_gate_up` the newer fused ffn_gate_up_exps (gate rows then up rows; --fuse-gate-up-exps);
    `extra(writer)` adds more metadata (a vocabulary: tiny_tokenizers.add_gguf_vocab); `nextn_blocks`
    (glm4_moe) appends that many multi-token-prediction blocks of random tensors, as the converter
    writes a real checkpoint's `num_nextn_predict_layers`; `legacy_mla` (DeepSeek) writes the
    deepseek2 layout of before llama.cpp's absorbed MLA (one attn_kv_b, no *_mla or expert-group keys).
    `per_tensor` {GGUF tensor name: format} overrides any of these for single tensors (a dense weight
    too: the output, an embedding); a layer's gate and up must agree, and the experts' formats it
    overrides must not be f32.

    Returns {transformers parameter name: tensor} for every parameter whose stored values differ from
    the model's (the quantised ones, dequantised, in transformers' layout)."""
    config, model_type = model.config, model.config.model_type
    arch = ARCHS[model_type]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _metadata(writer, config, model_type, nextn_blocks, legacy_mla)
    if extra is not None:
        extra(writer)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    formats = {"gate": experts, "up": up or experts, "down": down or experts}
    updates: dict[str, torch.Tensor] = {}

    def add(name: str, tensor: torch.Tensor, fmt: str = "f32") -> torch.Tensor:
        """Store `tensor` as `fmt` (or as `per_tensor` says); returns the values the file then holds
        (`tensor` itself where it is stored as f32)."""
        fmt = (per_tensor or {}).get(name, fmt)
        if name in skip:
            return tensor
        if fmt == "f32":
            writer.add_tensor(name, tensor.detach().float().contiguous().numpy())
            return tensor
        q = _quantize(tensor.detach().float(), fmt)
        ggml_type = gguf.GGMLQuantizationType(q.format.ggml_type)
        writer.add_tensor(name, q.data.numpy(), raw_dtype=ggml_type)
        values = gguf.quants.dequantize(q.data.numpy(), ggml_type)  # the independent decoder
        return torch.from_numpy(values.reshape(q.shape).copy())

    for hf_name, tensor in model.state_dict().items():
        if ".mlp.experts." in hf_name:
            layout = "per_expert" if per_expert else "fused" if fuse_gate_up else "merged"
            updates.update(_experts(add, hf_name, tensor, model_type, formats, layout))
            continue
        # as the converter's filter_tensors: a name gguf-py's tensor map knows
        mapped = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
        name = names.get_name(mapped, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        if name.endswith("attn_sinks"):
            name += ".weight"  # as GptOssModel.filter_tensors
        if name.endswith("ffn_gate_inp_shexp.weight"):
            tensor = tensor.reshape(-1)  # llama.cpp's shape: [H]
        if name.endswith("attn_kv_b.weight") and not legacy_mla:
            for part_name, part in zip(("attn_k_b", "attn_v_b"), split_kv_b(tensor, config), strict=True):
                add(name.replace("attn_kv_b", part_name), part)
            continue
        permute = model_type == "mixtral" and name.split(".")[-2] in ("attn_q", "attn_k")
        heads = config.num_attention_heads if "attn_q" in name else config.num_key_value_heads
        if permute:
            tensor = llama_permute(tensor, heads)
        fmt = attention if name.split(".", 2)[-1] in _ATTENTION else "f32"
        stored = add(name, tensor, fmt)
        if stored is not tensor:
            updates[hf_name] = llama_unpermute(stored, heads) if permute else stored
    for block in range(config.num_hidden_layers, config.num_hidden_layers + nextn_blocks):
        _nextn_block(writer, model.state_dict(), config, block)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return updates


def split_kv_b(kv_b: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepseekV2Model.modify_tensors: kv_b [heads * (nope + v), kv_lora_rank] -> k_b [heads,
    kv_lora_rank, nope] (each head's key rows, transposed) and v_b [heads, v, kv_lora_rank]."""
    nope, v = config.qk_nope_head_dim, config.v_head_dim
    per_head = kv_b.view(config.num_attention_heads, nope + v, kv_b.shape[-1])
    k_b, v_b = torch.split(per_head, [nope, v], dim=1)
    return k_b.transpose(1, 2), v_b


def _nextn_block(writer: gguf.GGUFWriter, state: dict, config, block: int) -> None:
    """A GLM-4 MoE multi-token-prediction block as the converter writes one: a decoder layer's tensors
    (the last layer's shapes, experts merged) plus nextn.eh_proj, enorm, hnorm, shared_head_norm."""
    gen, last, H = torch.Generator().manual_seed(block), config.num_hidden_layers - 1, config.hidden_size
    shapes = {"nextn.eh_proj.weight": (H, 2 * H), "nextn.enorm.weight": (H,), "nextn.hnorm.weight": (H,)}
    shapes["nextn.shared_head_norm.weight"] = (H,)
    names = gguf.get_tensor_name_map(ARCHS[config.model_type], block + 1)
    for hf_name, tensor in state.items():
        if not hf_name.startswith(f"model.layers.{last}."):
            continue
        hf_name = hf_name.replace(f"layers.{last}.", f"layers.{block}.")
        if hf_name.endswith("experts.gate_up_proj"):
            shapes[f"blk.{block}.ffn_gate_exps.weight"] = tensor.chunk(2, dim=-2)[0].shape
            shapes[f"blk.{block}.ffn_up_exps.weight"] = tensor.chunk(2, dim=-2)[0].shape
        elif hf_name.endswith("experts.down_proj"):
            shapes[f"blk.{block}.ffn_down_exps.weight"] = tensor.shape
        else:
            mapped = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
            shapes[names.get_name(mapped, try_suffixes=(".weight", ".bias"))] = tensor.shape
    for name, shape in shapes.items():
        name = name if name.startswith("blk.") else f"blk.{block}.{name}"
        writer.add_tensor(name, torch.randn(shape, generator=gen).numpy())


def _quantize(tensor: torch.Tensor, fmt: str) -> QTensor:
    """On one thread: these tensors are small, and on a busy 2-core machine the thread pool made
    quantising them up to 20x slower. A format moerun does not write gets random blocks instead."""
    if fmt in READ_ONLY:
        seed = int(tensor.abs().sum().item() * 1e4) % 2**32  # another tensor, other blocks
        return random_blocks(fmt, tuple(tensor.shape), float(tensor.std()), seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return quantize(tensor, fmt)
    finally:
        torch.set_num_threads(threads)


def random_blocks(fmt: str, shape: tuple[int, ...], std: float, seed: int = 0) -> QTensor:
    """A `fmt` tensor of logical `shape` made of random bytes, valid for the format (every grid index
    and sign pattern is), with each block's fp16 scale set so that the values' RMS is about `std`
    (all values are that scale times a function of the other bits)."""
    f = FORMATS[fmt]
    rows = int(np.prod(shape[:-1]))
    blocks = np.random.default_rng(seed).integers(0, 256, (rows * shape[-1] // f.block_size, f.block_bytes))
    blocks = blocks.astype(np.uint8)
    ggml_type = gguf.GGMLQuantizationType(f.ggml_type)
    _set_scale(fmt, blocks, 1.0)
    rms = float(np.sqrt(np.mean(gguf.quants.dequantize(blocks, ggml_type) ** 2)))
    _set_scale(fmt, blocks, std / rms)
    return QTensor.from_bytes(fmt, shape, torch.from_numpy(blocks))


def _set_scale(fmt: str, blocks: np.ndarray, d: float) -> None:
    """Set every block's fp16 super-block scale to d (IQ1_M's is spread over the top nibbles of its
    four uint16 scale words; the others' is the first two bytes)."""
    bits = int(np.array(d, np.float16).view(np.uint16))
    if fmt == "iq1_m":
        words = blocks[:, 48:56].copy().view(np.uint16)  # [N, 4]
        nibbles = np.array([(bits >> (4 * i)) & 0xF for i in range(4)], np.uint16)
        blocks[:, 48:56] = ((words & 0x0FFF) | (nibbles << 12)).view(np.uint8)
    else:
        blocks[:, 0:2] = np.array([bits & 0xFF, bits >> 8], np.uint8)


def llama_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows in ggml's interleaved RoPE order."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `llama_permute`."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _experts(add, hf_name: str, tensor: torch.Tensor, model_type: str, formats: dict, layout: str):
    """transformers' fused experts -> ffn_{gate,up,down}_exps (weights [E, out, in], biases [E, out])."""
    layer = int(hf_name.split(".")[2])
    prefix, kind = f"blk.{layer}.", "bias" if hf_name.endswith("_bias") else "weight"
    gpt_oss = model_type == "gpt_oss"
    if gpt_oss and kind == "weight":
        tensor = tensor.transpose(-1, -2)  # transformers stores GPT-OSS experts [E, in, out]
    if "gate_up_proj" not in hf_name:
        if layout == "per_expert" and kind == "weight":
            fmt = formats["down"]
            stored = torch.stack(
                [add(f"{prefix}ffn_down.{e}.weight", tensor[e], fmt) for e in range(len(tensor))]
            )
            return {} if fmt == "f32" else {hf_name: stored}
        stored = add(f"{prefix}ffn_down_exps.{kind}", tensor, formats["down"] if kind == "weight" else "f32")
        if kind == "bias" or formats["down"] == "f32":
            return {}
        return {hf_name: stored.transpose(-1, -2) if gpt_oss else stored}
    rows = -1 if kind == "bias" else -2
    if gpt_oss:  # interleaved: gate j at 2j, up j at 2j + 1
        gate, up = tensor.unflatten(rows, (-1, 2)).unbind(rows)
    else:
        gate, up = tensor.chunk(2, dim=rows)
    if layout == "per_expert" and kind == "weight":
        fmt = (formats["gate"], formats["up"])
        gate = torch.stack([add(f"{prefix}ffn_gate.{e}.weight", gate[e], fmt[0]) for e in range(len(gate))])
        up = torch.stack([add(f"{prefix}ffn_up.{e}.weight", up[e], fmt[1]) for e in range(len(up))])
        return {} if fmt == ("f32", "f32") else {hf_name: torch.cat([gate, up], rows)}
    if layout == "fused":  # dense only here
        add(f"{prefix}ffn_gate_up_exps.{kind}", torch.cat([gate, up], dim=rows))
        return {}
    fmt = ("f32", "f32") if kind == "bias" else (formats["gate"], formats["up"])
    gate = add(f"{prefix}ffn_gate_exps.{kind}", gate, fmt[0])
    up = add(f"{prefix}ffn_up_exps.{kind}", up, fmt[1])
    if fmt == ("f32", "f32"):
        return {}
    fused = (
        torch.stack([gate, up], dim=rows).flatten(rows - 1, rows) if gpt_oss else torch.cat([gate, up], rows)
    )
    return {hf_name: fused.transpose(-1, -2) if gpt_oss else fused}


def _metadata(
    writer: gguf.GGUFWriter, config, model_type: str, nextn_blocks: int = 0, legacy_mla: bool = False
) -> None:
    """TextModel.set_gguf_parameters plus each model class's additions."""
    _check_representable(config, model_type, legacy_mla)
    writer.add_block_count(config.num_hidden_layers + nextn_blocks)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    # DeepseekV2Model: MLA as MQA over the shared latent (num_key_value_heads set to 1)
    absorbed = model_type in DEEPSEEK and not legacy_mla
    writer.add_head_count_kv(1 if absorbed else config.num_key_value_heads)
    rope = dict(config.rope_parameters)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    writer.add_expert_count(experts)
    writer.add_expert_used_count(getattr(config, "num_experts_per_tok", None) or config.experts_per_token)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None and model_type not in DEEPSEEK:  # DeepseekV2Model writes its own
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if model_type == "mixtral":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim or config.hidden_size // config.num_attention_heads)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if model_type == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if model_type == "olmoe" and config.clip_qkv is not None:
        writer.add_clamp_kqv(config.clip_qkv)
    if model_type == "gpt_oss":
        writer.add_sliding_window(config.sliding_window)
        writer.add_expert_feed_forward_length(config.intermediate_size)
    if model_type == "glm4_moe":  # Glm4MoeModel.set_gguf_parameters
        rotary = config.rope_parameters.get("partial_rotary_factor", 0.5)
        writer.add_rope_dimension_count(
            int((head_dim or config.hidden_size // config.num_attention_heads) * rotary)
        )
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_count(config.n_shared_experts)
        writer.add_leading_dense_block_count(config.first_k_dense_replace)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(config.routed_scaling_factor)
        writer.add_expert_weights_norm(config.norm_topk_prob)
        writer.add_nextn_predict_layers(nextn_blocks)
    if model_type in DEEPSEEK:
        _deepseek2_metadata(writer, config, model_type, legacy_mla)
    for key, value in (("bos", config.bos_token_id), ("eos", config.eos_token_id)):
        if value is not None:
            writer.add_uint32(f"tokenizer.ggml.{key}_token_id", value)


def _deepseek2_metadata(writer: gguf.GGUFWriter, config, model_type: str, legacy: bool) -> None:
    """DeepseekV2Model.set_gguf_parameters, and the expert-group and gating keys TextModel's writes
    from a real checkpoint's config.json (n_group, topk_group, scoring_func: softmax for V2, sigmoid
    for V3). `legacy`: as the converter wrote before the absorbed MLA (the heads' key and value
    widths as key_length / value_length, expert_weights_norm always, no expert groups; DeepSeek-V2's
    first files had no gating key either: llama.cpp assumes softmax)."""
    kv_lora, rope_dims = config.kv_lora_rank, config.qk_rope_head_dim
    qk = config.qk_nope_head_dim + rope_dims
    if not legacy:
        if config.n_group is not None:
            writer.add_expert_group_count(config.n_group)
        if config.topk_group is not None:
            writer.add_expert_group_used_count(config.topk_group)
    if model_type == "deepseek_v3":
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    elif not legacy:
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_vocab_size(config.vocab_size)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(kv_lora)
    if legacy:
        writer.add_key_length(qk)
        writer.add_value_length(config.v_head_dim)
    else:
        writer.add_key_length(kv_lora + rope_dims)
        writer.add_value_length(kv_lora)
        writer.add_key_length_mla(qk)
        writer.add_value_length_mla(config.v_head_dim)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    if legacy or config.norm_topk_prob:
        writer.add_expert_weights_norm(bool(config.norm_topk_prob))
    writer.add_rope_dimension_count(rope_dims)
    if (mscale_all_dim := config.rope_parameters.get("mscale_all_dim")) is not None:
        writer.add_rope_scaling_yarn_log_mul(0.1 * mscale_all_dim)


def _check_representable(config, model_type: str, legacy_mla: bool = False) -> None:
    """Refuse configs whose behaviour llama.cpp's arch cannot express (so a test cannot pass by luck)."""
    problems = []
    if model_type == "mixtral" and config.sliding_window is not None:
        problems.append("llama.cpp's llama arch has no sliding window")
    if model_type in ("qwen2_moe", "qwen3_moe"):
        if getattr(config, "use_sliding_window", False):
            problems.append("llama.cpp's qwen MoE archs have no sliding window")
        if config.mlp_only_layers or config.decoder_sparse_step != 1:
            problems.append("llama.cpp's qwen MoE archs have MoE in every layer")
    if model_type == "gpt_oss":
        if config.swiglu_limit != 7.0:
            problems.append("llama.cpp's gpt-oss SwiGLU limit is 7.0")
        pattern = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config.num_hidden_layers)
        ]
        if list(config.layer_types) != pattern:
            problems.append("llama.cpp's gpt-oss has sliding windows on even layers only")
    if model_type == "glm4_moe" and (config.n_group, config.topk_group) != (1, 1):
        problems.append("llama.cpp's glm4moe routes without expert groups")
    if model_type in DEEPSEEK:
        problems += _deepseek2_problems(config, model_type, legacy_mla)
    if problems:
        raise ValueError(f"{model_type} config not representable in GGUF: {'; '.join(problems)}.")


def _deepseek2_problems(config, model_type: str, legacy: bool) -> list[str]:
    problems = []
    if not getattr(config, "rope_interleave", True):
        problems.append("llama.cpp's deepseek2 rotates interleaved pairs (rope_interleave)")
    if config.attention_bias:
        problems.append("llama.cpp's deepseek2 loads no attention biases")
    rope = config.rope_parameters
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if rope.get("rope_type") == "yarn" and (mscale_all_dim is None or mscale != mscale_all_dim):
        problems.append("llama.cpp's deepseek2 scales YaRN by mscale_all_dim alone (mscale must equal it)")
    grouped = (config.n_group or 1) > 1
    if model_type == "deepseek_v2":
        if config.norm_topk_prob:
            problems.append("llama.cpp renormalises the top-k weights, transformers' DeepSeek-V2 does not")
        if grouped and (legacy or config.topk_method != "group_limited_greedy"):
            problems.append("the expert groups are not the ones transformers' DeepSeek-V2 routes by")
    if model_type == "deepseek_v3" and grouped and legacy:
        problems.append("the older deepseek2 files have no expert groups")
    return problems


def write_unknown_arch(path: Path, arch: str = "mamba") -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Configs llama.cpp's archs can express: no sliding window outside gpt-oss, MoE in every Qwen layer,
# gpt-oss's fixed SwiGLU limit. (qwen3_moe keeps hf_models' YaRN, which GGUF metadata carries.)
GGUF_OVERRIDES = {
    "mixtral": dict(sliding_window=None),
    "qwen2_moe": dict(mlp_only_layers=[], use_sliding_window=False),
    "qwen3_moe": {},
    "olmoe": {},
    "gpt_oss": dict(swiglu_limit=7.0),
}
# k-quants need rows of 256: hidden and expert intermediate 256, kept to 2 layers and 4 experts.
QUANT_SIZES = {
    "mixtral": dict(intermediate_size=256, num_local_experts=4),
    "qwen2_moe": dict(moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2),
    "olmoe": dict(intermediate_size=256, num_experts=4),
    "gpt_oss": dict(intermediate_size=256, num_local_experts=4),
}
