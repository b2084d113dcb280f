"""Dequantisation against the gguf package's numpy dequantisers on blocks whose fields take every
value: scale, min and quant fields each through all their values, fp16 scale fields that are zero,
subnormal, infinite or NaN (gguf keeps NaN payloads), odd block counts. test_dequant covers the
sane-scale cases, the layouts and the unpack functions."""

import numpy as np
import pytest
import torch
from test_dequant import FP16_FIELDS, assert_same_bits, finite_fp16_bits, gguf_dequant, random_bytes

from moerun.quant import dequant
from moerun.quant.dequant import dequantize_bytes
from moerun.quant.formats import FORMATS

GGUF_NAMES = [name for name, f in FORMATS.items() if f.ggml_type is not None and not f.is_float]


def _le_fields(data: np.ndarray, size: int) -> np.ndarray:
    return data.copy().view({2: "<u2", 4: "<u4"}[size]).astype(np.int64)


def grid_indices(name: str, data: np.ndarray) -> tuple[np.ndarray, int] | None:
    """Every grid index in blocks [N, block_bytes] of an i-quant, read straight from the layout in
    ggml-common.h, and how many entries its grid has; None for formats without a grid."""
    if name == "iq2_xxs":
        return data[:, 2:66].reshape(-1, 8, 8)[:, :, 0:4], 256
    if name == "iq2_xs":
        return _le_fields(data[:, 2:66], 2) & 511, 512
    if name == "iq2_s":
        qh = np.stack([(data[:, 66:74] >> s) & 3 for s in (0, 2, 4, 6)], -1).reshape(-1, 32)
        return data[:, 2:34].astype(np.int64) | qh.astype(np.int64) << 8, 1024
    if name == "iq3_xxs":
        return data[:, 2:66], 256
    if name == "iq3_s":
        qh = np.stack([(data[:, 66:74] >> s) & 1 for s in range(8)], -1).reshape(-1, 64)
        return data[:, 2:66].astype(np.int64) | qh.astype(np.int64) << 8, 512
    if name == "iq1_s":
        qh = _le_fields(data[:, 34:50], 2)
        top = np.stack([(qh >> (3 * k)) & 7 for k in range(4)], -1).reshape(-1, 32)
        return data[:, 2:34].astype(np.int64) | top << 8, 2048
    if name == "iq1_m":
        nib = np.stack([data[:, 32:48] & 7, (data[:, 32:48] >> 4) & 7], -1).reshape(-1, 32)
        return data[:, 0:32].astype(np.int64) | nib.astype(np.int64) << 8, 2048
    return None


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


def gguf_values(name: str, data: np.ndarray) -> torch.Tensor:
    with np.errstate(invalid="ignore"):  # inf * 0 and inf - inf give NaN, in ggml too
        return gguf_dequant(name, data)


def assert_same_bits_but_nan_pairs(actual: torch.Tensor, gguf_out: torch.Tensor) -> None:
    """Bit for bit, except the payloads of values that are NaN in both. Given two NaNs, numpy's (and so
    gguf's) subtraction returns the first one's payload and torch's the second one's: in blocks whose d
    and dmin are both non-finite, moerun's NaN payloads differ from gguf's. Real weights have none."""
    both_nan = torch.isnan(actual) & torch.isnan(gguf_out)
    assert_same_bits(torch.where(both_nan, 0.0, actual), torch.where(both_nan, 0.0, gguf_out))


# Block counts: one block, an odd count in one row, odd rows of odd counts, [E, out, in].
SHAPES_IN_BLOCKS = [(1, 1), (1, 67), (3, 13), (3, 5, 7)]


@pytest.mark.parametrize("shape_in_blocks", SHAPES_IN_BLOCKS, ids=str)
@pytest.mark.parametrize("name", GGUF_NAMES)
def test_any_fp16_scales_against_gguf(name, shape_in_blocks):
    fmt = FORMATS[name]
    n_blocks = int(np.prod(shape_in_blocks))
    data = blocks_with_any_fp16(name, n_blocks, seed=n_blocks).reshape(
        *shape_in_blocks[:-1], shape_in_blocks[-1] * fmt.block_bytes
    )
    out = dequantize_bytes(fmt, torch.from_numpy(data))
    assert out.shape == (*shape_in_blocks[:-1], shape_in_blocks[-1] * fmt.block_size)
    assert_same_bits_but_nan_pairs(out, gguf_values(name, data).reshape(out.shape))


@pytest.mark.parametrize("name", GGUF_NAMES)
def test_every_field_value_against_gguf(name):
    """Enough random blocks that every scale, min, quant and E8M0 byte takes each of its values."""
    fmt = FORMATS[name]
    n_blocks = 4096
    data = blocks_with_any_fp16(name, n_blocks, seed=1)
    grid = grid_indices(name, data)
    if grid is not None:  # every grid entry (and so, with 4096 blocks, every 7-bit sign index too)
        assert set(np.unique(grid[0])) == set(range(grid[1]))
    if name == "mxfp4":
        assert set(np.unique(data[:, 0])) == set(range(256))  # every E8M0 scale
    elif name in ("q4_k", "q5_k"):
        scales, mins = dequant._unpack_k4_scales(torch.from_numpy(data[:, 4:16]))
        assert set(scales.unique().tolist()) == set(mins.unique().tolist()) == set(range(64))
    elif name == "q6_k":
        assert set(np.unique(data[:, 192:208])) == set(range(256))
    fp16 = [data[:, o : o + 2].copy().view("<u2").ravel() for o in FP16_FIELDS.get(name, ())]
    assert all(np.isnan(f.view(np.float16)).any() and np.isinf(f.view(np.float16)).any() for f in fp16)

    assert_same_bits_but_nan_pairs(dequantize_bytes(fmt, torch.from_numpy(data)), gguf_values(name, data))


def test_strided_bytes_and_other_dtypes():
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
