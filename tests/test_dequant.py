"""Dequantisation against the gguf package's numpy dequantisers (bit for bit), the float formats against
reinterpreted bytes, GPT-OSS's MXFP4 layout against a decode written here from the OCP spec, and the
unpack functions' documented integer parts against gguf's values."""

import gguf
import numpy as np
import pytest
import torch

from moerun.quant import dequant
from moerun.quant.dequant import dequantize, dequantize_bytes
from moerun.quant.formats import FORMATS, FormatError, QTensor
from moerun.quant.mxfp4_layouts import (
    gpt_oss_layout_bytes,
    gpt_oss_layout_to_mxfp4,
    mxfp4_from_gpt_oss,
    mxfp4_to_gpt_oss,
    mxfp4_to_gpt_oss_layout,
)
from moerun.quant.scales import FP16_SCALES

GGUF_FORMATS = [name for name, f in FORMATS.items() if f.ggml_type is not None]
BLOCK_FORMATS = [name for name in GGUF_FORMATS if not FORMATS[name].is_float]
# Byte offsets of each block's fp16 fields (d, dmin), ggml-common.h's layouts; all other bytes may be
# anything (iq1_m's d is spread over the top nibbles of its last 8 bytes: any bytes there give any d).
FP16_FIELDS = FP16_SCALES
# Logical shapes in blocks per row: one block, several blocks in a row, several rows, [E, out, in].
SHAPES_IN_BLOCKS = [(1, 1), (1, 3), (5, 2), (3, 4, 2)]
F16_SPECIALS = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF], np.uint16)


def finite_fp16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random fp16 bit patterns [n] uint16, none inf or NaN; zeros, subnormals and ±max come first."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    # An all-ones exponent is inf or NaN: clear its top bit, keeping sign and mantissa random.
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0xBFFF, bits).astype(np.uint16)
    k = min(n, len(F16_SPECIALS))
    bits[:k] = F16_SPECIALS[:k]
    return bits


