"""The bytes of weights one decode token reads: the dense part (attention, norms, routers, shared
experts, dense MLPs), top_k experts of each MoE layer, the lm_head, and one row of the embedding.

Two counts of the same weights: as a loaded `MoEModel` holds them (what moerun reads; a QTensor
counts its format's row bytes, a torch tensor its elements times their size) and as a GGUF file
stores them (what llama.cpp reads from the same file). They agree when moerun keeps every weight in
the file's format; where it dequantises a tensor they differ, and the report shows both.
"""

from __future__ import annotations

import math

import torch

from moerun.checkpoint.gguf import GGUF_EXPERT_TENSOR, gguf_model_config
from moerun.loader import GGUFFile
from moerun.model import MoEModel
from moerun.quant.formats import QTensor


def tensor_bytes(t: torch.Tensor | QTensor) -> int:
    """Bytes of a weight: a QTensor's rows times its format's row bytes; a tensor's elements times size."""
    if isinstance(t, QTensor):
        return math.prod(t.shape[:-1]) * t.format.row_bytes(t.shape[-1])
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if hasattr(t, "nbytes"):  # a kernel's own weight object
        return int(t.nbytes)
    raise TypeError(f"cannot count the bytes of a {type(t).__name__} weight.")


def model_decode_bytes(model: MoEModel) -> int:
    """Bytes of weights one decode token reads, counted from the tensors `model` holds."""
    config = model.config
    total = tensor_bytes(model.embed) // config.vocab_size + tensor_bytes(model.lm_head)
    total += tensor_bytes(model.norm)
    for i, (attention, mlp) in enumerate(zip(model.attentions, model.mlps, strict=True)):
        total += tensor_bytes(model.attn_norms[i]) + tensor_bytes(model.mlp_norms[i])
        total += sum(tensor_bytes(t) for t in attention.t.values())
        if not config.moe_layers[i]:
            total += tensor_bytes(mlp.gate_up) + tensor_bytes(mlp.down)
            continue
        for name, t in mlp.tensors.items():  # experts [E, ...] (a rank's share with expert parallelism):
            share = (mlp.spec.top_k, t.shape[0]) if name.startswith("experts.") else (1, 1)
            total += tensor_bytes(t) // share[1] * share[0]  # one expert's bytes, k times
    return total


def gguf_decode_bytes(path) -> int:
    """Bytes of weights one decode token reads, counted from the types a GGUF file stores."""
    gguf = GGUFFile(path)
    moe = gguf_model_config(gguf).moe
    total = 0
    for name in gguf.tensor_names():
        info = gguf.info(name)
        if info.nbytes is None:
            raise ValueError(f"{path}: tensor {name} has a type ({info.type_name}) whose size is unknown.")
        if name == "token_embd.weight":
            total += info.nbytes // info.shape[0]  # one row
            if "output.weight" not in gguf:  # tied: the lm_head is the embedding, read whole
                total += info.nbytes
        elif GGUF_EXPERT_TENSOR.fullmatch(name):  # all E experts' bytes (in one tensor or E), k of them read
            total += info.nbytes * moe.top_k // moe.num_experts
        else:
            total += info.nbytes
    return total
