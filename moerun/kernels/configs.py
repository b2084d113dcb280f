"""Launch configurations of the Triton kernels, as data.

A config is the block sizes and launch options of one kernel (`BLOCK_M`, `BLOCK_N`, `BLOCK_K`,
`num_warps`, `num_stages`; each kernel reads the keys it has). They live in JSON files in
`moerun/kernels/launch_configs/`: `default.json` for any GPU, `cpu.json` for triton's interpreter, and one
file per GPU model (`torch.cuda.get_device_name()` with every run of non-alphanumerics as `_`, e.g.
`NVIDIA_H200.json`), written by `bench/tune_kernels.py`. A file maps keys to configs:

    "<kernel>|<format>|<n>x<k>"   one shape of one format (n output, k input features)
    "<kernel>|<format>"           any shape of that format
    "<kernel>"                    anything else

The most specific key found wins, in the GPU's file first and then in default.json; a GPU file only
needs the entries that differ. `default.json` must hold a "<kernel>" entry for every kernel, and is
the one source of the defaults the kernels' launchers start from (`default_config`, with a caller's
keys over them: `merge_config`), including the launches not tuned per shape (the combine, the
activation, the row sum, q8_1 quantisation).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).with_name("launch_configs")
KERNELS = ("prefill_gate_up", "prefill_down", "decode_gate_up", "decode_down")  # tuned per shape
# launches with one config whatever the weights (default.json only)
UNTUNED = ("prefill_combine", "decode_activate", "decode_sum", "decode_gemv_q8_1", "decode_quantize_q8_1")
LAUNCHES = KERNELS + UNTUNED


def gpu_file_name(device_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json"


@functools.cache
def _read(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    with open(path) as f:
        table = json.load(f)
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise ValueError(f"{path}: expected a JSON object mapping keys to launch-config objects.")
    return table


def device_name(device: torch.device) -> str:
    """The GPU's name; "cpu" for triton's interpreter on CPU tensors (small blocks: cpu.json)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def launch_config(
    kernel: str, fmt: str, n: int, k: int, gpu: str | None, config_dir: Path = CONFIG_DIR
) -> dict:
    """The config for `kernel` on weights of format `fmt` and shape [n, k] on GPU model `gpu`."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; known: {', '.join(KERNELS)}")
    keys = (f"{kernel}|{fmt}|{n}x{k}", f"{kernel}|{fmt}", kernel)
    tables = [_read(config_dir / gpu_file_name(gpu))] if gpu else []
    tables.append(_read(config_dir / "default.json"))
    for key in keys:
        for table in tables:
            if key in table:
                return dict(table[key])
    raise ValueError(f"{config_dir / 'default.json'} has no entry for kernel {kernel!r}.")


def default_config(launch: str, config_dir: Path = CONFIG_DIR) -> dict:
    """default.json's entry for `launch` (a kernel of KERNELS or an untuned launch such as
    "decode_sum"): the values a launcher takes for the keys its caller does not give."""
    table = _read(config_dir / "default.json")
    if launch not in LAUNCHES or launch not in table:
        raise ValueError(f"{config_dir / 'default.json'} has no entry for {launch!r}.")
    return dict(table[launch])


def merge_config(default: Mapping[str, int], config: Mapping[str, int] | None) -> dict:
    """A launch's config: `default` with the keys of `config` (None: none) overriding it."""
    return {**default, **(config or {})}


def plan_block_m(gpu: str | None, config_dir: Path = CONFIG_DIR) -> int:
    """Rows per block of the prefill plan: the "prefill_gate_up" entry's BLOCK_M (one for every
    format and shape, as one plan serves both grouped GEMMs of a layer)."""
    return launch_config("prefill_gate_up", "", 0, 0, gpu, config_dir)["BLOCK_M"]