def random_bytes(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random valid bytes [..., row_bytes] of a `name` tensor of logical `shape`: every byte random,
    except fp16 scale fields, which hold random finite values."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    n_blocks = int(np.prod(shape)) // fmt.block_size
    blocks = rng.integers(0, 256, size=(n_blocks, fmt.block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS.get(name, ()):
        bits = finite_fp16_bits(rng, n_blocks).astype("<u2")
        blocks[:, offset : offset + 2] = bits.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // fmt.block_size * fmt.block_bytes)


def gguf_dequant(name: str, data: np.ndarray) -> torch.Tensor:
    with np.errstate(over="ignore"):  # mxfp4's scale byte 255 times 6 overflows to inf, in ggml too
        ref = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(FORMATS[name].ggml_type))
    return torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal float32 tensors, bit for bit (so +0 and -0, and NaN payloads, count as different)."""
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    a, e = actual.cpu().view(torch.int32), expected.view(torch.int32)
    differ = a != e
    if differ.any():
        first = tuple(int(i) for i in differ.nonzero()[0])
        raise AssertionError(
            f"{int(differ.sum())} of {a.numel()} values differ; first at {first}: "
            f"{actual.cpu()[first].item()!r} vs {expected[first].item()!r}"
        )


def logical_shape(name: str, shape_in_blocks: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape_in_blocks[:-1], shape_in_blocks[-1] * FORMATS[name].block_size)


# ---------------------------------------------------------------- against gguf


@pytest.mark.parametrize("shape_in_blocks", SHAPES_IN_BLOCKS, ids=str)
@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_bit_exact_against_gguf(name, shape_in_blocks):
    data = random_bytes(name, logical_shape(name, shape_in_blocks), seed=len(shape_in_blocks))
    assert_same_bits(dequantize_bytes(FORMATS[name], torch.from_numpy(data)), gguf_dequant(name, data))


@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_bit_exact_against_gguf_on_many_blocks(name):
    """512 blocks of random bytes, enough for every scale, min and quant field to take all its values
    (checked for Q4_K's packed 6-bit scales in `test_k4_scales_and_mins_match_gguf`)."""
    data = random_bytes(name, (8, 64 * FORMATS[name].block_size), seed=7)
    assert_same_bits(dequantize_bytes(FORMATS[name], torch.from_numpy(data)), gguf_dequant(name, data))


@pytest.mark.parametrize("name", ["q4_k", "q6_k", "mxfp4", "f16"])
def test_chunked_dequantisation_is_the_same(name, monkeypatch):
    """Tensors larger than one chunk are dequantised a slice at a time into one output."""
    data = random_bytes(name, (6, 5 * FORMATS[name].block_size), seed=3)
    monkeypatch.setattr(dequant, "CHUNK_ELEMENTS", 2 * FORMATS[name].block_size)
    assert_same_bits(dequantize_bytes(FORMATS[name], torch.from_numpy(data)), gguf_dequant(name, data))


@pytest.mark.parametrize("name", ["q4_k", "q8_0", "f16", "bf16", "f32"])
def test_unaligned_and_strided_bytes(name):
    """Bytes at an odd offset, or with a row stride, decode as their contiguous copy would."""
    data = random_bytes(name, (4, 2 * FORMATS[name].block_size), seed=5)
    row = data.shape[-1]
    buffer = torch.zeros(1 + data.size, dtype=torch.uint8)
    buffer[1:] = torch.from_numpy(data).flatten()
    odd_offset = buffer[1:].reshape(4, row)
    wide = torch.zeros(4, row + 3, dtype=torch.uint8)
    wide[:, 1 : row + 1] = torch.from_numpy(data)
    strided = wide[:, 1 : row + 1]
    for view in (odd_offset, strided):
        assert_same_bits(dequantize_bytes(FORMATS[name], view), gguf_dequant(name, data))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["q4_k", "q6_k", "mxfp4", "f32", "f16", "bf16"])
def test_other_dtypes_are_the_float32_values_cast(name, dtype):
    data = random_bytes(name, (2, 3 * FORMATS[name].block_size), seed=11)
    out = dequantize_bytes(FORMATS[name], torch.from_numpy(data), dtype)
    expected = gguf_dequant(name, data).to(dtype)
    assert out.dtype == dtype
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_dequantize_qtensor_has_the_logical_shape():
    shape = (3, 4, 512)
    data = random_bytes("q5_k", shape, seed=2)
    q = QTensor.from_bytes("q5_k", shape, torch.from_numpy(data).flatten())
    expected = gguf_dequant("q5_k", data)
    assert_same_bits(dequantize(q), expected)
    assert_same_bits(dequantize(q.expert(1)), expected[1])


def test_result_does_not_share_the_bytes():
    raw = random_bytes("f32", (2, 8))
    data = torch.from_numpy(raw.copy())
    out = dequantize_bytes(FORMATS["f32"], data)
    data.zero_()
    assert_same_bits(out, torch.from_numpy(raw.view("<f4")))


# ---------------------------------------------------------------- float formats: the bytes reinterpreted


@pytest.mark.parametrize("name", ["f32", "f16", "bf16"])
def test_float_formats_are_the_bytes_reinterpreted(name):
    """Random bytes (NaNs and infinities included) decode as numpy reads them, little-endian."""
    data = random_bytes(name, (3, 40), seed=13)
    if name == "f32":
        expected = data.view("<f4")
    elif name == "f16":
        expected = data.view("<f2").astype(np.float32)
    else:
        expected = (data.view("<u2").astype(np.uint32) << 16).view(np.float32)
    assert_same_bits(dequantize_bytes(FORMATS[name], torch.from_numpy(data)), torch.from_numpy(expected))


def test_every_f16_and_bf16_bit_pattern():
    data = np.arange(1 << 16, dtype="<u2").view(np.uint8).reshape(1, -1)
    f16 = data.view("<f2").astype(np.float32)
    bf16 = (data.view("<u2").astype(np.uint32) << 16).view(np.float32)
    assert_same_bits(dequantize_bytes(FORMATS["f16"], torch.from_numpy(data)), torch.from_numpy(f16))
    assert_same_bits(dequantize_bytes(FORMATS["bf16"], torch.from_numpy(data)), torch.from_numpy(bf16))


# ---------------------------------------------------------------- the unpack functions' integer parts


def test_k4_scales_and_mins_match_gguf():
    """Q4_K's packed 6-bit scales and mins, on enough random bytes that every value of each appears."""
    data = random_bytes("q4_k", (1, 512 * 256), seed=17).reshape(-1, 144)
    scales, mins = gguf.quants.Q4_K.get_scale_min(data[:, 4:16])
    _, _, ours_scales, ours_mins, _ = dequant.unpack_q4_k(torch.from_numpy(data))
    assert set(np.unique(scales)) == set(range(64)) and set(np.unique(mins)) == set(range(64))
    assert torch.equal(ours_scales, torch.from_numpy(scales.astype(np.uint8)))
    assert torch.equal(ours_mins, torch.from_numpy(mins.astype(np.uint8)))


# The i-quants' and ternary formats' parts (moerun.quant.iquants.SuperBlocks): sub-blocks, the range of
# their integer scales and of the quants, from each format's layout (e.g. IQ2's odd scales 2s + 1 of a
# 4-bit s, its signed grid values up to 0x2b; IQ1's 8 * grid value ± 1).
SUPER_BLOCK_PARTS = {
    "iq2_xxs": (8, 1, 31, -43, 43),
    "iq2_xs": (16, 1, 31, -43, 43),
    "iq2_s": (16, 1, 31, -43, 43),
    "iq3_xxs": (8, 1, 31, -62, 62),
    "iq3_s": (8, 1, 31, -15, 15),
    "iq1_s": (8, 1, 15, -9, 9),
    "iq1_m": (16, 1, 15, -9, 9),
    "iq4_xs": (8, -32, 31, -127, 113),
    "tq1_0": (1, 1, 1, -1, 1),
    "tq2_0": (1, 1, 1, -1, 2),  # code 3, which no quantiser writes, is worth 2
}


def _reconstruct(name: str, blocks: torch.Tensor) -> torch.Tensor:
    """Values [N, block_size] in float64 from an unpack function's parts, by its docstring's formula;
    checks each part's dtype, shape and range on the way."""
    n = blocks.shape[0]

    def check(t, dtype, shape, lo, hi):
        assert t.dtype == dtype and t.shape == shape, (t.dtype, t.shape)
        assert lo <= int(t.min()) and int(t.max()) <= hi

    def sub_blocks(d, scales, q, dmin=None, mins=None):
        size = 256 // scales.shape[-1]
        step = d.double()[:, None] * scales.double().repeat_interleave(size, -1)
        offset = 0 if dmin is None else dmin.double()[:, None] * mins.double().repeat_interleave(size, -1)
        return step * q.double() - offset

    if name in SUPER_BLOCK_PARTS:
        d, scales, q = dequant.iquants.UNPACKERS[name](blocks)
        n_sub, slo, shi, qlo, qhi = SUPER_BLOCK_PARTS[name]
        check(scales, torch.int16, (n, n_sub), slo, shi)
        check(q, torch.int8, (n, 256), qlo, qhi)
        assert d.dtype == torch.float32 and d.shape == (n,)
        return sub_blocks(d, scales, q)
    if name in ("q4_1", "q5_1"):
        d, m, q = getattr(dequant, f"unpack_{name}")(blocks)
        check(q, torch.uint8, (n, 32), 0, 15 if name == "q4_1" else 31)
        assert d.dtype == m.dtype == torch.float32 and d.shape == m.shape == (n,)
        return d.double()[:, None] * q.double() + m.double()[:, None]
    if name in ("q5_0", "iq4_nl"):
        d, q = getattr(dequant, f"unpack_{name}")(blocks)
        check(q, torch.int8, (n, 32), -16 if name == "q5_0" else -127, 15 if name == "q5_0" else 113)
        return d.double()[:, None] * q.double()
    if name in ("q4_0", "q8_0"):
        d, q = getattr(dequant, f"unpack_{name}")(blocks)
        check(q, torch.int8, (n, 32), -8 if name == "q4_0" else -128, 7 if name == "q4_0" else 127)
        assert d.dtype == torch.float32 and d.shape == (n,)
        return d.double()[:, None] * q.double()
    if name in ("q2_k", "q4_k", "q5_k"):
        d, dmin, scales, mins, q = getattr(dequant, f"unpack_{name}")(blocks)
        n_sub, smax, qmax = {"q2_k": (16, 15, 3), "q4_k": (8, 63, 15), "q5_k": (8, 63, 31)}[name]
        check(scales, torch.uint8, (n, n_sub), 0, smax)
        check(mins, torch.uint8, (n, n_sub), 0, smax)
        check(q, torch.uint8, (n, 256), 0, qmax)
        assert d.dtype == dmin.dtype == torch.float32 and d.shape == dmin.shape == (n,)
        return sub_blocks(d, scales, q, dmin, mins)
    if name in ("q3_k", "q6_k"):
        d, scales, q = getattr(dequant, f"unpack_{name}")(blocks)
        slo, shi, qlo, qhi = (-32, 31, -4, 3) if name == "q3_k" else (-128, 127, -32, 31)
        check(scales, torch.int8, (n, 16), slo, shi)
        check(q, torch.int8, (n, 256), qlo, qhi)
        assert d.dtype == torch.float32 and d.shape == (n,)
        return sub_blocks(d, scales, q)
    e, codes = dequant.unpack_mxfp4(blocks)
    check(codes, torch.uint8, (n, 32), 0, 15)
    assert e.dtype == torch.uint8 and e.shape == (n,)
    half_scale = torch.exp2(e.double() - 128)  # written from the spec, not via e8m0_half_scale
    table = torch.tensor(dequant.MXFP4_VALUES, dtype=torch.float64)
    return half_scale[:, None] * table[codes.long()]


@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_unpacked_parts_rebuild_the_values(name):
    """The documented formula over the unpacked integers gives gguf's values (up to float32 rounding)."""
    fmt = FORMATS[name]
    data = random_bytes(name, (1, 64 * fmt.block_size), seed=19).reshape(-1, fmt.block_bytes)
    rebuilt = _reconstruct(name, torch.from_numpy(data))
    expected = gguf_dequant(name, data).reshape(rebuilt.shape).double()
    finite = torch.isfinite(expected)  # mxfp4's scale byte 255 overflows float32 only
    assert torch.equal(torch.isfinite(rebuilt.float()), finite)
    torch.testing.assert_close(rebuilt[finite], expected[finite], rtol=2e-7, atol=0)


# ---------------------------------------------------------------- GPT-OSS's MXFP4 layout


def decode_gpt_oss(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """GPT-OSS MXFP4 from the OCP MX spec, element by element: byte j holds element 2j (low nibble) and
    2j + 1 (high); an E2M1 code is sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; the block
    scale is 2^(s - 127). Returns float32 [..., n]."""
    n = blocks.shape[-1] * 2
    element = np.arange(n)
    byte = blocks[..., element // 2].astype(np.int64)
    code = np.where(element % 2 == 0, byte & 0x0F, byte >> 4)
    sign = np.where(code & 0b1000, -1.0, 1.0)
    exponent, mantissa = (code >> 1) & 0b11, code & 0b1
    magnitude = np.where(exponent == 0, mantissa * 0.5, (1 + mantissa * 0.5) * 2.0 ** (exponent - 1))
    scale = np.ldexp(1.0, scales.astype(np.int64) - 127)[..., None]
    with np.errstate(over="ignore"):
        return (sign * magnitude * scale).astype(np.float32)


def random_gpt_oss(shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """GPT-OSS (`*_blocks` [..., n / 32, 16], `*_scales` [..., n / 32]) for logical `shape` [..., n]:
    every byte random, so every scale (0-255) and every code appears."""
    rng = np.random.default_rng(seed)
    lead, n_blocks = shape[:-1], shape[-1] // 32
    blocks = rng.integers(0, 256, size=(*lead, n_blocks, 16), dtype=np.uint8)
    scales = rng.integers(0, 256, size=(*lead, n_blocks), dtype=np.uint8)
    return blocks, scales


GPT_OSS_SHAPES = [(1, 32), (1, 96), (5, 64), (3, 4, 64), (4, 2048)]


@pytest.mark.parametrize("shape", GPT_OSS_SHAPES, ids=str)
def test_mxfp4_gpt_oss_matches_the_spec(shape):
    blocks, scales = random_gpt_oss(shape, seed=len(shape))
    data = gpt_oss_layout_bytes(torch.from_numpy(blocks), torch.from_numpy(scales))
    out = dequantize_bytes(FORMATS["mxfp4_gpt_oss"], data)
    expected = torch.from_numpy(decode_gpt_oss(blocks, scales).reshape(shape))
    # The spec's code 8 is -0; ggml (and so moerun) gives +0. Equal as values, so compare values.
    assert out.shape == shape and torch.equal(out, expected)


@pytest.mark.parametrize("shape", GPT_OSS_SHAPES, ids=str)
def test_gpt_oss_to_gguf_mxfp4_matches_gguf_and_the_spec(shape):
    blocks, scales = random_gpt_oss(shape, seed=10 + len(shape))
    gguf_bytes = mxfp4_from_gpt_oss(torch.from_numpy(blocks), torch.from_numpy(scales))
    assert gguf_bytes.shape == (*shape[:-1], shape[-1] // 32 * 17)
    from_gguf = gguf_dequant("mxfp4", gguf_bytes.numpy())
    assert torch.equal(from_gguf, torch.from_numpy(decode_gpt_oss(blocks, scales).reshape(shape)))
    # The gpt-oss layout of the same weights dequantises to the same bits as gguf's mxfp4.
    layout = gpt_oss_layout_bytes(torch.from_numpy(blocks), torch.from_numpy(scales))
    assert_same_bits(dequantize_bytes(FORMATS["mxfp4_gpt_oss"], layout), from_gguf)


@pytest.mark.parametrize("shape", GPT_OSS_SHAPES, ids=str)
def test_gpt_oss_conversions_are_lossless(shape):
    blocks, scales = (torch.from_numpy(a) for a in random_gpt_oss(shape, seed=20 + len(shape)))
    gguf_bytes = mxfp4_from_gpt_oss(blocks, scales)
    back_blocks, back_scales = mxfp4_to_gpt_oss(gguf_bytes)
    assert torch.equal(back_blocks, blocks) and torch.equal(back_scales, scales)

    layout = gpt_oss_layout_bytes(blocks, scales)
    assert torch.equal(layout.unflatten(-1, (-1, 17))[..., 0], scales)
    assert torch.equal(layout.unflatten(-1, (-1, 17))[..., 1:], blocks)
    assert torch.equal(gpt_oss_layout_to_mxfp4(layout), gguf_bytes)
    assert torch.equal(mxfp4_to_gpt_oss_layout(gguf_bytes), layout)

    # And from the other side: arbitrary GGUF mxfp4 bytes survive the trip through GPT-OSS's layout.
    any_bytes = torch.from_numpy(random_bytes("mxfp4", shape, seed=30))
    assert torch.equal(mxfp4_from_gpt_oss(*mxfp4_to_gpt_oss(any_bytes)), any_bytes)
    assert torch.equal(gpt_oss_layout_to_mxfp4(mxfp4_to_gpt_oss_layout(any_bytes)), any_bytes)


# ---------------------------------------------------------------- refusals


def test_row_bytes_not_a_whole_number_of_blocks_is_refused():
    with pytest.raises(
        FormatError, match=r"q4_k rows of 150 bytes: q4_k blocks are 144 bytes each.*multiple"
    ):
        dequantize_bytes(FORMATS["q4_k"], torch.zeros(2, 150, dtype=torch.uint8))
    with pytest.raises(FormatError, match=r"f32 rows of 6 bytes"):
        dequantize_bytes(FORMATS["f32"], torch.zeros(6, dtype=torch.uint8))


def test_bytes_must_be_uint8():
    with pytest.raises(FormatError, match=r"from a torch.int8 tensor.*must be a uint8 tensor"):
        dequantize_bytes(FORMATS["q8_0"], torch.zeros(1, 34, dtype=torch.int8))


def test_gpt_oss_shapes_must_agree():
    blocks, scales = torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8)
    with pytest.raises(
        FormatError, match=r"need `blocks` uint8 \[\.\.\., n / 32, 16\].*scales torch.uint8 \(2, 4\)"
    ):
        mxfp4_from_gpt_oss(blocks, scales)
    with pytest.raises(FormatError, match=r"mxfp4 bytes must be uint8 \[\.\.\., n / 32 \* 17\]"):
        mxfp4_to_gpt_oss(torch.zeros(2, 20, dtype=torch.uint8))


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", [*GGUF_FORMATS, "mxfp4_gpt_oss"])
def test_cuda_gives_the_same_bits(name):
    data = random_bytes(name, (3, 4, 2 * FORMATS[name].block_size), seed=23)
    if name == "mxfp4_gpt_oss":
        expected = torch.from_numpy(decode_gpt_oss(data.reshape(3, 4, 2, 17)[..., 1:], data[..., ::17]))
        expected = expected.reshape(3, 4, 64)
        out = dequantize_bytes(FORMATS[name], torch.from_numpy(data).cuda())
        assert out.is_cuda and torch.equal(out.cpu(), expected)
        return
    out = dequantize_bytes(FORMATS[name], torch.from_numpy(data).cuda())
    assert out.is_cuda
    assert_same_bits(out, gguf_dequant(name, data))


@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_a_stand_in_dequantises_to_a_stand_in_of_the_values_shape(name):
    """A storage-free QTensor (expert parallelism: a weight a rank never computes) dequantises to a
    storage-free tensor of the shape and dtype its bytes would give, reading nothing."""
    from moerun.quant.formats import storage_free

    fmt = FORMATS[name]
    shape = (3, 4, 2 * fmt.block_size)
    q = QTensor(fmt, shape, torch.from_numpy(random_bytes(name, shape)))
    values, stand_in = dequantize(q, torch.bfloat16), dequantize(storage_free(q), torch.bfloat16)
    assert stand_in.is_meta and (stand_in.shape, stand_in.dtype) == (values.shape, values.dtype)
