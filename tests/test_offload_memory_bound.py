"""A model larger than its memory budget runs within it: a generated checkpoint of ~650 MB under an
overall budget (`memory_gb`) that leaves a third of its experts room streams them, generates, and
the process's peak RSS (VmHWM, /proc/self/status: anonymous and mapped file pages) stays within the
budget; the expert reads go around the page cache, so the file is not left cached either (mincore).
Holding the experts resident would take ~250 MB more than the budget, so the bound can tell."""

import ctypes
import json
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

H, I, E, LAYERS, VOCAB, CONTEXT = 1024, 768, 16, 8, 1024, 512

RUN = r"""
import json, sys, torch, moerun
from moerun.checkpoint.fit import hf_bytes, kv_reserve_bytes, workspace_bytes
from moerun.checkpoint.load import hf_model_config
from moerun.loader import SafetensorsCheckpoint
from moerun.offload.budget import auto_budget
from moerun.offload.memory import resident_bytes

from pathlib import Path
path, share = Path(sys.argv[1]), float(sys.argv[2])
config = hf_model_config(path)
dense, experts = hf_bytes(SafetensorsCheckpoint(path), torch.bfloat16)
kv = kv_reserve_bytes(config, torch.bfloat16)
rule = auto_budget(0, dense, experts, kv, workspace_bytes(config), floor=0)
memory_gb = (resident_bytes() + rule.minimum_free(int(share * experts))) / 2**30
model = moerun.load(path, dtype=torch.bfloat16, memory_gb=memory_gb)
ids = [t.id for t in model.generate(list(range(1, 40)), max_new_tokens=24)]
peak = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
cache = model.expert_cache
print(json.dumps(dict(
    memory=int(memory_gb * 2**30), peak=peak, new=len(ids), cache=cache.nbytes, experts=experts,
    dense=dense, reads=cache.store.read_counts(), misses=cache.stats.misses,
)))
"""


def _write(directory) -> int:
    """A random OLMoE checkpoint (bf16, fused expert names); returns the file's size."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(shape, generator=gen) * 0.02).bfloat16()

    tensors = {"model.embed_tokens.weight": rand(VOCAB, H), "lm_head.weight": rand(VOCAB, H)}
    tensors["model.norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for proj in "qkvo":
            tensors[p + f"self_attn.{proj}_proj.weight"] = rand(H, H)
        for norm in ("self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm"):
            tensors[p + norm + ".weight"] = torch.ones(H, dtype=torch.bfloat16)
        tensors[p + "mlp.gate.weight"] = rand(E, H)
        tensors[p + "mlp.experts.gate_up_proj"] = rand(E, 2 * I, H)
        tensors[p + "mlp.experts.down_proj"] = rand(E, H, I)
    path = directory / "model.safetensors"
    save_file(tensors, path)
    config = dict(
        model_type="olmoe",
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_experts=E,
        num_experts_per_tok=2,
        max_position_embeddings=CONTEXT,
    )
    (directory / "config.json").write_text(json.dumps(config))
    return path.stat().st_size


def _cached_pages(path) -> int:
    """Pages of `path` in the page cache (mincore over a fresh map of the file)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        pages = -(-len(mapped) // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(np.frombuffer(mapped, np.uint8).ctypes.data, len(mapped), vec) == 0
        return sum(v & 1 for v in vec)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, posix_fadvise and mincore: Linux")
def test_a_model_larger_than_its_budget_runs_within_it(tmp_path):
    size = _write(tmp_path)
    path = tmp_path / "model.safetensors"
    with open(path, "rb+") as f:  # written pages are dirty: written back, they can be dropped
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    out = subprocess.run(
        [sys.executable, "-c", RUN, str(tmp_path), "0.33"], capture_output=True, text=True, check=True
    )
    r = json.loads(out.stdout.splitlines()[-1])
    assert r["new"] == 24 and r["misses"] > 0
    assert r["cache"] < 0.4 * r["experts"]  # streamed: a third of the experts held
    assert r["memory"] < r["peak"] - r["cache"] + r["experts"]  # resident experts would not fit
    assert r["peak"] <= r["memory"], (
        f"peak RSS {r['peak'] / 2**20:.0f} MiB, budget {r['memory'] / 2**20:.0f} MiB"
    )
    assert r["reads"]["direct"] + r["reads"]["pread"] > 0
    # the expert reads left nothing in the page cache (the dense part's pages went after loading)
    assert _cached_pages(path) * mmap.PAGESIZE < 0.05 * size, f"{_cached_pages(path)} pages cached"
