"""`moerun.load`: a checkpoint directory, file or locally cached hub id -> a runnable `MoEModel`.

Files are opened only through `moerun.loader`; family files map configs and names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from moerun.loader import CheckpointError, GGUFFile, SafetensorsCheckpoint, resolve_checkpoint
from moerun.model.config import ModelConfig
from moerun.model.transformer import MoEModel
from moerun.models import family
from moerun.models.hf_checkpoint import canonical_tensors
from moerun.quant.cache import DequantCache


def read_hf_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json, so this is not a Hugging Face checkpoint.")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err}).") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{path}: has no 'model_type', so moerun cannot tell the architecture.")
    return config


def _hf_model(root: Path) -> tuple[ModelConfig, dict]:
    directory = root if root.is_dir() else root.parent
    config = read_hf_config(directory)
    model_type = config["model_type"]
    try:
        fam = family(model_type)
    except ValueError as err:
        raise CheckpointError(f"{directory / 'config.json'}: {err}") from None
    if not hasattr(fam, "model_config"):
        raise CheckpointError(f"{directory}: loading whole {model_type} models is not supported yet.")
    model_config = fam.model_config(config)
    checkpoint = SafetensorsCheckpoint(root)
    tensors, _ = canonical_tensors(model_type, model_config, checkpoint.names(), checkpoint.tensor)
    return model_config, tensors


def load(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
    expert_cache_gb: float | None = None,
    prefetch_k: int | None = None,
    dequant_cache_gb: float = 0.0,
) -> MoEModel:
    """Open a checkpoint: a Hugging Face safetensors directory (or a hub id found in the local
    cache) or a GGUF file.

    `expert_cache_gb` and `prefetch_k` belong to expert streaming and are not used yet."""
    root = resolve_checkpoint(path)
    if backend == "auto":
        backend = "torch"
    if root.is_file() and root.suffix == ".gguf":
        from moerun.models.gguf_checkpoint import gguf_model

        model_config, tensors = gguf_model(GGUFFile(root))
    else:
        model_config, tensors = _hf_model(root)
    cache = DequantCache(int(dequant_cache_gb * 2**30)) if dequant_cache_gb else None
    return MoEModel(model_config, tensors, dtype=dtype, device=device, backend=backend, dequant_cache=cache)
