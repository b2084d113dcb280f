"""q8_1 activations against a per-element numpy restatement of ggml's `quantize_row_q8_1_ref`, and
the integer dot products against float dot products of weights dequantised by the gguf package.

Bounds used below (per weight row, in float64; w the gguf-dequantised weights, x the activation,
a = act.dequantize(), block b of 32 with float32 scale d32_b = amax_b / 127 and fp16 d8_b, s_b):
- quantisation: |x_i - a_i| <= e_b = d32_b * (1/2 + 2^-16) + 127 * max(2^-11 * d32_b, 2^-25): roundf's
  half step, float32 rounding of x * (1 / d) (< 127 * 2^-23 quant steps), and d's fp16 rounding
  (half an fp16 ulp: relative 2^-11 when normal, 2^-25 absolute when subnormal) times |qs| <= 127.
- q4_0, q5_0, q4_1 and q5_1 also use s, which is off from d8 * sum(qs) by at most
  2^-10 * d32 * |sum(qs)| + 2^-24 * (|sum(qs)| + 1) (both fp16 roundings), times |c| per block, c the
  coefficient of s (-8 d or -16 d for the offsets of q4_0 and q5_0, the min m for q4_1 and q5_1).
- float32 arithmetic in the integer path: 1e-5 * sum_i |w_i| * |x_i|, far above its 2^-24-per-operation
  error over a few hundred terms.
So |dot - w.x| <= sum_i |w_i| e_b(i) [+ the s term] + 1e-5 sum_i |w_i x_i|, and, against the
dequantised activation, |dot - w.a - the exact s correction| <= 1e-6 * sum_i |w_i a_i|.
"""

import math

import gguf
import numpy as np
import pytest
import torch

from moerun.quant import dequant
from moerun.quant.formats import FORMATS, FormatError, QTensor
from moerun.quant.q8_1 import DOT_FORMATS, dot_q8_1, matvec_q8_1, quantize_q8_1
from moerun.quant.scales import FP16_SCALES

