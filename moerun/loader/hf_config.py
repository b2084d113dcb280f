"""A Hugging Face checkpoint's config.json, read and checked."""

from __future__ import annotations

from pathlib import Path

from moerun.errors import CheckpointError, ConfigError, quote
from moerun.loader.json_file import read_json


def read_hf_config(directory: Path) -> dict:
    """config.json of `directory` as a dict with at least a `model_type`."""
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json, so this is not a Hugging Face checkpoint.")
    config = read_json(path, error=ConfigError)
    if not isinstance(config.get("model_type"), str):
        found = f" (it is {quote(config['model_type'])})" if "model_type" in config else ""
        raise ConfigError(
            f"{path}: has no 'model_type' string{found}, so moerun cannot tell the architecture."
        )
    return config
