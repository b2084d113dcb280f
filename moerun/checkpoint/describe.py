"""`moerun inspect`: what a checkpoint holds, read from its header and config without loading a
weight: architecture, layers, experts, top-k, the format of each kind of tensor, bytes per expert,
the memory a run needs, and whether it has a tokenizer and a chat template (where moerun looks for
them: `Tokenizer.from_hf_dir` and `from_gguf_metadata`)."""

from __future__ import annotations

import math
import os
import re
from collections import Counter, defaultdict
from pathlib import Path

import torch

from moerun.decoder.config import MLASpec, ModelConfig
from moerun.errors import CheckpointError
from moerun.loader import GGUFFile, SafetensorsCheckpoint, resolve_checkpoint
from moerun.loader.json_file import read_json
from moerun.quant.formats import FLOAT_DTYPES

_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)")
# HF (experts.*), GGUF merged (ffn_*_exps) and GGUF's old per-expert layout (ffn_gate.E.weight)
_EXPERT_TENSOR = re.compile(r"experts|_exps|ffn_(gate|up|down)\.\d+\.")
_DTYPE_NAMES = {dtype: name for name, dtype in FLOAT_DTYPES.items()} | {torch.uint8: "u8"}


Rows = list[tuple[str, str, tuple[int, ...], int]]  # (name, format, shape, bytes) per tensor

# llama.cpp's names of a GGUF file's `general.file_type` (its llama_ftype, as `llama-quantize` lists
# them), for the line a user compares with the file name they downloaded.
GGUF_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
    18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S",
    25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M",
    32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE", 39: "NVFP4", 40: "Q1_0",
}  # fmt: skip


def _tensor_table(path: Path) -> tuple[str, ModelConfig, Rows, dict[str, str | None]]:
    """(file kind, config, rows, what `_gguf_text` or `_hf_text` says of its tokenizer)."""
    if path.is_file() and path.suffix == ".gguf":
        from moerun.checkpoint.gguf import gguf_model_config

        gguf = GGUFFile(path)
        rows = []
        for name in gguf.tensor_names():
            info = gguf.info(name)
            rows.append((name, info.type_name.lower(), info.shape, info.nbytes or 0))
        return "gguf", gguf_model_config(gguf), rows, _gguf_text(gguf.metadata)
    from moerun.checkpoint.load import hf_model_config, hf_paths

    directory, weights = hf_paths(path)
    config = hf_model_config(directory)
    checkpoint = SafetensorsCheckpoint(weights)
    rows = []
    for name in checkpoint.names():
        dtype, shape = checkpoint.dtype(name), checkpoint.shape(name)
        fmt = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
        if name.endswith(("_blocks", "_scales")):
            fmt = "mxfp4 (gpt-oss)"
        rows.append((name, fmt, shape, math.prod(shape) * dtype.itemsize))
    return "safetensors", config, rows, _hf_text(directory)


def _gguf_file_type(metadata: dict) -> str | None:
    """The file's `general.file_type` by llama.cpp's name (None where absent)."""
    ftype = metadata.get("general.file_type")
    if not isinstance(ftype, int) or isinstance(ftype, bool):
        return None
    return GGUF_FILE_TYPES.get(ftype, f"unknown ({ftype})")


def _gguf_text(metadata: dict) -> dict[str, str | None]:
    """Where a GGUF file's tokenizer and chat template are: its tokenizer.ggml.* and
    tokenizer.chat_template keys (None: absent)."""
    model, tokens = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.tokens")
    size = f", {len(tokens)} tokens" if isinstance(tokens, list) else ""
    template = metadata.get("tokenizer.chat_template")
    return {
        "tokenizer": f"tokenizer.ggml.* ({model}{size})" if isinstance(model, str) else None,
        "chat_template": "tokenizer.chat_template" if isinstance(template, str) and template else None,
        "tokenizer_note": None,
        "file_type": _gguf_file_type(metadata),
    }


