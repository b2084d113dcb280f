"""The numba dequantisers against the gguf package's numpy dequantisers and moerun's torch path, bit for
bit: random blocks whose scale, min and quant fields take every value, fp16 scale fields that are
zero, subnormal, infinite or NaN (gguf keeps NaN payloads), odd block counts, chunks split over
threads, and the routing in `dequantize_bytes`."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_dequant import FP16_FIELDS, assert_same_bits, finite_fp16_bits, gguf_dequant, random_bytes

from moerun.quant import dequant
from moerun.quant.dequant import dequantize_bytes
from moerun.quant.formats import FORMATS

numba_dequant = pytest.importorskip("moerun.quant.numba_dequant", reason="numba is not installed")

FORMAT_NAMES = ["q8_0", "q4_0", "mxfp4", "mxfp4_gpt_oss", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
GGUF_NAMES = [name for name in FORMAT_NAMES if name != "mxfp4_gpt_oss"]
# fp16 scales beyond finite_fp16_bits' specials: ±inf, signalling and quiet NaNs with assorted payloads.
F16_NONFINITE = np.array([0x7C00, 0xFC00, 0x7C01, 0xFC01, 0x7E00, 0xFE00, 0x7D55, 0x7FFF, 0xFFFF], np.uint16)


def blocks_with_any_fp16(name: str, n_blocks: int, seed: int) -> np.ndarray:
    """Random `name` blocks uint8 [n_blocks, block_bytes] whose fp16 fields hold any bit pattern:
    the non-finite ones above and finite specials first, then random bits (NaNs and infs included)."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    blocks = random_bytes(name, (1, n_blocks * fmt.block_size), seed).reshape(n_blocks, fmt.block_bytes)
    for k, offset in enumerate(FP16_FIELDS.get(name, ())):
        bits = rng.integers(0, 1 << 16, size=n_blocks, dtype=np.uint16)
        specials = np.concatenate([F16_NONFINITE, finite_fp16_bits(rng, 9)])
        # Shift the specials between fields, so that d and dmin meet different ones in one block.
        bits[: len(specials)] = np.roll(specials, 4 * k)[:n_blocks]
        blocks[:, offset : offset + 2] = bits.astype("<u2").view(np.uint8).reshape(n_blocks, 2)
    return blocks


TORCH_DEQUANTIZERS = dict(dequant.BLOCK_DEQUANTIZERS)


