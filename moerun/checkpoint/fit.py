"""How much memory a checkpoint takes as the model will hold it, read from its headers (nothing else
is read), and the placement chosen from that and the memory the process may use: all resident, or
the experts streamed through a cache of what is left (the rule: moerun.offload.budget; the memory:
moerun.offload.memory)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from moerun.decoder.config import ModelConfig
from moerun.loader import GGUFFile, SafetensorsCheckpoint
from moerun.loader.reads import IO_THREADS, READ_CHUNK_BYTES
from moerun.moe.run import DEFAULT_PREFILL_CHUNK
from moerun.offload.budget import KV_RESERVE_TOKENS, MARGIN_BYTES, Fit, auto_budget
from moerun.offload.memory import memory_room
from moerun.offload.store import READERS
from moerun.quant.formats import QTensor

if TYPE_CHECKING:
    from moerun.checkpoint.load import _Opened


def choose_fit(
    opened: _Opened, device: torch.device, dtype: torch.dtype, native_linears: bool, memory_gb: float | None
) -> Fit | None:
    """The placement of `opened`'s model on `device` within `memory_gb` (an overall budget for the
    process), else within what the system allows; None where nothing says how much that is.
    `native_linears`: the backend computes with quantised dense weights as stored."""
    room = memory_room(device, memory_gb)
    if room is None:
        return None
    if opened.gguf is not None:
        dense, experts = gguf_bytes(opened.gguf, dtype, native_linears and device.type == "cpu")
    else:
        dense, experts = hf_bytes(opened.hf, dtype)
    config = opened.config
    return auto_budget(
        room.bytes,
        dense,
        experts,
        kv_reserve_bytes(config, dtype),
        workspace_bytes(config),
        floor=MARGIN_BYTES if device.type == "cuda" else 0,
        source=room.source,
        held=room.held,
        kv_tokens=min(KV_RESERVE_TOKENS, config.max_positions),
    )


def hf_bytes(checkpoint: SafetensorsCheckpoint, dtype: torch.dtype) -> tuple[int, int]:
    """(dense, expert) bytes the model holds on its device, from the file's header: floating tensors
    in `dtype`, the others (MXFP4 blocks) as stored."""
    sizes = [0, 0]
    for name in checkpoint.names():
        stored = checkpoint.dtype(name)
        size = dtype.itemsize if stored.is_floating_point else stored.itemsize
        sizes[".experts." in name] += math.prod(checkpoint.shape(name)) * size
    return sizes[0], sizes[1]


def gguf_bytes(gguf: GGUFFile, dtype: torch.dtype, quantised_dense: bool = False) -> tuple[int, int]:
    """(dense, expert) bytes the model holds on its device: quantised experts as stored, every other
    tensor dense in `dtype`, except (`quantised_dense`: the native CPU kernels) quantised matrices,
    kept as stored (views of the file are made; nothing is read)."""
    sizes = [0, 0]
    for name in gguf.tensor_names():
        t, expert = gguf.tensor(name), "_exps." in name
        as_stored = isinstance(t, QTensor) and (expert or (quantised_dense and len(t.shape) == 2))
        sizes[expert] += t.nbytes if as_stored else math.prod(t.shape) * dtype.itemsize
    return sizes[0], sizes[1]


def kv_reserve_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """A KV cache of KV_RESERVE_TOKENS positions (the model's context if shorter), every layer."""
    tokens = min(KV_RESERVE_TOKENS, config.max_positions)
    (kh, kd), (vh, vd) = config.attention.cache_dims()
    return config.num_layers * tokens * (kh * kd + vh * vd) * dtype.itemsize


def workspace_bytes(config: ModelConfig) -> int:
    """Working memory of a forward pass beyond the weights and the KV cache, at most: one prefill
    chunk's fp32 activations (its logits, its attention scores over a KV_RESERVE_TOKENS context,
    hidden states, each token's experts' rows) and the expert readers' aligned buffers."""
    moe, heads = config.moe, config.attention.heads
    context = min(KV_RESERVE_TOKENS, config.max_positions)
    ffn = max(config.dense_intermediate, moe.shared_intermediate)
    per_token = (
        config.vocab_size
        + heads * context
        + 16 * config.hidden
        + 2 * moe.top_k * (2 * moe.intermediate + moe.hidden)
        + 3 * ffn
    )
    chunk = min(DEFAULT_PREFILL_CHUNK, config.max_positions)
    return 4 * per_token * chunk + (READERS + IO_THREADS + 1) * READ_CHUNK_BYTES