def _hf_text(directory: Path) -> dict[str, str | None]:
    """Where a checkpoint directory's tokenizer and chat template are, as `Tokenizer.from_hf_dir`
    reads them: tokenizer.json; chat_template.jinja, else tokenizer_config.json's chat_template (a
    string, or named templates with a "default"). A problem found on the way is the "tokenizer_note"."""
    found: dict[str, str | None] = {"tokenizer": None, "chat_template": None, "tokenizer_note": None}
    found["file_type"] = None
    if (directory / "tokenizer.json").is_file():
        found["tokenizer"] = "tokenizer.json"
    elif (directory / "tokenizer.model").is_file():
        found["tokenizer_note"] = "tokenizer.model alone: moerun reads tokenizer.json"
    if (directory / "chat_template.jinja").is_file():
        found["chat_template"] = "chat_template.jinja"
        return found
    config_path = directory / "tokenizer_config.json"
    try:
        config = read_json(config_path) if config_path.is_file() else {}
    except CheckpointError as err:
        found["tokenizer_note"] = str(err)
        return found
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next(
            (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
        )
    if isinstance(template, str) and template:
        found["chat_template"] = "tokenizer_config.json"
    return found


def describe(path: str | os.PathLike) -> dict:
    """A JSON-ready summary of the checkpoint at `path`."""
    root = resolve_checkpoint(path)
    kind, config, rows, text = _tensor_table(root)
    groups: dict[str, Counter] = defaultdict(Counter)
    group_bytes: Counter = Counter()
    for name, fmt, _, nbytes in rows:
        pattern = _NUMBER.sub("*", name)
        groups[pattern][fmt] += 1
        group_bytes[pattern] += nbytes
    expert_bytes = sum(nbytes for name, _, _, nbytes in rows if _EXPERT_TENSOR.search(name))
    total = sum(nbytes for *_, nbytes in rows)
    weights = sum(math.prod(shape) for _, _, shape, _ in rows)
    moe_layers = sum(config.moe_layers)
    experts = moe_layers * config.moe.num_experts
    attn = config.attention
    # bf16 keys + values (MLA: the latent and the rotary key)
    kv_bytes_per_token = config.num_layers * 2 * sum(h * d for h, d in attn.cache_dims())
    return {
        "path": str(root),
        "file_format": kind,
        "architecture": config.model_type,
        "layers": config.num_layers,
        "moe_layers": moe_layers,
        "hidden": config.hidden,
        "vocab": config.vocab_size,
        "context": config.max_positions,
        "attention": (
            f"MLA, {attn.heads} heads, latent {attn.kv_lora_rank} + rotary key {attn.qk_rope_head_dim}"
            if isinstance(attn, MLASpec)
            else f"{attn.heads} heads, {attn.kv_heads} kv heads, head_dim {attn.head_dim}"
        ),
        "experts_per_layer": config.moe.num_experts,
        "top_k": config.moe.top_k,
        **text,  # tokenizer, chat_template: where each is (or None); tokenizer_note: a problem found
        "expert_intermediate": config.moe.intermediate,
        "tensors": {p: dict(formats) for p, formats in sorted(groups.items())},
        "tensor_bytes": dict(sorted(group_bytes.items())),
        "bytes_per_expert": expert_bytes // experts if experts else 0,
        "expert_bytes": expert_bytes,
        "other_bytes": total - expert_bytes,
        "weights_bytes": total,
        # as llama.cpp's "BPW": every tensor's bytes over every tensor's elements
        "bits_per_weight": round(8 * total / weights, 4) if weights else 0.0,
        "kv_cache_bytes_per_token_bf16": kv_bytes_per_token,
        "bytes_read_per_token": total
        - expert_bytes
        + (expert_bytes // experts * moe_layers * config.moe.top_k)
        if experts
        else total,
    }


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _text_line(d: dict) -> str:
    tokenizer = f"tokenizer in {d['tokenizer']}" if d["tokenizer"] else "no tokenizer (token ids only)"
    template = f"chat template in {d['chat_template']}" if d["chat_template"] else "no chat template"
    note = f" ({d['tokenizer_note']})" if d["tokenizer_note"] else ""
    return f"{tokenizer}; {template}{note}"


def format_description(d: dict) -> str:
    file_type = f", {d['file_type']}" if d["file_type"] else ""
    lines = [
        f"{d['path']} ({d['file_format']}{file_type}, {d['bits_per_weight']:.2f} bits per weight)",
        f"architecture  {d['architecture']}: {d['layers']} layers ({d['moe_layers']} MoE), "
        f"hidden {d['hidden']}, vocab {d['vocab']}, context {d['context']}",
        f"attention     {d['attention']}",
        f"experts       {d['experts_per_layer']} per MoE layer, top-{d['top_k']}, "
        f"intermediate {d['expert_intermediate']}, {_size(d['bytes_per_expert'])} per expert",
        f"memory        weights {_size(d['weights_bytes'])} (experts {_size(d['expert_bytes'])}, "
        f"rest {_size(d['other_bytes'])}); KV cache {_size(d['kv_cache_bytes_per_token_bf16'] * 1024)} "
        f"per 1024 tokens (bf16); weights read per decoded token {_size(d['bytes_read_per_token'])}",
        f"text          {_text_line(d)}",
        "tensors:",
    ]
    width = max(len(p) for p in d["tensors"]) if d["tensors"] else 0
    for pattern, formats in d["tensors"].items():
        kinds = ", ".join(f"{fmt} x{n}" for fmt, n in formats.items())
        lines.append(f"  {pattern:<{width}}  {kinds:<24} {_size(d['tensor_bytes'][pattern])}")
    return "\n".join(lines)
