"""moerun.cpu's matmul and activation quantisers against independent references, per format, ISA
variant and mode: exact mode against float64 dequantize(...) @ x (dequant checked against the gguf
package here too); integer mode against exact integer sums (moerun.cpu.reference) with the error
bound of fp32 scale arithmetic; bitwise reproducibility over thread counts and buffer alignments."""

import functools

import gguf
import numpy as np
import pytest
import torch

from moerun import cpu
from moerun.cpu import library
from moerun.cpu import reference as ref
from moerun.quant import dequant
from moerun.quant.formats import FLOAT_DTYPES, get_format
from moerun.quant.formats import FORMATS as QUANT_FORMATS
from moerun.quant.quantize import BLOCK_QUANTIZERS, quantize_rows
from moerun.quant.scales import FP16_SCALES

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"native CPU kernels: {cpu.unavailable_reason()}")

FORMATS = list(QUANT_FORMATS)  # every format moerun reads (the one table of formats)
VARIANTS = library.runnable_variants() if cpu.available() else ["generic"]
OUT, IN = 37, 512  # 37 rows: not a multiple of any thread split; 512: 2 super-blocks, 16 small blocks
# fp32 sums of at most IN / 16 + 64 terms, each rounded once or twice: well inside 1e-5 of the
# sum of the terms' absolute values
REL_BOUND = 1e-5


