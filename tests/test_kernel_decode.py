"""The Triton decode kernels (moerun.kernels.decode and .decode_q8_1) against their torch references,
and the decode step against the torch backend's `token_rows` + `combine_token` on an ExpertWeights.

Weights live in a tensor with more slots than experts, the experts at permuted slots, so a kernel
reading an expert id where it should read a slot (or the other way round, for the biases) fails.
Shapes are odd (not multiples of the blocks) on the float path. Quantised weights are random bytes
with sane fp16 / E8M0 scales: every bit pattern of the quants and packed sub-block scales occurs.
"""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported; on a GPU the compiled kernels run
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from conftest import rel_err  # noqa: E402
from random_blocks import random_blocks  # noqa: E402

from moerun.activations import GLU, GptOssSwiGLU  # noqa: E402
from moerun.kernels import decode, decode_q8_1  # noqa: E402
from moerun.kernels.weights import KernelWeight, kernel_weight  # noqa: E402
from moerun.moe.backends.torch_backend import combine_token, token_rows  # noqa: E402
from moerun.moe.experts import ExpertWeights  # noqa: E402
from moerun.moe.plan import build_token_plan  # noqa: E402
from moerun.quant import dequant, iquants  # noqa: E402
from moerun.quant.formats import QTensor, get_format  # noqa: E402
from moerun.quant.q8_1 import Q8_1, quantize_q8_1  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, S = 5, 7  # experts, weight slots
PERM = [4, 0, 6, 2, 5]  # slot of expert e
H, I = 97, 45  # float path: odd sizes
SMALL = {"BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4}  # several K steps at these sizes
ACTS = {"silu": GLU("silu"), "gpt_oss": GptOssSwiGLU(alpha=1.702, limit=7.0)}
Q8_1_FORMATS = ["q8_0", "q4_0", "mxfp4", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
Q8_1_FORMATS += ["q4_1", "q5_0", "q5_1", "iq4_nl", "iq4_xs"]
Q8_1_ROWS = decode.ActivationFormat.Q8_1


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _table(k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k distinct experts ascending, their slots, softmax weights (int32, int32, fp32 [k])."""
    gen = _gen(seed)
    experts = torch.randperm(E, generator=gen)[:k].sort().values
    slots = torch.tensor(PERM)[experts]
    weights = torch.softmax(torch.randn(k, generator=gen), 0)
    return experts.int().to(DEVICE), slots.int().to(DEVICE), weights.to(DEVICE)


@functools.cache
def _random_blocks(fmt: str, n: int, k: int, seed: int = 0) -> QTensor:
    """A QTensor [S, n, k] of random bytes whose scale fields hold values that keep |w| near 0.05."""
    return random_blocks(fmt, (S, n, k), _gen(seed), DEVICE)


def _float_weight(fmt: str, n: int, k: int, seed: int = 0) -> KernelWeight:
    if fmt in ("f32", "bf16"):
        w = torch.randn(S, n, k, generator=_gen(seed)) * k**-0.5
        return kernel_weight(w.to(dict(f32=torch.float32, bf16=torch.bfloat16)[fmt]).to(DEVICE))
    return kernel_weight(_random_blocks(fmt, n, k, seed))


def _bias(n: int, with_bias: bool, seed: int = 1) -> torch.Tensor | None:
    return torch.randn(E, n, generator=_gen(seed)).to(DEVICE) if with_bias else None


# ---------------------------------------------------------------- float path


def _float_case(fmt: str) -> tuple[int, int]:
    """(H, I) for a format: odd sizes for floats, whole blocks otherwise."""
    return (H, I) if fmt in ("f32", "bf16") else (256, 256)


FLOAT_FORMATS = ["f32", "bf16", "q8_0", "q4_0", "q4_k", "q6_k", "mxfp4"]
FLOAT_FORMATS += ["q4_1", "q5_0", "q5_1", "iq4_nl", "iq4_xs", "tq1_0", "tq2_0"]
FLOAT_FORMATS += ["iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"]


@pytest.mark.parametrize("fmt", FLOAT_FORMATS)
@pytest.mark.parametrize("k,with_bias", [(1, False), (2, True), (4, True), (4, False)])
def test_gate_up_experts(fmt, k, with_bias):
    hidden, inter = _float_case(fmt)
    w = _float_weight(fmt, 2 * inter, hidden)
    x = torch.randn(hidden, generator=_gen(2)).to(DEVICE)
    experts, slots, _ = _table(k)
    bias = _bias(2 * inter, with_bias)
    config = SMALL if fmt in ("f32", "bf16") else None
    h = decode.gate_up_experts(x, slots, experts, w, bias, config)
    expected = decode.gate_up_experts_reference(x, slots, experts, w, bias)
    # the same fp32 products (bf16 and block values convert exactly), summed in another order
    torch.testing.assert_close(h, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FLOAT_FORMATS)
@pytest.mark.parametrize("k,with_bias", [(1, True), (2, False), (4, True)])
def test_down_experts(fmt, k, with_bias):
    hidden, inter = _float_case(fmt)
    w = _float_weight(fmt, hidden, inter, seed=3)
    a = torch.randn(k, inter, generator=_gen(4)).to(DEVICE)
    experts, slots, weights = _table(k, seed=5)
    bias = _bias(hidden, with_bias)
    config = SMALL if fmt in ("f32", "bf16") else None
    y = decode.down_experts(a, slots, experts, w, bias, weights, config)
    expected = decode.down_experts_reference(a, slots, experts, w, bias, weights)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("k", [1, 4])
def test_activate_weighted(act, k):
    h = (torch.randn(k, 2 * I, generator=_gen(6)) * 4).to(DEVICE)  # past GPT-OSS's limit of 7 too
    weights = torch.rand(k, generator=_gen(7)).to(DEVICE)
    a = decode.activate_weighted(h, weights, ACTS[act], config={"BLOCK_I": 32})
    expected = decode.activate_weighted_reference(h, weights, ACTS[act])
    torch.testing.assert_close(a, expected, rtol=2e-6, atol=1e-6)  # sigmoid / exp differ in ulps


def _assert_q8_1_equal(actual, expected):
    for field in ("qs", "d", "s"):
        assert torch.equal(getattr(actual, field), getattr(expected, field)), field


@pytest.mark.parametrize("act", ACTS)
def test_activate_weighted_q8_1(act):
    inter = 96
    h = (torch.randn(3, 2 * inter, generator=_gen(8)) * 4).to(DEVICE)
    h[1, :] = 0  # a zero row: d = 0 blocks
    weights = torch.rand(3, generator=_gen(9)).to(DEVICE)
    config = {"BLOCK_I": 64}  # the second program's second block lies past I
    a = decode.activate_weighted(h, weights, ACTS[act], config=config)
    aq = decode.activate_weighted(h, weights, ACTS[act], Q8_1_ROWS, config=config)
    _assert_q8_1_equal(aq, quantize_q8_1(a))  # bit-exact ggml quantisation of the kernel's own a
    ref = decode.activate_weighted_reference(h, weights, ACTS[act], Q8_1_ROWS)
    # the reference's a differs in ulps, which can move a quant across a rounding tie
    assert (aq.qs.int() - ref.qs.int()).abs().max() <= 1
    torch.testing.assert_close(aq.d, ref.d, rtol=1e-3, atol=0)


@pytest.mark.filterwarnings("ignore:overflow encountered in divide")  # 1 / d of the 1e-38 block
def test_quantize_rows_q8_1_bit_exact():
    x = torch.randn(2, 8, 32, generator=_gen(10)) * torch.logspace(-3, 3, 8)[:, None]
    x[0, 1] = 0  # zero block
    x[0, 2] = torch.arange(-16, 16) * 0.5 + 0.25  # scaled values hit ties: roundf away from zero
    x[0, 2, 0] = -127 * 0.5 / 1  # amax sets d
    x[0, 3] = 1e-38  # 1 / d overflows: stored as zeros
    x[1, 4] = torch.linspace(-1, 1, 32) * 2.0**-20  # d subnormal in fp16
    x = x.flatten(1).to(DEVICE)
    _assert_q8_1_equal(
        decode_q8_1.quantize_rows_q8_1(x, {"BLOCK_I": 64}), decode_q8_1.quantize_rows_q8_1_reference(x)
    )


@pytest.mark.parametrize("k", [1, 3, 4])
def test_sum_rows_in_order(k):
    y = torch.randn(k, H, generator=_gen(11)).to(DEVICE) * torch.logspace(0, 8, k, device=DEVICE)[:, None]
    out = decode.sum_rows(y, {"BLOCK_H": 32})
    assert torch.equal(out, decode.sum_rows_reference(y))  # bitwise: the same order


# ---------------------------------------------------------------- integer (q8_1) path


def _magnitude(fmt: str, rows: torch.Tensor, act) -> torch.Tensor:
    """Per weight row [R]: the sum over elements of |each float term the dot product scales| times
    |the dequantised activation| (for the formats with mins, |d sc q| + |dmin m| per element;
    q4_0 and q5_0 add 8 or 16 |d s| per block): a bound on every partial sum either computation forms."""
    f = get_format(fmt)
    blocks = rows.reshape(rows.shape[0], -1, f.block_bytes).cpu()
    a = act.dequantize().abs().cpu().reshape(blocks.shape[1], -1)  # [nb, block]
    extra = 0
    if fmt == "q8_0":
        d, q = dequant.unpack_q8_0(blocks)
        w = d.abs()[..., None] * q.float().abs()
    elif fmt == "q4_0":
        d, q = dequant.unpack_q4_0(blocks)
        w = d.abs()[..., None] * (q.float() + 8)
        extra = (8 * d.abs() * act.s.abs().cpu()).sum(-1)
    elif fmt == "q5_0":
        d, q = dequant.unpack_q5_0(blocks)
        w = d.abs()[..., None] * (q.float() + 16)
        extra = (16 * d.abs() * act.s.abs().cpu()).sum(-1)
    elif fmt in ("q4_1", "q5_1"):
        d, m, q = (dequant.unpack_q4_1 if fmt == "q4_1" else dequant.unpack_q5_1)(blocks)
        w = d.abs()[..., None] * q.float() + m.abs()[..., None]
    elif fmt == "iq4_nl":
        d, q = dequant.unpack_iq4_nl(blocks)
        w = d.abs()[..., None] * q.float().abs()
    elif fmt == "iq4_xs":
        d, sc, q = iquants.unpack_iq4_xs(blocks)
        w = (d[..., None] * sc.float()).abs().repeat_interleave(32, -1) * q.float().abs()
    elif fmt == "mxfp4":
        e, codes = dequant.unpack_mxfp4(blocks)
        w = dequant.e8m0_half_scale(e)[..., None] * torch.tensor(dequant.MXFP4_VALUES).abs()[codes.long()]
    elif fmt == "q3_k":
        d, sc, q = dequant.unpack_q3_k(blocks)
        w = (d[..., None] * sc.float()).abs().repeat_interleave(16, -1) * q.float().abs()
    elif fmt == "q2_k":
        d, dmin, sc, m, q = dequant.unpack_q2_k(blocks)
        step = (d[..., None] * sc.float()).abs().repeat_interleave(16, -1)
        w = step * q.float() + (dmin[..., None] * m.float()).abs().repeat_interleave(16, -1)
    elif fmt in ("q4_k", "q5_k"):
        d, dmin, sc, m, q = (dequant.unpack_q4_k if fmt == "q4_k" else dequant.unpack_q5_k)(blocks)
        step = (d[..., None] * sc.float()).abs().repeat_interleave(32, -1)
        w = step * q.float() + (dmin[..., None] * m.float()).abs().repeat_interleave(32, -1)
    else:  # q6_k
        d, sc, q = dequant.unpack_q6_k(blocks)
        w = (d[..., None] * sc.float()).abs().repeat_interleave(16, -1) * q.float().abs()
    return (w * a).sum((-2, -1)) + extra


def _check_dot(actual: torch.Tensor, expected: torch.Tensor, fmt, rows, act) -> None:
    """Both sides form the same int32 sub-block sums exactly; only the float scaling and summing of
    at most ~20 terms per row differ in order: each rounding is 2^-24 relative to a partial sum
    bounded by the row's magnitude, so 1e-5 times it (~170 roundings) is a safe, still tight bound."""
    bound = 1e-5 * _magnitude(fmt, rows, act).to(actual.device)
    assert ((actual - expected).abs() <= bound).all(), ((actual - expected).abs() / bound).max()


def _q8_1_case(fmt: str) -> int:
    """K for an integer-path test: 9 blocks of 32 (a partial step of 256) or 2 super-blocks."""
    return 288 if get_format(fmt).block_size == 32 else 512


@pytest.mark.parametrize("fmt", Q8_1_FORMATS)
@pytest.mark.parametrize("k,with_bias", [(1, False), (4, True)])
def test_gate_up_experts_q8_1(fmt, k, with_bias):
    hidden, n = _q8_1_case(fmt), 40
    q = _random_blocks(fmt, n, hidden)
    w = kernel_weight(q)
    xq = quantize_q8_1(torch.randn(hidden, generator=_gen(12)).to(DEVICE))
    experts, slots, _ = _table(k)
    bias = _bias(n, with_bias)
    h = decode.gate_up_experts(xq, slots, experts, w, bias)
    expected = decode.gate_up_experts_reference(xq, slots, experts, w, bias)
    for i, slot in enumerate(slots.tolist()):
        _check_dot(h[i], expected[i], fmt, q.data[slot], xq)


def test_q8_1_rows_need_a_format_with_an_integer_kernel():
    w = _float_weight("f32", 8, 32)
    assert decode.ActivationFormat.for_weight(w, int8=True) is decode.ActivationFormat.FLOAT
    assert decode.ActivationFormat.for_weight(kernel_weight(_random_blocks("q4_0", 8, 32)), True) is Q8_1_ROWS
    experts, slots, _ = _table(1)
    with pytest.raises(ValueError, match="no q8_1 kernel for f32 weights"):
        decode.gate_up_experts(quantize_q8_1(torch.randn(32).to(DEVICE)), slots, experts, w, None)


@pytest.mark.parametrize("fmt", Q8_1_FORMATS)
def test_down_experts_q8_1(fmt):
    k, inter, n = 3, _q8_1_case(fmt), 24
    q = _random_blocks(fmt, n, inter, seed=1)
    w = kernel_weight(q)
    aq = quantize_q8_1(torch.randn(k, inter, generator=_gen(13)).to(DEVICE))
    experts, slots, weights = _table(k, seed=2)
    bias = _bias(n, True)
    y = decode.down_experts(aq, slots, experts, w, bias, weights, {"BLOCK_N": 8})
    expected = decode.down_experts_reference(aq, slots, experts, w, bias, weights)
    for i, slot in enumerate(slots.tolist()):
        row = Q8_1(aq.qs[i], aq.d[i], aq.s[i])
        _check_dot(y[i], expected[i], fmt, q.data[slot], row)


# ---------------------------------------------------------------- the step against the torch backend


def _step_case(gate_up_fmt: str, down_fmt: str, act: str, with_bias: bool, k: int):
    """(decode_step arguments, token_rows arguments) for one token."""
    hidden, inter = (H, I) if gate_up_fmt in ("f32", "bf16") else (256, 256)
    dtype = torch.bfloat16 if "bf16" in (gate_up_fmt, down_fmt) else torch.float32
    weights_by_slot = []
    for fmt, n, kk, seed in ((gate_up_fmt, 2 * inter, hidden, 20), (down_fmt, hidden, inter, 21)):
        if fmt in ("f32", "bf16"):
            w = torch.randn(S, n, kk, generator=_gen(seed)) * kk**-0.5
            weights_by_slot.append(w.to(dtype).to(DEVICE))
        else:
            weights_by_slot.append(_random_blocks(fmt, n, kk, seed))

    def by_expert(w):  # [S, ...] -> [E, ...]: expert e's weights are those in slot PERM[e]
        if isinstance(w, QTensor):
            return QTensor(w.format, (E, *w.shape[1:]), w.data[PERM])
        return w[PERM]

    biases = (_bias(2 * inter, with_bias, 22), _bias(hidden, with_bias, 23))
    biases = tuple(b if b is None else b.to(dtype) for b in biases)
    experts_w = ExpertWeights(*map(by_expert, weights_by_slot), biases, dtype=dtype, layer_name="decode")
    x = torch.randn(hidden, generator=_gen(24)).to(dtype).float().to(DEVICE)
    experts, slots, weights = _table(k, seed=25)
    plan = build_token_plan(experts.long().cpu().flip(0), weights.cpu().flip(0))  # sorts them back
    assert plan.experts == experts.tolist()
    gate_up, down = map(kernel_weight, weights_by_slot)
    layer = decode.LayerWeights(gate_up, down, *biases)
    step = (x, slots, experts, plan.weights.to(DEVICE), layer, ACTS[act])
    return step, (x, plan, experts_w, ACTS[act])


@pytest.mark.parametrize(
    "gate_up_fmt,down_fmt,act,with_bias,k,tol",
    [
        ("f32", "f32", "silu", False, 2, 1e-5),
        ("f32", "f32", "gpt_oss", True, 4, 1e-5),
        ("bf16", "bf16", "gpt_oss", True, 1, 2e-2),  # the torch backend rounds h and y to bf16
        ("bf16", "bf16", "silu", False, 4, 2e-2),
    ],
)
def test_decode_step_float(gate_up_fmt, down_fmt, act, with_bias, k, tol):
    step, ref = _step_case(gate_up_fmt, down_fmt, act, with_bias, k)
    out = decode.decode_step(*step, config={"gate_up": SMALL, "down": SMALL})
    expected = combine_token(token_rows(*ref))
    assert rel_err(out, expected) < tol
    assert torch.equal(out, decode.decode_step(*step, config={"gate_up": SMALL, "down": SMALL}))


@pytest.mark.parametrize(
    "gate_up_fmt,down_fmt,act",
    [
        ("q4_k", "q6_k", "silu"),
        ("q6_k", "q8_0", "gpt_oss"),
        ("q8_0", "f32", "silu"),  # f32: float a
        ("iq4_xs", "q5_1", "silu"),
        ("q4_1", "iq4_nl", "gpt_oss"),
        ("q5_0", "iq2_s", "silu"),  # iq2_s: float a
    ],
)
def test_decode_step_q8_1(gate_up_fmt, down_fmt, act):
    step, ref = _step_case(gate_up_fmt, down_fmt, act, True, 2)
    out = decode.decode_step(*step, use_q8_1=True)
    # the integer chain against its references: q8_1 rounding of x and a is the same bar ties
    assert rel_err(out, decode.decode_step_reference(*step, use_q8_1=True)) < 1e-4
    # against float activations: each q8_1 value is off by up to half a step (1/254 of its block max)
    assert rel_err(out, combine_token(token_rows(*ref))) < 2e-2


@pytest.mark.parametrize(
    "gate_up_fmt,down_fmt", [("q4_k", "q6_k"), ("iq2_xxs", "q5_1"), ("iq4_xs", "iq1_m"), ("tq1_0", "iq3_s")]
)
def test_decode_step_quantised_float_path(gate_up_fmt, down_fmt):
    step, ref = _step_case(gate_up_fmt, down_fmt, "silu", True, 2)
    assert rel_err(decode.decode_step(*step), combine_token(token_rows(*ref))) < 1e-5


def test_decode_step_q8_1_takes_floats_for_formats_without_an_integer_kernel():
    """With use_q8_1, a projection whose format has no q8_1 kernel (iq2_s, tq2_0) reads float activations:
    the step is the float step's, bit for bit, when neither projection has one."""
    step, _ = _step_case("iq2_s", "tq2_0", "gpt_oss", True, 2)
    assert torch.equal(decode.decode_step(*step, use_q8_1=True), decode.decode_step(*step))
    step, _ = _step_case("q4_k", "iq2_s", "silu", False, 2)  # gate_up integer, down float
    out = decode.decode_step(*step, use_q8_1=True)
    assert rel_err(out, decode.decode_step_reference(*step, use_q8_1=True)) < 1e-4
