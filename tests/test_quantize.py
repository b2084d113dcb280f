"""quantize: bytes against the gguf package's quantisers (q8_0, q4_0, q4_1, q5_0, q5_1, mxfp4, tq1_0,
tq2_0, bf16), k-quants decoded
by gguf's numpy dequantisers (round-trip error, idempotence), edge cases, refusals and the 3-D layout."""

import hashlib

import gguf
import numpy as np
import pytest
import torch

from moerun.quant import quantize as quantize_module
from moerun.quant.formats import FORMATS, FormatError
from moerun.quant.quantize import READ_ONLY, WRITABLE, quantize, quantize_rows

KQUANTS = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
GGUF_BIT_EXACT = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4", "tq1_0", "tq2_0"]


def ours(name: str, x: np.ndarray) -> np.ndarray:
    return quantize_rows(FORMATS[name], torch.from_numpy(x)).numpy()


def gguf_type(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType(FORMATS[name].ggml_type)


def decode(name: str, q: np.ndarray) -> np.ndarray:
    """gguf's numpy dequantiser: the independent decoder."""
    return gguf.quants.dequantize(q, gguf_type(name))


def gaussian(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


# ---------------------------------------------------------------- bytes equal to gguf's quantisers


# A block maximum of 6 gives MXFP4 scale 2^0 (E2M1 values 0, 0.5, 1, 1.5, 2, 3, 4, 6); then every
# midpoint between neighbouring values, positive and negative: a tie, which the first code wins.
E2M1_MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
E2M1_TIES = np.array([6.0, *E2M1_MIDPOINTS, *(-m for m in E2M1_MIDPOINTS), 0.0], np.float32)  # 16


def edge_rows() -> dict[str, np.ndarray]:
    """Rows of 64 (two blocks of 32) that probe each quantiser's rounding and tie rules."""
    rng = np.random.default_rng(1)
    pow2 = np.ldexp(np.float32(1), np.arange(-48, 16)).astype(np.float32)
    outlier = rng.standard_normal((4, 64)).astype(np.float32)
    outlier[0, 5], outlier[1, 40], outlier[2, 0], outlier[3, 63] = 1e4, -3e4, 60.0, -0.5
    return {
        "zeros": np.zeros((2, 64), np.float32),
        "negative zeros": np.full((2, 64), -0.0, np.float32),
        "one huge outlier per block": outlier,
        # max |x| shared by a positive and a negative x: Q4_0 keeps the first one's sign
        "tied maxima": np.tile(np.array([3.0, -3.0, 1.0, -1.5] * 8, np.float32), (2, 2))
        * np.array([[1], [-1]], np.float32),
        "powers of two": np.stack([pow2, -pow2[::-1]]),
        # just below a power of two, where floor(log2) decides MXFP4's exponent
        "below powers of two": np.stack([pow2, -pow2]) * np.float32(1 - 2**-24),
        "e2m1 ties": np.tile(E2M1_TIES, (2, 4)),
        "halves": (rng.integers(-20, 21, (3, 64)) * 0.5).astype(np.float32),
        "tiny normals": (rng.standard_normal((2, 64)) * 1e-30).astype(np.float32),
        # float32 subnormals: 1/d overflows to inf in ggml and gguf alike (MXFP4 below, separately)
        "subnormals": (rng.standard_normal((2, 64)) * 1e-40).astype(np.float32),
    }


@pytest.mark.parametrize("name", GGUF_BIT_EXACT)
def test_bytes_match_gguf_on_gaussian_rows(name):
    x = gaussian(32, 1024) * np.float32(0.02)
    expected = gguf.quants.quantize(x, gguf_type(name))
    np.testing.assert_array_equal(ours(name, x), expected)


# MXFP4 on subnormals is test_mxfp4_below_the_smallest_scale: there ggml's exponent wraps around.
EDGE_CASES = [
    (name, case) for name in GGUF_BIT_EXACT for case in edge_rows() if (name, case) != ("mxfp4", "subnormals")
]


@pytest.mark.parametrize(("name", "case"), EDGE_CASES)
def test_bytes_match_gguf_on_edge_cases(name, case):
    x = edge_rows()[case]
    x = np.tile(x, (1, FORMATS[name].block_size // 32))  # rows of whole 256-element blocks for tq*
    with np.errstate(all="ignore"):  # gguf's numpy divides by zero and casts inf on these rows
        expected = gguf.quants.quantize(x, gguf_type(name))
    np.testing.assert_array_equal(ours(name, x), expected)


def test_mxfp4_below_the_smallest_scale():
    """ggml computes exponent floor(log2 max|x|) + 125 into a uint8 without a lower bound, which
    wraps below 2^-125 (gguf writes 255, E8M0's NaN); we keep the smallest exponent, 0 (2^-127)."""
    x = (gaussian(2, 64) * 1e-40).astype(np.float32)
    q = ours("mxfp4", x).reshape(-1, 17)
    assert (q[:, 0] == 0).all()
    # All |x| < 2^-129, half the smallest nonzero E2M1 step of 2^-128: everything rounds to 0.
    np.testing.assert_array_equal(decode("mxfp4", q.reshape(2, -1)), np.zeros_like(x))


def test_mxfp4_gpt_oss_is_mxfp4_with_nibbles_regrouped():
    """Same codes as GGUF's MXFP4 (whose bytes match gguf), stored as element 2j (low) and 2j + 1."""
    x = gaussian(8, 256)
    ggml = ours("mxfp4", x).reshape(-1, 17)
    codes = np.concatenate([ggml[:, 1:] & 15, ggml[:, 1:] >> 4], axis=1)  # [blocks, 32] in element order
    expected = np.concatenate([ggml[:, :1], codes[:, 0::2] | codes[:, 1::2] << 4], axis=1)
    np.testing.assert_array_equal(ours("mxfp4_gpt_oss", x).reshape(-1, 17), expected)


def test_float_formats_are_plain_casts():
    x = gaussian(4, 96) * np.float32(300)
    np.testing.assert_array_equal(ours("f32", x), x.view(np.uint8))
    np.testing.assert_array_equal(ours("f16", x), x.astype(np.float16).view(np.uint8))
    np.testing.assert_array_equal(ours("bf16", x), gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16))


# ---------------------------------------------------------------- k-quants: round trip through gguf

# RMS error / RMS of x on standard Gaussian rows. A b-bit grid spanning a sub-block's range R has
# step R / (2^b - 1) and RMS error about step / sqrt(12). R averages 4.14 sigma for 32 Gaussians
# (Q4_K, Q5_K: min and scale), 3.53 sigma for 16 (Q2_K) and 2 * 2.08 sigma for 16 around zero
# (Q3_K, Q6_K: signed scale), which predicts Q2_K 0.34, Q3_K 0.17, Q4_K 0.080, Q5_K 0.039 and
# Q6_K 0.019; ggml's searches shrink the grids a little and do better. Measured on gaussian(64, 2048):
# q2_k 0.297, q3_k 0.151, q4_k 0.0715, q5_k 0.0362, q6_k 0.0178. The bounds are those plus 8-10%.
RMS_BOUND = {"q2_k": 0.32, "q3_k": 0.165, "q4_k": 0.078, "q5_k": 0.039, "q6_k": 0.0195}


@pytest.mark.parametrize("name", KQUANTS)
def test_round_trip_error_on_gaussian_rows(name):
    x = gaussian(64, 2048)
    err = decode(name, ours(name, x)) - x
    assert np.sqrt((err**2).mean() / (x**2).mean()) < RMS_BOUND[name]


@pytest.mark.parametrize("name", KQUANTS)
def test_scaling_by_a_power_of_two_scales_the_result(name):
    """x * 64 quantises to the same levels with scales * 64 (every step is exact under a power of
    two while fp16 scales stay normal), so the decoded values are exactly 64 times as large."""
    x = gaussian(8, 1024)
    np.testing.assert_array_equal(
        decode(name, ours(name, x * np.float32(64))), decode(name, ours(name, x)) * 64
    )


def structured_rows() -> np.ndarray:
    """8 rows of 512 built from integer hashing (no RNG, no libm), so exact on any platform: sums of
    three uniform integers (bell-shaped), then a row scaled down, one with an outlier, one all
    positive, one all negative, one with every fourth value zero and one on a grid of 1/4."""
    i = np.arange(8 * 512, dtype=np.uint64)
    h = (i * np.uint64(2654435761)) % np.uint64(2**32)
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(1274126177)) % np.uint64(2**32)
    parts = [(h >> np.uint64(shift)) & np.uint64(0x3FF) for shift in (0, 10, 20)]
    x = (((parts[0] + parts[1] + parts[2]).astype(np.float64) - 1534.5) / 512).astype(np.float32)
    x = x.reshape(8, 512)
    x[1] *= np.float32(2**-7)
    x[2, 17] = 40.0
    x[3] = np.abs(x[3])
    x[4] = -np.abs(x[4])
    x[5, ::4] = 0
    x[6] = np.round(x[6] * 4) / 4
    return x


# sha256 of the bytes that ggml's quantize_row_q*_K_ref gives for structured_rows(): ggml-quants.c's
# functions transcribed to C and built with gcc -O2 -ffp-contract=off. (gguf has no k-quant
# quantisers. Built with FMA contraction, e.g. -march=native, ggml's own bytes differ on q2_k, q4_k
# and q5_k: there the reference is only defined up to the compiler.)
GGML_REF_SHA256 = {
    "q2_k": "2fa5972cacd618b86f8e9cb7fa5338b711433ae81ae07b0be4a4b1dc46495e8e",
    "q3_k": "691fa06ef04009c1a281d6254dd81170578d34fa81f89342c59ff54db310cac4",
    "q4_k": "cfd3e3baaca4c00ea600246d4971ab8b658fef8c13ccc3be162eefcae4116125",
    "q5_k": "285dd69d1a646fc3b31a9b9ad88b6cf9a838900b5992f25af6c7d734035a8017",
    "q6_k": "d6f5fbe708c5951bad5f8b0f5bad1521849ee0ce99d72752a4117229a531a972",
}


@pytest.mark.parametrize("name", KQUANTS)
def test_bytes_match_ggml_reference_output(name):
    assert hashlib.sha256(ours(name, structured_rows()).tobytes()).hexdigest() == GGML_REF_SHA256[name]


# ---------------------------------------------------------------- k-quants: idempotence


def unit_scale_levels(name: str, q: np.ndarray) -> np.ndarray:
    """Each element's stored level [blocks, 256], read by gguf's decoder from a copy of the bytes
    whose super-block scale is set to 1, sub-block scales to 1 and mins to 0."""
    q = q.reshape(-1, FORMATS[name].block_bytes).copy()
    one, zero = np.array([1], np.float16).view(np.uint8), np.array([0], np.float16).view(np.uint8)
    if name == "q2_k":  # scales[16] (scale | min << 4), qs[64], d, dmin
        q[:, :16], q[:, 80:82], q[:, 82:84] = 1, one, zero
    elif name == "q3_k":  # hmask[32], qs[64], scales[12] (6 bits, offset 32), d
        q[:, 96:104], q[:, 104:108], q[:, 108:110] = 0x11, 0xAA, one  # every scale 33, i.e. 1
    elif name in ("q4_k", "q5_k"):  # d, dmin, scales and mins[12], ...
        q[:, 0:2], q[:, 2:4], q[:, 4:8], q[:, 8:12], q[:, 12:16] = one, zero, 1, 0, 1
    else:  # q6_k: ql[128], qh[64], int8 scales[16], d
        q[:, 192:208], q[:, 208:210] = 1, one
    return decode(name, q).reshape(len(q), 256)


def on_lattice(name: str, levels: np.ndarray) -> np.ndarray:
    """Blocks [blocks] whose every sub-block starts ggml's scale search on its own grid, so that the
    search finds that grid again and re-quantising reproduces the bytes:
    q2_k/q4_k/q5_k: the sub-block uses both its lowest level (0) and its highest (nmax), so the min/max
    grid is the stored one; q3_k/q6_k: the first largest-magnitude level is the negative end
    (q3_k: -4; q6_k: -32, or -31, which the search's 31.1 stretch recovers)."""
    sub = 32 if name in ("q4_k", "q5_k") else 16
    levels = levels.reshape(len(levels), -1, sub)
    if name in ("q2_k", "q4_k", "q5_k"):
        nmax = {"q2_k": 3, "q4_k": 15, "q5_k": 31}[name]
        return ((levels.min(-1) == 0) & (levels.max(-1) == nmax)).all(-1)
    first = np.take_along_axis(levels, np.abs(levels).argmax(-1)[..., None], -1)[..., 0]
    return (first == -4).all(-1) if name == "q3_k" else (first <= -31).all(-1)


@pytest.mark.parametrize("name", KQUANTS)
def test_requantising_blocks_on_their_own_grid_gives_the_same_bytes(name):
    """ggml's searches are not idempotent in general (see the tests below), but they are on blocks
    whose grid is the one each search starts from."""
    block_bytes = FORMATS[name].block_bytes
    first = ours(name, gaussian(64, 2048)).reshape(-1, block_bytes)
    again = ours(name, decode(name, first.reshape(64, -1))).reshape(-1, block_bytes)
    lattice = on_lattice(name, unit_scale_levels(name, first))
    # Of these 512 blocks, q2_k 350, q3_k 231, q4_k 78, q5_k 245 and q6_k 418 qualify.
    assert lattice.sum() >= 50
    np.testing.assert_array_equal(again[lattice], first[lattice])


@pytest.mark.parametrize("name", ["q2_k", "q4_k", "q6_k"])
def test_second_round_is_a_fixed_point(name):
    """q2_k, q4_k, q6_k: a few blocks change once (q6_k's mostly by a mirrored sign, see below),
    then re-quantising reproduces the bytes. An observation rather than a theorem: it held for seeds
    0-4 at this size and for 4096 blocks of seed 0."""
    x = gaussian(32, 2048, seed=1)
    second = ours(name, decode(name, ours(name, x)))
    np.testing.assert_array_equal(ours(name, decode(name, second)), second)


def test_q6_k_changes_only_the_sign_of_sub_blocks_whose_levels_reach_31():
    """q6_k stores levels -32..31 and its search sends the first largest |x| to the negative end, so
    a sub-block whose first largest-magnitude level is positive comes back as its mirror image
    (-scale, -levels): the same values in other bytes. Values can change only in a sub-block whose
    largest |level| is below 31, which none of the search's grids (31.1 to 32.9 steps) fits."""
    first = ours("q6_k", gaussian(64, 2048))
    values = decode("q6_k", first)
    again = ours("q6_k", values)
    reach_31 = (np.abs(unit_scale_levels("q6_k", first).reshape(-1, 16, 16)).max(-1) >= 31).all(-1)
    assert reach_31.sum() >= 500 and (again != first).any()  # all 512 here; 94 blocks mirrored
    np.testing.assert_array_equal(
        decode("q6_k", again).reshape(-1, 256)[reach_31], values.reshape(-1, 256)[reach_31]
    )


# q3_k and q5_k never settle on every block: q3_k's levels run -4..3, so a sub-block whose largest
# |level| is +3 (or -3) starts its search on a grid stretched by 4/3 that the five refinement sweeps
# do not always undo; q5_k's candidate grids span 30.5 to 32 steps, so a sub-block that does not use
# both level 0 and level 31 is fitted to a different grid. Each round moves a few blocks; what is
# true is that the moves are small next to the quantisation error itself. Measured drift RMS /
# error RMS over seeds 0-4: q3_k 0.20-0.22 (about 45% of blocks move), q5_k 0.07-0.11 (5-12%).
DRIFT_BOUND = {"q3_k": 0.3, "q5_k": 0.15}


@pytest.mark.parametrize("name", ["q3_k", "q5_k"])
def test_requantising_moves_values_by_less_than_the_error(name):
    x = gaussian(32, 2048, seed=2)
    values = decode(name, ours(name, x))
    again = decode(name, ours(name, values))
    drift = np.sqrt(((again - values) ** 2).mean())
    error = np.sqrt(((values - x) ** 2).mean())
    assert 0 < drift < DRIFT_BOUND[name] * error


# ---------------------------------------------------------------- k-quants: edge cases


@pytest.mark.parametrize("name", KQUANTS)
def test_all_zero_rows_give_all_zero_bytes(name):
    """ggml writes a zero block as zero scales, zero d and dmin and level 0 (Q3_K/Q6_K's level 0
    times a zero scale), i.e. all-zero bytes, which decode to zeros."""
    for zero in (0.0, -0.0):
        q = ours(name, np.full((3, 512), zero, np.float32))
        assert q.shape == (3, 2 * FORMATS[name].block_bytes) and not q.any()
        assert not decode(name, q).any()


@pytest.mark.parametrize("name", KQUANTS)
def test_one_huge_outlier_in_a_block(name):
    """The outlier sets its sub-block's scale, so it comes back to within the fp16 rounding of that
    scale (measured: at most 0.05%); the block's other values lose precision but stay finite, and
    other super-blocks are untouched (quantised exactly as without the outlier)."""
    x = gaussian(4, 512, seed=3)
    spiked = x.copy()
    for row, (col, big) in enumerate([(3, 1e3), (300, -3e4), (0, 100.0), (511, -250.0)]):
        spiked[row, col] = big
    q = ours(name, spiked)
    values = decode(name, q)
    assert np.isfinite(values).all()
    for row, (col, big) in enumerate([(3, 1e3), (300, -3e4), (0, 100.0), (511, -250.0)]):
        assert abs(values[row, col] - big) < 0.005 * abs(big)
    block = FORMATS[name].block_bytes
    clean = ours(name, x)
    # super-blocks without the outlier: row 0's second, row 1's first, row 2's second, row 3's first
    for row, half in [(0, 1), (1, 0), (2, 1), (3, 0)]:
        span = slice(half * block, (half + 1) * block)
        np.testing.assert_array_equal(q[row, span], clean[row, span])


@pytest.mark.parametrize("scale", [1e-20, 1e-40])
@pytest.mark.parametrize("name", KQUANTS)
def test_values_below_fp16_scales_quantise_to_zero(name, scale):
    """Normal tiny values and float32 subnormals: every super-block scale rounds to fp16 zero (the
    smallest fp16 is 6e-8), so the block decodes to exact zeros, never inf or NaN. (For
    subnormals ggml's nearest_int overflows on 1/scale = inf and stores other levels; under a zero
    scale they decode to the same zeros.)"""
    x = (gaussian(4, 512, seed=4) * scale).astype(np.float32)
    np.testing.assert_array_equal(decode(name, ours(name, x)), np.zeros_like(x))


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("name", ["q4_k", "q8_0", "mxfp4", "f16"])
def test_inf_and_nan_are_refused_with_their_count_and_first_index(name):
    x = torch.zeros(2, 3, 256)
    x[1, 2, 7], x[1, 2, 9], x[0, 1, 255] = float("nan"), float("-inf"), float("inf")
    with pytest.raises(
        FormatError, match=rf"to {name}: it holds 3 non-finite value\(s\) .*first at index \(0, 1, 255\)"
    ):
        quantize(x, name)


@pytest.mark.parametrize("name", ["q4_k", "q8_0"])
def test_a_row_that_is_not_a_whole_number_of_blocks_is_refused(name):
    block = FORMATS[name].block_size
    with pytest.raises(FormatError, match=rf"row of {block + 16} elements cannot be stored as {name}"):
        quantize(torch.zeros(2, block + 16), name)


@pytest.mark.parametrize(
    "name", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k", "iq4_nl", "iq4_xs", "tq2_0", "f16"]
)
def test_values_beyond_fp16_scales_are_refused(name):
    """ggml would store an inf scale (or f16 value), which decodes to inf or NaN."""
    x = torch.ones(1, 256)
    x[0, 0] = 3e9
    with pytest.raises(FormatError, match=rf"{name}.*(float16's range|overflows)"):
        quantize(x, name)


def test_other_inputs_are_refused():
    with pytest.raises(FormatError, match="needs floats"):
        quantize(torch.zeros(2, 256, dtype=torch.int32), "q8_0")
    with pytest.raises(FormatError, match=r"\[E, out, in\] or \[out, in\]"):
        quantize(torch.zeros(256), "q8_0")
    with pytest.raises(FormatError, match="Unknown weight format 'q7_k'"):
        quantize(torch.zeros(2, 256), "q7_k")


# ---------------------------------------------------------------- layout


@pytest.mark.parametrize("name", WRITABLE)
def test_each_expert_is_the_contiguous_slice_of_quantising_it_alone(name):
    x = torch.from_numpy(gaussian(3 * 4, 512, seed=5)).reshape(3, 4, 512)
    q = quantize(x, name)
    assert q.shape == (3, 4, 512) and q.data.is_contiguous()
    for e in range(3):
        alone = quantize(x[e], name)
        assert torch.equal(q.data[e], alone.data) and torch.equal(q.expert(e).data, alone.data)


@pytest.mark.parametrize("name", ["mxfp4", "q3_k", "q5_k", "iq4_xs"])
def test_chunking_does_not_change_the_bytes(name, monkeypatch):
    x = torch.from_numpy(gaussian(6, 1024, seed=6))
    whole = quantize_rows(FORMATS[name], x)
    monkeypatch.setattr(quantize_module, "CHUNK_ELEMENTS", 768)  # 3 super-blocks, or 24 blocks
    assert torch.equal(quantize_rows(FORMATS[name], x), whole)


def test_every_format_is_either_written_or_said_why_not():
    assert sorted([*WRITABLE, *READ_ONLY]) == sorted(FORMATS)


@pytest.mark.parametrize("name", sorted(READ_ONLY))
def test_a_format_moerun_only_reads_is_refused_with_the_reason(name):
    with pytest.raises(FormatError, match=rf"^moerun reads {name} but cannot write it: .*importance matrix"):
        quantize_rows(FORMATS[name], torch.zeros(2, 256))
