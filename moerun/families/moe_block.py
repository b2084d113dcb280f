"""Moving tensors between transformers' MoE block names and moerun's canonical names, driven by
each family's `MOE_NAMES` table (data, not code)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moerun.activations import GLU
from moerun.errors import ConfigError, TensorError
from moerun.families import family
from moerun.moe.layer import MoELayer, MoESpec, check_tensors, layer_run
from moerun.moe.routing import SoftmaxTopK


def first(config: Mapping, *keys: str):
    """The value of the first of `keys` present in a config dict (checkpoints spell some differently)."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    raise ConfigError(f"none of {', '.join(keys)} is set.")


def hf_glu(config: Mapping) -> GLU:
    """The GLU of a config's `hidden_act` (transformers' default: silu)."""
    return GLU.from_hf(config.get("hidden_act", "silu"))


def norm_topk_routing(config: Mapping) -> SoftmaxTopK:
    """Qwen/OLMoE routing: softmax -> top-k, renormalised when `norm_topk_prob` (default off)."""
    return SoftmaxTopK(k=config["num_experts_per_tok"], renormalize=bool(config.get("norm_topk_prob", False)))


def fused_expert_names(router: str) -> dict[str, str]:
    """transformers' fused 3-D expert tensors ([E, 2I, H] gate|up, [E, H, I] down) and router weight."""
    return {
        "router.weight": f"{router}.weight",
        "experts.gate_up": "experts.gate_up_proj",
        "experts.down": "experts.down_proj",
    }


def shared_mlp_names(prefix: str) -> dict[str, str | tuple[str, ...]]:
    return {
        "shared.gate_up": (f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"),
        "shared.down": f"{prefix}.down_proj.weight",
    }


def sanitize(
    model_type: str, block_tensors: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict]:
    """transformers' block state dict -> (canonical tensors, canonical name -> source name)."""
    fam = family(model_type)
    transposed = getattr(fam, "TRANSPOSED", frozenset())
    tensors, sources = {}, {}
    for canonical, source in fam.MOE_NAMES.items():
        parts = source if isinstance(source, tuple) else (source,)
        sources[canonical] = " + ".join(parts)
        if not all(p in block_tensors for p in parts):
            continue
        loaded = [block_tensors[p].transpose(-1, -2) if p in transposed else block_tensors[p] for p in parts]
        kinds = {(len(t.shape), tuple(t.shape[:-2]), tuple(t.shape[-1:]), t.dtype) for t in loaded}
        if len(loaded) > 1 and (len(kinds) > 1 or len(loaded[0].shape) < 2):
            shapes = ", ".join(f"{p} {list(t.shape)} {t.dtype}" for p, t in zip(parts, loaded, strict=True))
            raise TensorError(f"tensors {shapes} must differ only in rows to be joined.")
        tensors[canonical] = loaded[0] if len(loaded) == 1 else torch.cat(loaded, dim=-2)
    return tensors, sources


def export(model_type: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical tensors -> transformers' block names (views where the layout allows; for peers)."""
    fam = family(model_type)
    transposed = getattr(fam, "TRANSPOSED", frozenset())
    out = {}
    for canonical, source in fam.MOE_NAMES.items():
        if canonical not in tensors:
            continue
        parts = source if isinstance(source, tuple) else (source,)
        tensor = tensors[canonical]
        pieces = tensor.chunk(len(parts), dim=-2) if len(parts) > 1 else (tensor,)
        for name, piece in zip(parts, pieces, strict=True):
            out[name] = piece.transpose(-1, -2) if name in transposed else piece
    return out


def layer_from_transformers(
    model_type: str,
    config: Mapping,
    block_state: Mapping[str, torch.Tensor],
    name: str = "moe",
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    backend: str = "torch",
) -> MoELayer:
    """A moerun layer from a transformers MoE block's config dict and state dict."""
    spec: MoESpec = family(model_type).moe_spec(dict(config))
    tensors, sources = sanitize(model_type, block_state)
    known = set(sources.values()) | {
        p for s in family(model_type).MOE_NAMES.values() if isinstance(s, tuple) for p in s
    }
    extra = {k: v for k, v in block_state.items() if k not in known}
    check_tensors(spec, {**tensors, **extra}, name, sources)
    return MoELayer.from_tensors(spec, tensors, name=name, run=layer_run(tensors, dtype, device, backend))
