"""IQ4_NL / IQ4_XS quantisers (quant/iq4.py): bytes against llama.cpp's own quantiser where it is
installed; against a brute-force numpy search of the same objective over the same candidate scales;
exact round trips of values on the grid; round-trip error decoded by the gguf package."""

import gguf
import numpy as np
import pytest
import torch
from ggml_library import ggml_quantize

from moerun.quant.formats import FORMATS
from moerun.quant.iq_tables import IQ4NL_VALUES
from moerun.quant.quantize import quantize_rows

VALUES = np.array(IQ4NL_VALUES, np.float64)
NEW_WRITERS = ["q4_1", "q5_0", "q5_1", "iq4_nl", "iq4_xs", "tq1_0", "tq2_0"]


def ours(name: str, x: np.ndarray) -> np.ndarray:
    return quantize_rows(FORMATS[name], torch.from_numpy(x)).numpy()


def decode(name: str, q: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(q, gguf.GGMLQuantizationType(FORMATS[name].ggml_type))


def rows(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tiny = (rng.standard_normal((2, 512)) * 1e-30).astype(np.float32)
    outliers = rng.standard_normal((4, 512)).astype(np.float32)
    outliers[0, 7], outliers[1, 300], outliers[2, 0], outliers[3, 511] = 1e3, -4e3, 50.0, -0.7
    return {
        "gaussian": (rng.standard_normal((64, 512)) * 0.02).astype(np.float32),
        "heavy tails": rng.standard_t(2, (64, 512)).astype(np.float32),
        "halves": (rng.integers(-20, 21, (8, 512)) * 0.5).astype(np.float32),
        "zeros": np.zeros((2, 512), np.float32),
        "zero sub-blocks": np.where(np.arange(512) % 64 < 32, outliers[:2], 0).astype(np.float32),
        "outliers": outliers,
        "tiny": tiny,
    }


# ---------------------------------------------------------------- llama.cpp's own bytes


@pytest.mark.skipif(ggml_quantize is None, reason="llama-cpp-python (its ggml library) is not installed")
@pytest.mark.parametrize("case", list(rows()))
@pytest.mark.parametrize("name", NEW_WRITERS)
def test_bytes_match_llama_cpp(name, case):
    x = rows()[case]
    np.testing.assert_array_equal(ours(name, x), ggml_quantize(name, x))


# ---------------------------------------------------------------- the search, brute force


def nearest(y: np.ndarray) -> np.ndarray:
    """Index of the grid value nearest to y (ties to the larger value), by exhaustive comparison."""
    dist = np.abs(y[..., None] - VALUES)
    best = dist.min(-1, keepdims=True)
    return (VALUES.size - 1) - np.argmax((dist == best)[..., ::-1], axis=-1)


def brute_force_scales(x: np.ndarray) -> np.ndarray:
    """Sub-blocks x [G, 32] -> the scale of least weighted squared error (weights x^2) among the
    least-squares scales of the 16 candidate codings ggml tries (max / 127, then inverse scales
    (t - 127) / max, t = -7..7), the first of equal ones; 0 for an all-below-1e-15 sub-block.
    Float64 throughout."""
    x = x.astype(np.float64)
    w = x * x
    peak = np.take_along_axis(x, np.abs(x).argmax(-1)[:, None], -1)  # [G, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        inverses = [127 / peak] + [(t - 127) / peak for t in range(-7, 8)]
        best_score = np.full(len(x), -np.inf)
        best_d = np.zeros(len(x))
        for inverse in inverses:
            q = VALUES[nearest(inverse * x)]
            sumqx, sumq2 = (w * q * x).sum(-1), (w * q * q).sum(-1)
            d = np.where(sumq2 > 0, sumqx / sumq2, 0)
            score = d * sumqx
            better = score > best_score
            best_score, best_d = np.where(better, score, best_score), np.where(better, d, best_d)
    return np.where(np.abs(x).max(-1) < 1e-15, 0, best_d)


def test_iq4_nl_scales_and_codes_are_the_brute_force_optimum():
    x = rows()["gaussian"].reshape(-1, 32)
    q = ours("iq4_nl", x).reshape(-1, 18)
    d = brute_force_scales(x)
    stored = q[:, :2].copy().view(np.float16)[:, 0]
    # float32 and float64 sums can order near-equal candidates differently: allow a few such blocks
    same = stored == d.astype(np.float16)
    assert same.mean() >= 0.995
    codes = np.concatenate([q[:, 2:] & 15, q[:, 2:] >> 4], -1)
    expected = nearest(x / np.where(d == 0, 1, d)[:, None])
    assert (codes[same] == expected[same]).mean() >= 0.999


def test_iq4_xs_sub_block_scales_are_the_brute_force_optimum_on_a_6_bit_grid():
    x = rows()["gaussian"]
    q = ours("iq4_xs", x).reshape(-1, 136)
    scales = brute_force_scales(x.reshape(-1, 32)).reshape(-1, 8)
    biggest = np.take_along_axis(scales, np.abs(scales).argmax(-1)[:, None], -1)
    d = -biggest / 32
    fields = np.clip(np.round(scales / d), -32, 31) + 32
    stored_d = q[:, :2].copy().view(np.float16)[:, 0]
    high = q[:, 2:4].copy().view(np.uint16)[:, 0, None] >> np.arange(0, 16, 2) & 3
    low = np.stack([q[:, 4:8] & 15, q[:, 4:8] >> 4], -1).reshape(-1, 8)
    assert (stored_d == d[:, 0].astype(np.float16)).mean() >= 0.99
    assert ((low | high << 4) == fields).mean() >= 0.99


# ---------------------------------------------------------------- closed forms and error


def on_grid(sub_blocks: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sub-blocks of 32 values 2^k * IQ4NL_VALUES[c] (k per sub-block), each holding -127 (code 0),
    the largest magnitude: (x [sub_blocks, 32] float32, k [sub_blocks])."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (sub_blocks, 32))
    codes[np.arange(sub_blocks), rng.integers(0, 32, sub_blocks)] = 0
    k = rng.integers(-12, -3, sub_blocks)
    return np.ldexp(VALUES[codes], k[:, None]).astype(np.float32), k


def test_iq4_nl_values_on_the_grid_come_back_exactly():
    x, _ = on_grid(64, seed=1)
    np.testing.assert_array_equal(decode("iq4_nl", ours("iq4_nl", x.reshape(2, -1))).reshape(x.shape), x)


def test_iq4_xs_values_on_the_grid_come_back_exactly():
    """Sub-block scales 2^k within 2^5 of the largest are whole multiples of d = 2^K / 32."""
    x, k = on_grid(64, seed=2)
    x = np.ldexp(x, -k[:, None]) * np.ldexp(1.0, np.random.default_rng(3).integers(-10, -5, 64))[:, None]
    x = x.astype(np.float32).reshape(8, 256)
    np.testing.assert_array_equal(decode("iq4_xs", ours("iq4_xs", x)), x)


# RMS error / RMS x on Gaussian rows: the 16 non-linear values fit a Gaussian better than Q4_0's 16
# evenly spaced ones (about 0.099 here), and IQ4_XS's 6-bit sub-block scales cost little.
@pytest.mark.parametrize(("name", "bound"), [("iq4_nl", 0.080), ("iq4_xs", 0.081)])
def test_round_trip_error_beats_q4_0(name, bound):
    x = rows(seed=4)["gaussian"]
    rms = np.sqrt(np.mean(x**2))
    error = np.sqrt(np.mean((decode(name, ours(name, x)).reshape(x.shape) - x) ** 2)) / rms
    q4_0 = np.sqrt(np.mean((decode("q4_0", ours("q4_0", x)).reshape(x.shape) - x) ** 2)) / rms
    assert error <= bound < q4_0


def test_all_zero_blocks():
    """ggml codes 0 as value 1 (index 8, nearer than -10); IQ4_XS stores d = -0 and scales 32 (0)."""
    x = np.zeros((1, 256), np.float32)
    nl = ours("iq4_nl", x).reshape(-1, 18)
    assert not nl[:, :2].any() and (nl[:, 2:] == 0x88).all()
    xs = ours("iq4_xs", x)[0]
    assert list(xs[:8]) == [0x00, 0x80, 0xAA, 0xAA, 0x00, 0x00, 0x00, 0x00] and (xs[8:] == 0x88).all()


def test_nearest_code_at_and_beside_every_midpoint():
    """Ties go to the larger value, as ggml's best_index_int8; just below a midpoint, the smaller."""
    from moerun.quant.iq4 import nearest_code

    mid = ((VALUES[:-1] + VALUES[1:]) / 2).astype(np.float32)
    below = np.nextafter(mid, np.float32(-np.inf))
    y = np.concatenate([mid, below, VALUES.astype(np.float32), [-1e4, 1e4, 0.0]]).astype(np.float32)
    expected = np.concatenate([np.arange(1, 16), np.arange(0, 15), np.arange(16), [0, 15, 8]])
    np.testing.assert_array_equal(nearest_code(torch.from_numpy(y)).numpy(), expected)
    np.testing.assert_array_equal(nearest(y.astype(np.float64)), expected)
