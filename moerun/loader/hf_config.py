"""A Hugging Face checkpoint's config.json, read and checked."""

from __future__ import annotations

import json
from pathlib import Path

from moerun.loader.errors import CheckpointError


def read_hf_config(directory: Path) -> dict:
    """config.json of `directory` as a dict with at least a `model_type`."""
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
