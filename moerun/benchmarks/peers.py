"""transformers' own MoE blocks, built on moerun's weights: the peer that `moerun bench` measures
against and the oracle the tests compare with. transformers is optional here (a test dependency),
so it is imported only when a peer is asked for."""

from __future__ import annotations

import importlib
from collections.abc import Mapping

import torch

# model_type -> (transformers config class, module under transformers.models, block class)
TRANSFORMERS_BLOCKS = {
    "mixtral": ("MixtralConfig", "mixtral.modeling_mixtral", "MixtralSparseMoeBlock"),
    "qwen2_moe": ("Qwen2MoeConfig", "qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock"),
    "qwen3_moe": ("Qwen3MoeConfig", "qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    "olmoe": ("OlmoeConfig", "olmoe.modeling_olmoe", "OlmoeSparseMoeBlock"),
    "gpt_oss": ("GptOssConfig", "gpt_oss.modeling_gpt_oss", "GptOssMLP"),
    "deepseek_v2": ("DeepseekV2Config", "deepseek_v2.modeling_deepseek_v2", "DeepseekV2Moe"),
    "deepseek_v3": ("DeepseekV3Config", "deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE"),
    "phimoe": ("PhimoeConfig", "phimoe.modeling_phimoe", "PhimoeSparseMoeBlock"),
    "granitemoe": ("GraniteMoeConfig", "granitemoe.modeling_granitemoe", "GraniteMoeMoE"),
}


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def transformers_config(model_type: str, config: Mapping, experts_implementation: str = "grouped_mm"):
    """A transformers config object of `model_type` from a config dict.

    `experts_implementation` is transformers' own switch: "grouped_mm" is what its models pick by
    default, "eager" its per-expert loop."""
    import transformers

    config_class = getattr(transformers, TRANSFORMERS_BLOCKS[model_type][0])
    hf_config = config_class(**config)
    hf_config._experts_implementation = experts_implementation
    return hf_config


def transformers_block(model_type: str, hf_config, device: str = "cpu") -> torch.nn.Module:
    """An uninitialised transformers MoE block in eval mode, in fp32 on `device` ("meta": no storage)."""
    _, module_name, class_name = TRANSFORMERS_BLOCKS[model_type]
    module = importlib.import_module(f"transformers.models.{module_name}")
    with torch.device("meta"):
        block = getattr(module, class_name)(hf_config)
    return (block if device == "meta" else block.to_empty(device=device)).eval()


def peer_block(
    model_type: str,
    config: Mapping,
    block_tensors: Mapping[str, torch.Tensor],
    experts_implementation: str = "grouped_mm",
) -> torch.nn.Module:
    """transformers' block whose parameters and buffers are the given tensors (shared, not copied)."""
    hf_config = transformers_config(model_type, config, experts_implementation)
    block = transformers_block(model_type, hf_config, device="meta")
    for name, tensor in block_tensors.items():
        module_name, _, leaf = name.rpartition(".")
        module = block.get_submodule(module_name)
        if leaf in module._buffers:
            module._buffers[leaf] = tensor
        else:
            setattr(module, leaf, torch.nn.Parameter(tensor, requires_grad=False))
    unset = [n for n, t in list(block.named_parameters()) + list(block.named_buffers()) if t.is_meta]
    if unset:
        raise ValueError(f"The {model_type} peer block got no tensor for {unset}.")
    return block


def run_peer(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [T, H] through a transformers block (which takes [B, T, H]) -> [T, H]."""
    with torch.inference_mode():
        out = block(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]
