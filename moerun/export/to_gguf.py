"""A Hugging Face checkpoint -> a GGUF file with quantised experts (`moerun quantize`): the inverse of
`moerun.checkpoint.gguf`, with its name tables, and what llama.cpp's convert_hf_to_gguf.py
writes for the arch: its metadata keys, q and k rows permuted for `llama` (LlamaModel.permute), gate
and up experts stored apart ([E, I, H] each; GPT-OSS's interleaved rows split into even and odd), the
Qwen2-MoE shared-expert gate stored [H], GPT-OSS's MLP norm named post_attention_norm, DeepSeek's
kv_b split per head into attn_k_b (transposed) and attn_v_b as the absorbed MLA of llama.cpp's
deepseek2 reads it.

Formats (moerun.export.convert), as llama.cpp keeps them: expert projections in `spec.experts` (down
in `spec.down`); 1-D tensors, biases and the router (ffn_gate_inp) in f32; the other 2-D weights in
`spec.rest`. Rows that are not whole blocks of a format fall back as llama-quantize falls back (q4_k
to q5_0, q6_k to q8_0, iq4_xs to iq4_nl, ...: `convert.FALLBACKS`) or else to f16; the fallback is
said on the log, and each layer's line and the closing summary name the formats stored, not the ones
asked for. GPT-OSS's MXFP4 experts become
GGUF MXFP4 without loss. Before any weight is read, the metadata is read back as `gguf_checkpoint`
reads it, and a model that the file would describe differently (a sliding window the arch lacks,
another routing rule) is refused.

Memory: experts are quantised one at a time, other tensors a slice of rows at a time, source pages
are given back once converted, and each converted tensor goes to the writer's spill file next to the
output at once: the peak is about one layer's experts in the source dtype (stacked by
`canonical_tensors` for per-expert checkpoints). Disk: the output's size twice, until the spill file
is copied behind the header and removed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from moerun.checkpoint.gguf import gguf_facts, gguf_model_config, gguf_name_tables
from moerun.checkpoint.hf import canonical_tensors
from moerun.checkpoint.load import hf_model_config
from moerun.decoder.config import ModelConfig
from moerun.decoder.model import check_model_tensors
from moerun.export.convert import ExportError, QuantizeSpec, Tensor, TensorConverter
from moerun.export.gguf_vocab_export import VocabError, vocab_metadata
from moerun.export.gguf_writer import GGUFWriter
from moerun.families import FAMILIES, GGUFFacts, family
from moerun.loader import CheckpointError, SafetensorsCheckpoint, resolve_checkpoint
from moerun.loader.hf_config import read_hf_config
from moerun.quant.dequant import dequantize
from moerun.quant.formats import QTensor

# general.file_type (llama.cpp's llama_ftype) by expert format: the "mostly" type of the bulk
FILE_TYPES = {
    "f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k": 11,
    "q4_k": 14, "q5_k": 16, "q6_k": 18, "iq4_nl": 25, "iq4_xs": 30, "bf16": 32, "tq1_0": 36,
    "tq2_0": 37, "mxfp4": 38,
}  # fmt: skip
QUANTIZATION_VERSION = 2  # general.quantization_version of ggml's current block layouts
_CHECKPOINT_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")  # as moerun.checkpoint.hf
# bos and eos come from the tokenizer keys; a checkpoint's multi-token-prediction layers are not written
_NOT_COMPARED = frozenset({"bos_token_id", "eos_token_ids", "extra_layers"})


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def quantize_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    spec: QuantizeSpec,
    force: bool = False,
    log: Callable[[str], None] = _stderr,
) -> Path:
    """Write the checkpoint `src` (a directory, or a hub id in the local cache) to the GGUF file `out`
    with its experts in `spec`'s formats; an existing `out` is replaced only with `force`."""
    out = Path(out)
    _check_target(out, force)
    root = resolve_checkpoint(src)
    if not root.is_dir():
        raise ExportError(
            f"{root}: quantize reads a Hugging Face checkpoint directory (config.json, safetensors)."
        )
    model_type = read_hf_config(root)["model_type"]
    facts = getattr(family(model_type), "GGUF", None) if model_type in FAMILIES else None
    arch = facts.arch if facts else None
    if arch is None:
        writable = [name for name in FAMILIES if hasattr(family(name), "GGUF")]
        raise ExportError(
            f"{root}: moerun cannot write {model_type} models as GGUF; it writes {', '.join(writable)}."
        )
    config = hf_model_config(root)
    _check_not_source(out, root)
    checkpoint = SafetensorsCheckpoint(root)
    names = _gguf_layout_names(config, arch, checkpoint, root)
    metadata = model_metadata(config, arch, Path(os.fspath(src)).name or root.resolve().name, spec)
    _check_same_model(config, arch, metadata, names, root)
    metadata.update(_vocab(root, config.vocab_size, log))

    writer = GGUFWriter(spill_dir=out.parent)  # tensors go to disk as converted
    for key, value in metadata.items():
        writer.add(key, value)
    convert = TensorConverter(spec, log)
    groups = _layer_groups(checkpoint.names())
    started = time.perf_counter()
    for layer, group in sorted(groups.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        tensors, sources = canonical_tensors(
            config.model_type, config, group, checkpoint.tensor, checkpoint.release
        )
        for canonical, tensor in tensors.items():
            for name, part in gguf_layout(arch, canonical, tensor, config):
                writer.add_tensor(name, convert(name, part))
            # its pages have been read; a tensor kept as a view of them reads them again when written
            for source in sources.get(canonical, "").split(" + "):
                if source in checkpoint:
                    checkpoint.release(source)
        if layer is not None:
            elapsed = time.perf_counter() - started
            left = elapsed / (layer + 1) * (config.num_layers - layer - 1)
            log(
                f"layer {layer + 1}/{config.num_layers}: {config.moe.num_experts} experts -> "
                f"{convert.experts_stored()}; {elapsed:.0f} s so far, about {left:.0f} s left"
            )
    log(f"stored: {convert.summary()}")
    log(f"writing {out}")
    return writer.write(out, force=force)


def _check_target(out: Path, force: bool) -> None:
    if out.suffix != ".gguf":
        raise ExportError(f"{out}: the output file's name must end in .gguf (moerun tells GGUF files by it).")
    if out.is_dir():
        raise ExportError(f"{out} is a directory; give the path of the .gguf file to write.")
    if out.exists() and not force:
        raise ExportError(f"{out} exists; pass --force to replace it.")
    if not out.parent.is_dir():
        raise ExportError(f"{out.parent}: no such directory to write {out.name} into.")


def _check_not_source(out: Path, root: Path) -> None:
    """Never replace a file of the checkpoint (a hub snapshot's files are links to its blobs)."""
    if out.exists() and out.resolve() in {p.resolve() for p in root.rglob("*") if p.is_file()}:
        raise ExportError(f"{out} is a file of the checkpoint {root}; write the GGUF file elsewhere.")


def _layer_groups(names: list[str]) -> dict[int | None, list[str]]:
    """Checkpoint names by decoder layer (None: embedding, final norm, output)."""
    groups: dict[int | None, list[str]] = defaultdict(list)
    for name in names:
        m = _CHECKPOINT_LAYER.match(name)
        groups[int(m.group(1)) if m else None].append(name)
    return groups


def _gguf_layout_names(
    config: ModelConfig, arch: str, checkpoint: SafetensorsCheckpoint, root: Path
) -> dict[str, tuple[int, ...]]:
    """The GGUF tensor names and shapes the checkpoint becomes, found with meta tensors (nothing is
    read), after checking that the checkpoint's tensors fit its config."""
    with torch.device("meta"):
        tensors, sources = canonical_tensors(
            config.model_type,
            config,
            checkpoint.names(),
            lambda name: torch.empty(checkpoint.shape(name), dtype=checkpoint.dtype(name)),
        )
        check_model_tensors(config, tensors, sources, where=str(root))
        return {
            name: tuple(part.shape)
            for canonical, tensor in tensors.items()
            for name, part in gguf_layout(arch, canonical, tensor, config)
        }


# ---------------------------------------------------------------- metadata


def model_metadata(config: ModelConfig, arch: str, name: str, spec: QuantizeSpec) -> dict[str, object]:
    """The `general.*` and `{arch}.*` keys llama.cpp reads for this model (convert_hf_to_gguf.py's
    TextModel.set_gguf_parameters and each model class's additions)."""
    attention, moe, rope = config.attention, config.moe, config.attention.rope
    facts = family(config.model_type).GGUF  # the arch's, with this family's gating
    expert_ff = moe.intermediate
    # llama and olmoe read the experts' size from feed_forward_length; the others their dense MLPs'
    shared_width = facts.experts_width_key == "feed_forward_length"
    dense_ff = expert_ff if shared_width else (config.dense_intermediate or expert_ff)
    keys: dict[str, object] = {
        "block_count": config.num_layers,
        "context_length": config.max_positions,
        "embedding_length": config.hidden,
        "feed_forward_length": dense_ff,
        "attention.head_count": attention.heads,
        "attention.head_count_kv": attention.kv_heads,
        "attention.key_length": attention.head_dim,
        "attention.value_length": attention.head_dim,
        "attention.layer_norm_rms_epsilon": float(config.norm_eps),
        "rope.freq_base": float(rope.theta),
        "expert_count": moe.num_experts,
        "expert_used_count": moe.top_k,
    }
    if rope.kind not in ("default", "linear", "yarn"):
        raise ExportError(f"RoPE scaling {rope.kind!r} has no GGUF form moerun writes (linear and yarn do).")
    if rope.kind != "default":
        keys["rope.scaling.type"] = rope.kind
        keys["rope.scaling.factor"] = float(rope.factor)
    if rope.kind == "yarn":
        keys["rope.scaling.original_context_length"] = rope.original_max_positions or config.max_positions
        keys["rope.scaling.yarn_beta_fast"] = float(rope.beta_fast)
        keys["rope.scaling.yarn_beta_slow"] = float(rope.beta_slow)
    if facts.explicit_vocab_and_rope_dims:
        keys["vocab_size"] = config.vocab_size
        keys["rope.dimension_count"] = attention.head_dim
    if not shared_width:
        keys[facts.experts_width_key] = expert_ff
    if facts.shared_expert:
        keys["expert_shared_feed_forward_length"] = moe.shared_intermediate
    if facts.clamp_kqv and attention.clip_qkv is not None:
        keys["attention.clamp_kqv"] = float(attention.clip_qkv)  # moerun's addition; the converter drops it
    if facts.swa_period is not None:
        keys["attention.sliding_window"] = next((w for w in config.sliding_windows if w), 0)
    if facts.partial_rotary:  # Glm4MoeModel: int(head_dim * partial_rotary_factor)
        keys["rope.dimension_count"] = rope.rotary_dims or attention.head_dim
    if facts.deepseek_moe_keys:
        keys.update(_deepseek_moe_keys(config, facts))
    if facts.mla:
        keys.update(_mla_keys(config))
    return {
        "general.architecture": arch,
        "general.name": name,
        "general.file_type": FILE_TYPES[spec.experts],
        "general.quantization_version": QUANTIZATION_VERSION,
        **{f"{arch}.{key}": value for key, value in keys.items()},
    }


def _deepseek_moe_keys(config: ModelConfig, facts: GGUFFacts) -> dict[str, object]:
    """leading_dense_block_count, expert_shared_count and the routing's keys, as Glm4MoeModel writes
    them, the gating the family routes by (what these keys cannot say the read-back comparison
    refuses); for deepseek2 as DeepseekV2Model and TextModel write them: expert_weights_norm only where
    true, no nextn_predict_layers, the expert groups where the routing has them."""
    moe, routing = config.moe, config.moe.routing
    gating = facts.scoring or facts.default_gating
    keys = {
        "leading_dense_block_count": next(
            (i for i, m in enumerate(config.moe_layers) if m), config.num_layers
        ),
        "expert_shared_count": moe.shared_intermediate // moe.intermediate,
        "expert_gating_func": {"softmax": 1, "sigmoid": 2}[gating],  # llama_expert_gating_func_type
        "expert_weights_scale": float(routing.routed_scaling),
        "expert_weights_norm": bool(getattr(routing, "renormalize", False)),
        "nextn_predict_layers": 0,  # moerun loads no multi-token-prediction layers to write
    }
    if facts.mla:
        del keys["nextn_predict_layers"]
        if not keys["expert_weights_norm"]:
            del keys["expert_weights_norm"]
    if facts.expert_groups and getattr(routing, "group_limited", True):  # DeepSeek-V3 always has them
        keys["expert_group_count"] = routing.n_group
        keys["expert_group_used_count"] = routing.topk_group
    return keys


def _mla_keys(config: ModelConfig) -> dict[str, object]:
    """DeepseekV2Model's attention keys: MLA as MQA over the latent (head_count_kv 1; key_length and
    value_length the latent's), each head's q/k and v widths as key_length_mla / value_length_mla,
    YaRN's mscale_all_dim times 0.1 as rope.scaling.yarn_log_multiplier."""
    attention = config.attention
    rope_dims, kv_lora = attention.qk_rope_head_dim, attention.kv_lora_rank
    keys: dict[str, object] = {
        "attention.head_count_kv": 1,
        "attention.kv_lora_rank": kv_lora,
        "attention.key_length": kv_lora + rope_dims,
        "attention.value_length": kv_lora,
        "attention.key_length_mla": attention.qk_nope_head_dim + rope_dims,
        "attention.value_length_mla": attention.v_head_dim,
    }
    if attention.q_lora_rank is not None:
        keys["attention.q_lora_rank"] = attention.q_lora_rank
    if attention.rope.mscale_all_dim is not None:
        keys["rope.scaling.yarn_log_multiplier"] = 0.1 * attention.rope.mscale_all_dim
    return keys


@dataclass
class _PlannedFile:
    """What `gguf_model_config` reads of a GGUF file, before the file exists."""

    path: Path
    metadata: dict
    shapes: dict[str, tuple[int, ...]]

    def tensor_names(self) -> list[str]:
        return list(self.shapes)

    def info(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(shape=self.shapes[name])


def _check_same_model(
    config: ModelConfig, arch: str, metadata: dict, shapes: dict[str, tuple[int, ...]], root: Path
) -> None:
    """Refuse a model that the file would describe differently, as moerun and llama.cpp read it."""
    dense = [i for i, moe in enumerate(config.moe_layers) if not moe]
    leading = gguf_facts(arch).deepseek_moe_keys and dense == list(range(len(dense)))  # first k dense
    if dense and not leading:
        raise ExportError(
            f"{root}: layers {dense} have a dense MLP, but llama.cpp's {arch} has experts in every layer."
        )
    try:
        read_back = gguf_model_config(_PlannedFile(root, metadata, shapes))
    except CheckpointError as err:
        raise ExportError(f"{root}: the GGUF file would not load: {err}") from None
    differences = _differences(config, read_back)
    if differences:
        raise ExportError(
            f"{root}: a {arch} GGUF file cannot hold this {config.model_type} model as it is: "
            f"{'; '.join(differences)} (llama.cpp's {arch} fixes these)."
        )


def _differences(ours, theirs, path: str = "") -> list[str]:
    if dataclasses.is_dataclass(ours) and type(ours) is type(theirs):
        found = []
        for field in dataclasses.fields(ours):
            if not path and field.name in _NOT_COMPARED:
                continue
            where = f"{path}.{field.name}" if path else field.name
            found += _differences(getattr(ours, field.name), getattr(theirs, field.name), where)
        return found
    return [] if ours == theirs else [f"{path} is {ours!r} here but would be {theirs!r}"]


def _vocab(root: Path, vocab_size: int, log: Callable[[str], None]) -> dict[str, object]:
    if not (root / "tokenizer.json").is_file():
        log(f"{root} has no tokenizer.json: the GGUF file gets no tokenizer (no tokenizer.* keys).")
        return {}
    try:
        return vocab_metadata(root, vocab_size)
    except VocabError as err:
        log(f"{root}/tokenizer.json cannot be a GGUF vocabulary: {err} The file gets no tokenizer.")
        return {}


# ---------------------------------------------------------------- tensors


def gguf_layout(arch: str, canonical: str, tensor: Tensor, config: ModelConfig) -> list[tuple[str, Tensor]]:
    """One canonical tensor -> its GGUF tensor(s), named and laid out as llama.cpp's converter does."""
    top, layer_table, gate_up = gguf_name_tables(arch)
    top_names = {c: g for g, c in top.items()}
    if canonical in top_names:
        return [(top_names[canonical], tensor)]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", canonical)
    if m is None:
        raise ExportError(f"{canonical}: no GGUF name for this tensor.")
    prefix, rel = f"blk.{m.group(1)}.", m.group(2)
    if rel in gate_up:
        interleaved = gguf_facts(arch).interleaved_gate_up and rel.startswith("moe.experts")
        dim = -1 if rel.endswith("_bias") else -2
        parts = _split_gate_up(tensor, dim, interleaved)
        return [(prefix + name, part) for name, part in zip(gate_up[rel], parts, strict=True)]
    if rel == "attn.kv_b.weight" and gguf_facts(arch).mla:
        k_b, v_b = _split_kv_b(tensor, config)
        return [(prefix + "attn_k_b.weight", k_b), (prefix + "attn_v_b.weight", v_b)]
    names = {c: g for g, c in layer_table.items()}
    if rel not in names:
        raise ExportError(f"{canonical}: no GGUF name for this tensor in a {arch} file.")
    if rel == "moe.shared.gate":
        tensor = tensor.reshape(-1)  # llama.cpp's shape: [H]
    if gguf_facts(arch).permuted_qk and rel.startswith(("attn.q.", "attn.k.")):
        attention = config.attention
        tensor = llama_permute(tensor, attention.heads if rel.startswith("attn.q.") else attention.kv_heads)
    return [(prefix + names[rel], tensor)]


def _split_gate_up(t: Tensor, dim: int, interleaved: bool) -> tuple[Tensor, Tensor]:
    """[.., 2I, in] (or biases [.., 2I]) -> gate and up: the two halves, or (interleaved) even and
    odd rows. Quantised tensors are split by whole rows of bytes."""
    if isinstance(t, QTensor):
        gate, up = _split_gate_up(t.data, -2, interleaved)
        shape = (*t.shape[:-2], t.shape[-2] // 2, t.shape[-1])
        return QTensor(t.format, shape, gate.contiguous()), QTensor(t.format, shape, up.contiguous())
    if interleaved:
        return t.unflatten(dim, (-1, 2)).unbind(dim)
    return t.chunk(2, dim=dim)


def _split_kv_b(kv_b: Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b [heads * (nope + v), kv_lora_rank] -> k_b [heads, kv_lora_rank, nope] (each head's key
    rows, transposed) and v_b [heads, v, kv_lora_rank], as DeepseekV2Model.modify_tensors splits it."""
    attention = config.attention
    if isinstance(kv_b, QTensor):
        kv_b = dequantize(kv_b)
    nope, v = attention.qk_nope_head_dim, attention.v_head_dim
    k_b, v_b = kv_b.reshape(attention.heads, nope + v, kv_b.shape[-1]).split([nope, v], dim=1)
    return k_b.transpose(1, 2).contiguous(), v_b.contiguous()


def llama_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows in ggml's interleaved RoPE order."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