def torch_path(name: str, data: np.ndarray) -> torch.Tensor:
    """`dequantize_bytes` without the numba kernels (and the torch ones back, if the `numba_only`
    fixture took them away)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(dequant.BLOCK_DEQUANTIZERS, name, TORCH_DEQUANTIZERS[name])
        return dequantize_bytes(FORMATS[name], torch.from_numpy(data), numba=False)


def gguf_values(name: str, data: np.ndarray) -> torch.Tensor:
    with np.errstate(invalid="ignore"):  # inf * 0 and inf - inf give NaN, in ggml too
        return gguf_dequant(name, data)


def assert_same_bits_but_nan_pairs(numba_out: torch.Tensor, torch_out: torch.Tensor) -> None:
    """Bit for bit, except values that are NaN in both. Given two NaNs, numpy's (and so gguf's) and
    numba's subtraction return the first one's payload and torch's the second one's: in blocks whose d
    and dmin are both non-finite, the torch path's NaN payloads differ from gguf's."""
    both_nan = torch.isnan(numba_out) & torch.isnan(torch_out)
    assert_same_bits(torch.where(both_nan, 0.0, numba_out), torch.where(both_nan, 0.0, torch_out))


@pytest.fixture
def numba_only(monkeypatch):
    """Route every block tensor, however small, to numba, and make the torch path fail if reached."""

    def torch_dequantiser_called(blocks):
        raise AssertionError("the torch dequantiser ran instead of numba's")

    monkeypatch.setattr(dequant, "NUMBA_MIN_BLOCKS", 1)
    for name in FORMAT_NAMES:
        monkeypatch.setitem(dequant.BLOCK_DEQUANTIZERS, name, torch_dequantiser_called)


# Block counts: one block, an odd count in one row, odd rows of odd counts, [E, out, in].
SHAPES_IN_BLOCKS = [(1, 1), (1, 67), (3, 13), (3, 5, 7)]


@pytest.mark.parametrize("shape_in_blocks", SHAPES_IN_BLOCKS, ids=str)
@pytest.mark.parametrize("name", GGUF_NAMES)
def test_bit_exact_against_gguf(name, shape_in_blocks, numba_only):
    fmt = FORMATS[name]
    n_blocks = int(np.prod(shape_in_blocks))
    data = blocks_with_any_fp16(name, n_blocks, seed=n_blocks).reshape(
        *shape_in_blocks[:-1], shape_in_blocks[-1] * fmt.block_bytes
    )
    out = dequantize_bytes(fmt, torch.from_numpy(data))
    assert out.shape == (*shape_in_blocks[:-1], shape_in_blocks[-1] * fmt.block_size)
    assert_same_bits(out, gguf_values(name, data).reshape(out.shape))


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_every_field_value_against_gguf_and_the_torch_path(name, numba_only):
    """Enough random blocks that every scale, min, quant and E8M0 byte takes each of its values."""
    fmt = FORMATS[name]
    n_blocks = 4096 if fmt.block_size == 32 else 512
    data = blocks_with_any_fp16(name, n_blocks, seed=1)
    if name.startswith("mxfp4"):
        assert set(np.unique(data[:, 0])) == set(range(256))  # every E8M0 scale
    elif name in ("q4_k", "q5_k"):
        scales, mins = dequant._unpack_k4_scales(torch.from_numpy(data[:, 4:16]))
        assert set(scales.unique().tolist()) == set(mins.unique().tolist()) == set(range(64))
    elif name == "q6_k":
        assert set(np.unique(data[:, 192:208])) == set(range(256))
    fp16 = [data[:, o : o + 2].copy().view("<u2").ravel() for o in FP16_FIELDS.get(name, ())]
    assert all(np.isnan(f.view(np.float16)).any() and np.isinf(f.view(np.float16)).any() for f in fp16)

    out = dequantize_bytes(fmt, torch.from_numpy(data))
    if name != "mxfp4_gpt_oss":  # not a gguf type; its layout is tested against the spec in test_dequant
        assert_same_bits(out, gguf_values(name, data))
    assert_same_bits_but_nan_pairs(out, torch_path(name, data))


def test_the_fp16_table_is_numpys_cast_and_the_torch_paths():
    """All 65536 fp16 patterns, NaN payloads included, as the torch path converts them."""
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    assert_same_bits(torch.from_numpy(numba_dequant._F16), dequant._f16_to_f32(bits.view(torch.float16)))


@pytest.mark.parametrize("name", ["q4_0", "mxfp4_gpt_oss", "q3_k", "q5_k"])
def test_chunks_over_threads_are_the_same(name, monkeypatch):
    """Blocks split into many small chunks, shared by two threads, give the single-call bits."""
    fmt = FORMATS[name]
    data = blocks_with_any_fp16(name, 301, seed=5)
    whole = numba_dequant.numba_dequantize(fmt, torch.from_numpy(data))  # 301 blocks: one chunk
    monkeypatch.setattr(numba_dequant, "_CHUNK_BYTES", 3 * fmt.block_bytes)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(3):
            assert_same_bits(numba_dequant.numba_dequantize(fmt, torch.from_numpy(data)), whole)
    finally:
        torch.set_num_threads(threads)
    assert_same_bits_but_nan_pairs(whole, torch_path(name, data))


def test_strided_bytes_and_other_dtypes(numba_only):
    """A row-strided view of the bytes decodes as its copy; bf16 output is the float32 values cast."""
    data = random_bytes("q6_k", (5, 3 * 256), seed=9)
    wide = torch.zeros(5, data.shape[1] + 7, dtype=torch.uint8)
    wide[:, 3 : 3 + data.shape[1]] = torch.from_numpy(data)
    strided = wide[:, 3 : 3 + data.shape[1]]
    expected = gguf_values("q6_k", data)
    assert_same_bits(dequantize_bytes(FORMATS["q6_k"], strided), expected)
    bf16 = dequantize_bytes(FORMATS["q6_k"], strided, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(
        bf16.view(torch.int16), expected.bfloat16().view(torch.int16)
    )


def test_routing_by_size_and_without_numba(monkeypatch):
    """Small tensors stay on the torch path; without numba, large ones do too."""
    calls = []
    real = numba_dequant.numba_dequantize
    monkeypatch.setattr(numba_dequant, "numba_dequantize", lambda *a: calls.append(1) or real(*a))
    fmt = FORMATS["q4_k"]
    small = random_bytes("q4_k", (1, (dequant.NUMBA_MIN_BLOCKS - 1) * 256), seed=2)
    large = random_bytes("q4_k", (1, dequant.NUMBA_MIN_BLOCKS * 256), seed=2)
    dequantize_bytes(fmt, torch.from_numpy(small))
    assert calls == []
    assert_same_bits(dequantize_bytes(fmt, torch.from_numpy(large)), gguf_values("q4_k", large))
    assert calls == [1]
    monkeypatch.setattr(dequant, "_numba_dequant", lambda: None)
    assert_same_bits(dequantize_bytes(fmt, torch.from_numpy(large)), gguf_values("q4_k", large))
    assert calls == [1]


# Dequantises and multiplies with q8_0 twice each, in a process of its own, and says "done" on stdout.
FIRST_USE = """
import torch
from moerun.quant.formats import FORMATS
from moerun.quant.numba_dequant import numba_dequantize
from moerun.quant.numba_matvec import numba_matvec
data = torch.randint(0, 127, (4, 34), dtype=torch.uint8)
for _ in range(2):
    numba_dequantize(FORMATS["q8_0"], data)
    numba_matvec("q8_0", data, torch.ones(32))
print("done")
"""
COMPILING = [
    "moerun: compiling the q8_0 dequantiser (once; cached on disk)",
    "moerun: compiling the q8_0 decode kernel with numba (once; later runs load it from numba's disk cache)",
]


def test_says_it_compiles_only_when_it_does(tmp_path):
    """A process with an empty numba cache compiles each kernel once and says so on stderr; a second
    process with the same cache loads them from disk and says nothing. stdout carries none of it."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    command = [sys.executable, "-c", FIRST_USE]
    runs = [subprocess.run(command, env=env, capture_output=True, text=True, timeout=600) for _ in range(2)]
    for run in runs:
        assert (run.returncode, run.stdout) == (0, "done\n"), run.stderr
    assert [line for line in runs[0].stderr.splitlines() if "compiling" in line] == COMPILING
    assert "compiling" not in runs[1].stderr
    assert any((tmp_path / "numba").rglob("*.nbi"))  # numba's cache index, on disk