def random_blocks(fmt_name: str, out: int, n: int, seed: int) -> torch.Tensor:
    """uint8 [out, row_bytes] of random blocks: every byte random (any bytes are valid codes, grid
    indices, signs and scales), the fp16 scales random with magnitudes in [2^-10, 2^-9]."""
    fmt = get_format(fmt_name)
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(out * n // fmt.block_size, fmt.block_bytes), dtype=np.uint8)
    scales = rng.uniform(1, 2, size=(blocks.shape[0], 2)) * rng.choice([-1, 1], size=(blocks.shape[0], 2))
    bits = (scales * 2.0**-10).astype(np.float16).view(np.uint16)
    if fmt_name == "iq1_m":
        words = blocks[:, 48:56].copy().view("<u2")  # [nb, 4]
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | ((bits[:, 0] >> (4 * k)) & 0xF) << 12
        blocks[:, 48:56] = words.view(np.uint8)
    for i, at in enumerate(FP16_SCALES.get(fmt_name, ())):  # iq1_m has none: set above
        blocks[:, at : at + 2] = bits[:, i : i + 1].astype("<u2").view(np.uint8)
    return torch.from_numpy(blocks.reshape(out, -1))


@functools.cache
def make_weight(fmt_name: str, out: int = OUT, n: int = IN, seed: int = 0) -> torch.Tensor:
    """Weights as a quantiser writes them: uint8 [out, row_bytes] (float formats: their dtype), or
    random valid blocks for the formats moerun cannot quantise yet. Cached: callers must not write
    to them."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n, generator=g) * 0.05
    if fmt_name in FLOAT_DTYPES:
        return w.to(FLOAT_DTYPES[fmt_name])
    if fmt_name not in BLOCK_QUANTIZERS:
        return random_blocks(fmt_name, out, n, seed)
    # mxfp4_gpt_oss holds the same 17-byte blocks with another nibble order: any bytes are valid
    return quantize_rows(get_format("mxfp4" if fmt_name == "mxfp4_gpt_oss" else fmt_name), w)


def make_x(T: int, n: int = IN, seed: int = 1) -> torch.Tensor:
    return torch.randn(T, n, generator=torch.Generator().manual_seed(seed))


def as_bytes(w: torch.Tensor) -> torch.Tensor:
    return w if w.dtype == torch.uint8 else w.view(torch.uint8)


@pytest.mark.parametrize("fmt_name", [f for f in FORMATS if f not in ("f32", "mxfp4_gpt_oss")])
def test_dequant_of_test_weights_matches_gguf(fmt_name):
    w = as_bytes(make_weight(fmt_name))
    qtype = gguf.GGMLQuantizationType[fmt_name.upper()]
    theirs = gguf.quants.dequantize(w.numpy(), qtype)
    ours = dequant.dequantize_bytes(get_format(fmt_name), w).numpy()
    assert np.array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("T", [1, 3, 16])
def test_exact_mode_matches_float64_dequantized_product(variant, fmt_name, T):
    w, x = make_weight(fmt_name), make_x(T)
    y = cpu.matmul(fmt_name, w, x, integer=False, variant=variant)
    wd = dequant.dequantize_bytes(get_format(fmt_name), as_bytes(w)).double()
    expected, magnitude = x.double() @ wd.T, x.double().abs() @ wd.abs().T
    assert y.shape == (T, OUT) and y.dtype == torch.float32
    assert ((y.double() - expected).abs() <= REL_BOUND * magnitude).all()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("T", [1, 3, 16])
def test_integer_mode_matches_exact_integer_sums(variant, fmt_name, T):
    w, x = make_weight(fmt_name), make_x(T)
    y = cpu.matmul(fmt_name, w, x, integer=True, variant=variant)
    expected, magnitude = ref.matmul_terms(fmt_name, w, x, integer=True)
    assert ((y.double() - expected).abs() <= REL_BOUND * magnitude).all()
    if fmt_name not in FLOAT_DTYPES:  # and it is a real q8 product: close to, not equal to, exact
        exact = x.double() @ dequant.dequantize_bytes(get_format(fmt_name), w).double().T
        err = (y.double() - exact).abs().max() / exact.abs().max()
        assert 1e-5 < err < 0.05


def test_q8_0_activations_match_gguf():
    x = make_x(4, 256)
    x[0, :32] = 0  # an all-zero block
    x[1, :32] = torch.arange(32) * 0.5  # values landing on .5 ties
    blocks = cpu.quantize(x, "q8_0").view(4, 8, 40)
    theirs = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(4, 8, 34)
    qs = blocks[..., 8:].contiguous().view(torch.int8)
    assert np.array_equal(qs.numpy(), theirs[..., 2:].view(np.int8))
    d = blocks[..., :4].contiguous().view(torch.float32)[..., 0]
    assert np.array_equal(d.numpy(), theirs[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    sums = blocks[..., 4:8].contiguous().view(torch.int32)[..., 0]
    assert torch.equal(sums, qs.sum(-1, dtype=torch.int32))


def test_q8_k_activations_follow_ggml_rounding():
    x = make_x(3, 512)
    x[0, :256] = 0
    x[1, :256] = torch.linspace(-127, 127, 256) / 127 * 3  # scale 3/127: many exact ties
    x[2, 7] = -50.0  # a negative peak: iscale = -127 / max keeps the sign convention
    blocks = cpu.quantize(x, "q8_k").view(3, 2, 292)
    d, qs, bsums = ref.quantize_q8_k(x)
    assert torch.equal(blocks[..., :4].contiguous().view(torch.float32)[..., 0], d)
    assert torch.equal(blocks[..., 4:260].contiguous().view(torch.int8).reshape(3, 512), qs)
    assert torch.equal(blocks[..., 260:].contiguous().view(torch.int16).reshape(3, 32).long(), bsums)
    # ties round to even (ggml's nearest_int), e.g. 2.5 -> 2, -0.5 -> 0
    tie = torch.tensor([[2.5, -0.5, 1.5] + [0.0] * 252 + [127.0]])
    q = cpu.quantize(tie, "q8_k")[0, 4:260].view(torch.int8)
    assert q[:3].tolist() == [-2, 0, -2] and q[255] == -127


def _offset_copy(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of t whose data starts `offset` bytes past a 64-byte boundary."""
    raw = torch.empty(t.numel() * t.element_size() + 128, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 64 + offset
    view = raw[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("integer", [False, True])
def test_bitwise_same_over_threads_and_alignment(variant, fmt_name, integer):
    w, x = make_weight(fmt_name), make_x(3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.matmul(fmt_name, w, x, integer, variant)
        torch.set_num_threads(2)
        two = cpu.matmul(fmt_name, w, x, integer, variant)
        again = cpu.matmul(fmt_name, w, x, integer, variant)
        moved = []
        for off in (1, 7, 33, 63):
            wo = _offset_copy(as_bytes(w), off)  # float weights too, as their raw bytes
            xo = _offset_copy(x, 4 * (off // 4))  # torch views of float32 need 4-byte steps
            moved.append(cpu.matmul(fmt_name, wo, xo, integer, variant))
    finally:
        torch.set_num_threads(threads)
    for y in (two, again, *moved):
        assert torch.equal(y.view(torch.int32), one.view(torch.int32))


@pytest.mark.parametrize("fmt_name", ["bf16", "q4_k", "q8_0", "q5_1", "iq4_xs", "iq2_xxs"])
@pytest.mark.parametrize("integer", [False, True])
def test_prefill_sized_batches_tile_correctly(fmt_name, integer):
    w, x = make_weight(fmt_name, out=300, n=256), make_x(41, 256)  # 41 tokens: 16 + 16 + 9
    y = cpu.matmul(fmt_name, w, x, integer)
    expected, magnitude = ref.matmul_terms(fmt_name, w, x, integer)
    assert ((y.double() - expected).abs() <= REL_BOUND * magnitude).all()


def test_one_dimensional_x_and_bad_input():
    w, x = make_weight("q4_k"), make_x(1)
    assert torch.equal(cpu.matmul("q4_k", w, x[0]), cpu.matmul("q4_k", w, x)[0])
    with pytest.raises(ValueError, match="multiple of 256"):
        cpu.matmul("q4_k", w[:, :100], make_x(1, 100))
    with pytest.raises(ValueError, match="take 144 bytes"):
        cpu.matmul("q4_k", w, make_x(1, 256))
    with pytest.raises(TypeError, match="float32"):
        cpu.matmul("q4_k", w, x.double())


@pytest.mark.parametrize("fmt_name", [f for f in FORMATS if get_format(f).block_size > 1])
def test_rows_of_partial_blocks_are_refused(fmt_name):
    block = get_format(fmt_name).block_size
    w = make_weight(fmt_name)
    with pytest.raises(ValueError, match=f"multiple of {block}"):
        cpu.matmul(fmt_name, w, make_x(1, block + 16))
    with pytest.raises(ValueError, match=f"multiple of {block}"):
        cpu.dequantize_rows(fmt_name, w, block + 16, torch.tensor([0]))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    ("fmt_name", "n"),
    [(f, 224) for f in ("q8_0", "q4_0", "mxfp4", "mxfp4_gpt_oss", "q4_1", "q5_0", "q5_1", "iq4_nl")]
    + [(f, 200) for f in ("f32", "f16", "bf16")],
)
@pytest.mark.parametrize("integer", [False, True])
def test_rows_whose_blocks_leave_a_remainder(variant, fmt_name, n, integer):
    # 224 = 7 blocks of 32 (kernels take 2 or 4 blocks at a time); 200 floats = 6 x 32 + 8
    w, x = make_weight(fmt_name, out=19, n=n), make_x(3, n)
    y = cpu.matmul(fmt_name, w, x, integer, variant)
    expected, magnitude = ref.matmul_terms(fmt_name, w, x, integer)
    assert ((y.double() - expected).abs() <= REL_BOUND * magnitude).all()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_exact_mode_decodes_weights_bit_exactly(variant, fmt_name):
    # x = one-hot rows: each output is one weight times 1 plus zeros, so it is that weight's value
    # exactly, which must equal dequant.py's (bit-exact against the gguf package) bit for bit
    w = make_weight(fmt_name)
    cols = torch.randperm(IN, generator=torch.Generator().manual_seed(2))[:16]
    x = torch.zeros(16, IN)
    x[torch.arange(16), cols] = 1.0
    y = cpu.matmul(fmt_name, w, x, integer=False, variant=variant)
    expected = dequant.dequantize_bytes(get_format(fmt_name), as_bytes(w))[:, cols].T
    assert torch.equal(y, expected)  # == treats -0 and +0 alike; everything else bit for bit


# Formats that give the same bits in every variant, in both modes (their SIMD kernels compute the
# generic C's exact int32 sums, or its decoded values and 16 lanes, and its fp32 steps in its order)
SAME_BITS_IN_EVERY_VARIANT = ["q4_1", "q5_0", "q5_1", "iq4_nl", "iq4_xs", "iq3_s", "iq3_xxs", "iq2_xxs"]
SAME_BITS_IN_EVERY_VARIANT += ["iq2_xs", "iq2_s", "iq1_s", "iq1_m", "tq1_0", "tq2_0"]


@pytest.mark.parametrize("fmt_name", SAME_BITS_IN_EVERY_VARIANT)
@pytest.mark.parametrize("T", [1, 2, 3, 16])  # 1 and 2: row kernels with their own paths (tq1_0, tq2_0)
@pytest.mark.parametrize("integer", [False, True])
def test_the_same_bits_in_every_variant(fmt_name, T, integer):
    n = 224 if get_format(fmt_name).block_size == 32 else IN  # 224: 7 blocks, a group of 4 and 3 left
    w, x = make_weight(fmt_name, n=n), make_x(T, n)
    generic = cpu.matmul(fmt_name, w, x, integer, variant="generic")
    for variant in VARIANTS:
        y = cpu.matmul(fmt_name, w, x, integer, variant=variant)
        assert torch.equal(y.view(torch.int32), generic.view(torch.int32)), variant


def test_dispatch_picks_the_best_variant_this_cpu_runs():
    assert cpu.isa() == VARIANTS[-1]
    assert library.pick_variant(frozenset(), None) == "generic"
    assert library.pick_variant(frozenset(library.REQUIRED["avx512"]), "avx2") == "avx2"


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_dequantized_rows_are_the_dequantisers_values_bit_for_bit(fmt_name):
    """The embedding lookup of a quantised table (cpu.dequantize_rows) against dequant.py (itself
    equal to the gguf package's, above), on rows out of order and repeated."""
    w = make_weight(fmt_name)
    rows = torch.tensor([5, 0, 36, 5, 17])
    ours = cpu.dequantize_rows(fmt_name, w, IN, rows)
    if fmt_name in FLOAT_DTYPES:
        want = w[rows].float()
    else:
        want = dequant.dequantize_bytes(get_format(fmt_name), w[rows])
    assert torch.equal(ours.view(torch.int32), want.view(torch.int32))
    with pytest.raises(IndexError, match="rows"):
        cpu.dequantize_rows(fmt_name, w, IN, torch.tensor([OUT]))
