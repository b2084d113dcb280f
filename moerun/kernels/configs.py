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
needs the entries that differ. `default.json` must hold a "<kernel>" entry for every kernel.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).with_name("launch_configs")
KERNELS = ("prefill_gate_up", "prefill_down", "decode_gate_up", "decode_down")


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


def plan_block_m(gpu: str | None, config_dir: Path = CONFIG_DIR) -> int:
    """Rows per block of the prefill plan: the "prefill_gate_up" entry's BLOCK_M (one for every
    format and shape, as one plan serves both grouped GEMMs of a layer)."""
    return launch_config("prefill_gate_up", "", 0, 0, gpu, config_dir)["BLOCK_M"]
