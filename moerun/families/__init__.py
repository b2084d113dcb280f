"""Model families, one small file each, named after the Hugging Face `model_type`.

Each family module defines `moe_spec(config: dict) -> MoESpec` and `MOE_NAMES`, the map from
moerun's canonical tensor names to the names inside transformers' MoE block (a tuple means the
parts are concatenated along the output dimension; names in `TRANSPOSED` are stored [in, out]).
"""

from __future__ import annotations

import importlib
from types import ModuleType

FAMILIES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
    "phimoe",
    "granitemoe",
)


def family(model_type: str) -> ModuleType:
    if model_type not in FAMILIES:
        raise ValueError(f"Unknown architecture model_type={model_type!r}; moerun knows {list(FAMILIES)}.")
    return importlib.import_module(f"moerun.families.{model_type}")