N = 512  # two k-quant super-blocks, 16 q8_1 blocks
ROWS = 8
GGUF_QUANTISED = {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4"}  # formats gguf-py can quantise


def ggml_q8_1(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_row_q8_1_ref restated element by element: float32 x [n] -> (qs int [n], d fp16 [nb],
    s fp16 [nb])."""
    qs, ds, ss = [], [], []
    for b in range(len(x) // 32):
        block = [np.float32(v) for v in x[32 * b : 32 * b + 32]]
        amax = np.float32(0)
        for v in block:
            amax = max(amax, np.float32(abs(v)))
        d = np.float32(amax / np.float32(127))
        inv = np.float32(np.float32(1) / d) if d else np.float32(0)
        total = 0
        for v in block:
            v0 = float(np.float32(v * inv))
            q = int(math.copysign(math.floor(abs(v0) + 0.5), v0))  # roundf; exact in float64
            qs.append(q)
            total += q
        ds.append(np.float16(d))
        ss.append(np.float16(np.float32(np.float32(total) * d)))
    return np.array(qs), np.array(ds, np.float16), np.array(ss, np.float16)


def activation(seed: int) -> np.ndarray:
    """float32 [n]: blocks at very different scales, a zero block, exact roundf ties, an fp16-subnormal d."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(N).astype(np.float32)
    x *= np.repeat(10.0 ** rng.uniform(-3, 2, N // 32), 32).astype(np.float32)
    x[32:64] = 0
    x[64:96] = np.arange(-16, 16) + 0.5
    x[64] = -127.0  # amax 127, so d = id = 1 and the others' x * id = k + 0.5 exactly: ties
    x[96:128] *= 1e-6  # d ~ 2e-8: fp16 subnormal
    return x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantize_matches_ggml_rule(seed):
    x = activation(seed)
    act = quantize_q8_1(torch.from_numpy(x))
    qs, d, s = ggml_q8_1(x)
    assert act.qs.dtype == torch.int8 and act.d.dtype == torch.float32 and act.s.dtype == torch.float32
    np.testing.assert_array_equal(act.qs.numpy(), qs)
    np.testing.assert_array_equal(act.d.numpy(), d.astype(np.float32))
    np.testing.assert_array_equal(act.s.numpy(), s.astype(np.float32))
    ties = act.qs[64:96].tolist()
    assert ties[-1] == 16 and ties[1] == -15  # 15.5 -> 16, -14.5 -> -15 (torch.round would give 16, -14)


def test_quantize_batched_rows_and_round_trip_bound():
    x = np.stack([activation(seed) for seed in range(4)])  # [4, N]
    act = quantize_q8_1(torch.from_numpy(x))
    assert act.qs.shape == (4, N) and act.d.shape == (4, N // 32)
    for r in range(4):
        assert torch.equal(act.qs[r], quantize_q8_1(torch.from_numpy(x[r])).qs)
    d32 = np.abs(x.reshape(4, -1, 32)).max(-1).astype(np.float32) / np.float32(127)
    bound = d32 * (0.5 + 2**-16) + 127 * np.maximum(2**-11 * d32, 2**-25)
    err = np.abs(act.dequantize().numpy().astype(np.float64) - x).reshape(4, -1, 32)
    assert (err <= bound[..., None]).all()


def test_to_bytes_is_ggml_block_layout():
    x = activation(5)[:64]
    act = quantize_q8_1(torch.from_numpy(x))
    qs, d, s = ggml_q8_1(x)
    dtype = np.dtype([("d", "<f2"), ("s", "<f2"), ("qs", "i1", 32)])
    expected = np.zeros(2, dtype)
    expected["d"], expected["s"], expected["qs"] = d, s, qs.reshape(2, 32)
    assert act.to_bytes().numpy().tobytes() == expected.tobytes()


@pytest.mark.parametrize(
    "x",
    [
        np.full(32, np.inf),
        np.full(32, np.nan),
        np.ones(48),
        np.ones(0),
        np.full(32, 1e7),
        np.full(32, 3000.0),
    ],
    ids=["inf", "nan", "len48", "empty", "d-overflow", "s-overflow"],
)
def test_quantize_refuses(x):
    with pytest.raises(FormatError):
        quantize_q8_1(torch.tensor(x, dtype=torch.float32))


def test_quantize_refuses_integers():
    with pytest.raises(FormatError):
        quantize_q8_1(torch.ones(32, dtype=torch.int32))


# ---------------------------------------------------------------- dot products


def weight_bytes(name: str, seed: int) -> np.ndarray:
    """uint8 [ROWS, row_bytes]: gguf-quantised random weights, or for the others random bytes whose fp16
    d/dmin fields hold random finite values of either sign (magnitudes 1e-4..1), one zero, one subnormal."""
    rng = np.random.default_rng(100 + seed)
    fmt = FORMATS[name]
    if name in GGUF_QUANTISED:
        w = (rng.standard_normal((ROWS, N)) * 10.0 ** rng.uniform(-2, 1, (ROWS, 1))).astype(np.float32)
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType(fmt.ggml_type))
    n_blocks = ROWS * N // fmt.block_size
    blocks = rng.integers(0, 256, size=(n_blocks, fmt.block_bytes), dtype=np.uint8)
    for offset in FP16_SCALES[name]:
        vals = (rng.choice([-1, 1], n_blocks) * 10.0 ** rng.uniform(-4, 0, n_blocks)).astype(np.float16)
        vals[0], vals[1] = 0, np.float16(3e-6)
        blocks[:, offset : offset + 2] = vals.astype("<f2").view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(ROWS, -1)


def gguf_weights(name: str, data: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType(FORMATS[name].ggml_type)).astype(np.float64)


def s_terms(name: str, data: np.ndarray, act, d32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For the formats whose dot uses s: per row, the exact sum_b c_b (s_b - d8_b sum(qs_b)) by which
    dot_q8_1 differs from the dot with the dequantised activation (c_b the coefficient of s_b: -8 d_b
    for q4_0, -16 d_b for q5_0, the min m_b for q4_1 and q5_1), and its bound; 0 for the others."""
    blocks = torch.from_numpy(data).reshape(ROWS, -1, FORMATS[name].block_bytes)
    if name in ("q4_0", "q5_0"):
        d = (dequant.unpack_q4_0 if name == "q4_0" else dequant.unpack_q5_0)(blocks)[0]
        c = d.double().numpy() * (-8 if name == "q4_0" else -16)
    elif name in ("q4_1", "q5_1"):
        c = (dequant.unpack_q4_1 if name == "q4_1" else dequant.unpack_q5_1)(blocks)[1].double().numpy()
    else:
        return 0.0, 0.0
    qsum = act.qs.numpy().reshape(-1, 32).sum(-1).astype(np.float64)
    d8, s = act.d.numpy().astype(np.float64), act.s.numpy().astype(np.float64)
    exact = (c * (s - d8 * qsum)).sum(-1)
    bound = (np.abs(c) * (2**-10 * d32 * np.abs(qsum) + 2**-24 * (np.abs(qsum) + 1))).sum(-1)
    return exact, bound


@pytest.mark.parametrize("name", DOT_FORMATS)
@pytest.mark.parametrize("seed", [0, 1])
def test_dot_against_gguf_float_dot(name, seed):
    data = weight_bytes(name, seed)
    x = activation(seed)
    act = quantize_q8_1(torch.from_numpy(x))
    d32 = (np.abs(x.reshape(-1, 32)).max(-1).astype(np.float32) / np.float32(127)).astype(np.float64)
    w = gguf_weights(name, data)  # [R, N]
    a = act.dequantize().numpy().astype(np.float64)
    ours = dot_q8_1(name, torch.from_numpy(data), act).numpy().astype(np.float64)
    assert ours.shape == (ROWS,)

    s_exact, s_bound = s_terms(name, data, act, d32)

    # Against the dequantised q8_1 activation: the same numbers, up to float32 rounding.
    tol_a = 1e-6 * (np.abs(w) @ np.abs(a))
    err_a = np.abs(ours - (w @ a + s_exact))
    assert (err_a <= tol_a).all(), (err_a / tol_a).max()

    # Against the float activation: within the quantisation bound.
    e = np.repeat(d32 * (0.5 + 2**-16) + 127 * np.maximum(2**-11 * d32, 2**-25), 32)
    bound = np.abs(w) @ e + s_bound + 1e-5 * (np.abs(w) @ np.abs(x.astype(np.float64)))
    err = np.abs(ours - w @ x.astype(np.float64))
    assert (err <= bound).all(), (err / bound).max()


def test_matvec_is_dot_per_activation_row():
    data = torch.from_numpy(weight_bytes("q4_k", 3))
    q = QTensor.from_bytes("q4_k", (ROWS, N), data)
    x = torch.from_numpy(np.stack([activation(7), activation(8)]))
    out = matvec_q8_1(q, x)
    assert out.shape == (2, ROWS) and out.dtype == torch.float32
    for r in range(2):
        assert torch.equal(out[r], dot_q8_1("q4_k", data, quantize_q8_1(x[r])))


def test_dot_refuses_bad_inputs():
    act = quantize_q8_1(torch.from_numpy(activation(0)))
    good = torch.from_numpy(weight_bytes("q8_0", 0))
    with pytest.raises(FormatError):
        dot_q8_1("iq2_xxs", good, act)
    with pytest.raises(FormatError):
        dot_q8_1("mxfp4_gpt_oss", good, act)
    with pytest.raises(FormatError):
        dot_q8_1("q8_0", good[:, :-34], act)
    with pytest.raises(FormatError):
        dot_q8_1("q8_0", good.to(torch.int8), act)
    with pytest.raises(FormatError):
        dot_q8_1("q4_k", torch.zeros(1, 144 * 2, dtype=torch.uint8), quantize_q8_1(torch.ones(2, 512)))
    with pytest.raises(FormatError):  # 96 elements is not a whole q4_k super-block
        dot_q8_1("q4_k", torch.zeros(1, 144, dtype=torch.uint8), quantize_q8_1(torch.ones(96)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", DOT_FORMATS)
def test_cuda_matches_cpu(name):
    x = torch.from_numpy(activation(4))
    data = torch.from_numpy(weight_bytes(name, 4))
    cpu_act, gpu_act = quantize_q8_1(x), quantize_q8_1(x.cuda())
    for field in ("qs", "d", "s"):
        assert torch.equal(getattr(gpu_act, field).cpu(), getattr(cpu_act, field))
    cpu = dot_q8_1(name, data, cpu_act)
    gpu = dot_q8_1(name, data.cuda(), gpu_act).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=1e-5, atol=1e-6 * cpu.abs().max().item())
