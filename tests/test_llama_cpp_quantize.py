"""Whole files quantised by llama.cpp itself (`llama_model_quantize`, llama-quantize's code, from
llama-cpp-python) against moerun's quantisers on the same f32 weights: every tensor llama.cpp
quantised, in the type asked for or its fallback, has our bytes. Skipped without llama-cpp-python."""

import ctypes

import gguf
import numpy as np
import pytest
import torch
from gguf_from_hf import GGUF_OVERRIDES, QUANT_SIZES, write_gguf
from hf_models import make_model

from moerun.quant.formats import FORMATS
from moerun.quant.quantize import quantize_rows

llama_cpp = pytest.importorskip("llama_cpp")

# moerun format -> llama_ftype (include/llama.h), by llama-quantize's names
FTYPES = {"q4_1": 3, "q5_0": 8, "q5_1": 9, "iq4_nl": 25, "iq4_xs": 30, "tq1_0": 36, "tq2_0": 37}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small tensors: on a busy 2-core machine torch's thread pool only slows the quantisers down."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory):
    sizes = {**GGUF_OVERRIDES["qwen3_moe"], **QUANT_SIZES["qwen3_moe"]}
    model = make_model("qwen3_moe", hidden_size=256, num_hidden_layers=1, **sizes)
    path = tmp_path_factory.mktemp("llama_cpp") / "f32.gguf"
    write_gguf(model, path)
    return path


def llama_cpp_quantize(src, out, ftype: int) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    params.pure = True  # every tensor that llama.cpp quantises in the one type, where its rows allow
    status = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    assert status == 0, f"llama.cpp failed to quantise {src} (status {status})"


@pytest.mark.parametrize("fmt", list(FTYPES))
def test_llama_cpp_s_tensors_are_our_bytes(fmt, f32_file, tmp_path):
    out = tmp_path / f"{fmt}.gguf"
    llama_cpp_quantize(f32_file, out, FTYPES[fmt])
    source = {t.name: t for t in gguf.GGUFReader(f32_file).tensors}
    types = {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(out).tensors}
    assert {types[f"blk.0.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")} == {fmt}
    # every quantised tensor, fallbacks included (rows of 64 are not whole 256-element blocks)
    quantised = [t for t in gguf.GGUFReader(out).tensors if types[t.name] not in ("f32", "f16", "bf16")]
    assert sum(types[t.name] == fmt for t in quantised) >= 5  # attention and experts at least
    for t in quantised:
        x = torch.from_numpy(np.asarray(source[t.name].data, dtype=np.float32).copy())
        ours = quantize_rows(FORMATS[types[t.name]], x.reshape(-1, x.shape[-1])).numpy()
        np.testing.assert_array_equal(ours.reshape(-1), np.asarray(t.data).reshape(-1), err_msg=t.name)
