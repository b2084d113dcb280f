"""Checkpoint files: the loader is the only code in moerun that opens them. Safetensors files and
sharded directories (`safetensors_file`), GGUF files (`gguf_file`), both memory-mapped copy-on-write
and parsed here without the `safetensors` or `gguf` packages; where a checkpoint is (`paths`: a local
path or a hub id already in the Hugging Face cache, never downloaded); byte ranges of the files read
into buffers (`reads`, for the expert store); and `CheckpointError`."""

from moerun.errors import CheckpointError
from moerun.loader.gguf_file import GGUFFile, GGUFTensorInfo
from moerun.loader.hf_config import read_hf_config
from moerun.loader.paths import hub_cache_dir, resolve_checkpoint
from moerun.loader.safetensors_file import SafetensorsCheckpoint, SafetensorsFile

__all__ = [
    "CheckpointError",
    "GGUFFile",
    "GGUFTensorInfo",
    "SafetensorsCheckpoint",
    "SafetensorsFile",
    "hub_cache_dir",
    "read_hf_config",
    "resolve_checkpoint",
]
