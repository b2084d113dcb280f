"""moerun.cpu's prefill GEMM (integer mode, many tokens): bit for bit what the row kernels give for
the same rows (T = 1 decode included), so prefill and decode agree; near the exact integer sums of
moerun.cpu.reference; the same bits with 1 or 2 threads and at odd buffer alignments; token counts
that are not a multiple of the 4-token micro-kernel and row counts not a multiple of its rows."""

import pytest
import torch
from test_cpu_kernels import REL_BOUND, _offset_copy, make_weight, make_x

from moerun import cpu
from moerun.cpu import reference as ref
from moerun.quant.formats import get_format

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"native CPU kernels: {cpu.unavailable_reason()}")

GEMM_FORMATS = sorted(cpu.gemm_formats()) if cpu.available() else []
T_GEMM = 67  # above every format's GEMM threshold (64 at most), not a multiple of 4 tokens


def _n(fmt_name: str) -> int:
    # 512: two super-blocks; 224 = 7 blocks of 32 (pairs plus an odd one; q4_0 / mxfp4 take groups
    # of 4 and 3 leftovers, each its own unit)
    return 512 if get_format(fmt_name).block_size == 256 else 224


def bits(y: torch.Tensor) -> torch.Tensor:
    return y.view(torch.int32)


def test_gemm_covers_the_prefill_formats_where_avx512_runs():
    if "avx512" in cpu.library.runnable_variants():
        lanes = {"q4_1", "q5_0", "q5_1", "iq4_nl", "iq4_xs", "tq1_0", "tq2_0"}
        grids = {"iq3_xxs", "iq3_s", "iq2_xxs", "iq2_xs", "iq2_s", "iq1_s", "iq1_m"}
        assert {"q4_k", "q6_k", "q8_0", "mxfp4"} | lanes | grids <= cpu.gemm_formats("avx512")
    assert cpu.gemm_formats("generic") == frozenset()


@pytest.mark.parametrize("fmt_name", GEMM_FORMATS)
def test_gemm_equals_row_kernels_and_decode_bitwise(fmt_name):
    n = _n(fmt_name)
    w, x = make_weight(fmt_name, out=37, n=n), make_x(T_GEMM, n)  # 37 rows: 9 groups of 4 and 1
    y = cpu.matmul(fmt_name, w, x, integer=True)
    rows = cpu.matmul(fmt_name, w, x, integer=True, gemm=False)
    assert torch.equal(bits(y), bits(rows))
    for t in (0, 1, 33, T_GEMM - 1):  # decode of one token: the T = 1 row kernel
        assert torch.equal(bits(y[t]), bits(cpu.matmul(fmt_name, w, x[t], integer=True)))


@pytest.mark.parametrize("fmt_name", GEMM_FORMATS)
def test_gemm_matches_exact_integer_sums(fmt_name):
    n = _n(fmt_name)
    w, x = make_weight(fmt_name, out=21, n=n), make_x(T_GEMM, n)
    y = cpu.matmul(fmt_name, w, x, integer=True)
    expected, magnitude = ref.matmul_terms(fmt_name, w, x, integer=True)
    assert ((y.double() - expected).abs() <= REL_BOUND * magnitude).all()


@pytest.mark.parametrize(
    "fmt_name",
    [
        "q4_k",
        "q6_k",
        "q8_0",
        "mxfp4",
        "q5_0",
        "iq4_nl",
        "iq4_xs",
        "iq3_xxs",
        "iq3_s",
        "iq2_xxs",
        "iq2_xs",
        "iq2_s",
        "iq1_s",
        "iq1_m",
        "tq2_0",
        "tq1_0",
    ],
)
def test_gemm_bitwise_over_threads_and_alignment(fmt_name):
    if fmt_name not in GEMM_FORMATS:
        pytest.skip(f"no {fmt_name} GEMM in the {cpu.isa()} kernels")
    n = _n(fmt_name)
    w, x = make_weight(fmt_name, out=45, n=n), make_x(T_GEMM, n)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.matmul(fmt_name, w, x, integer=True)
        torch.set_num_threads(2)
        results = [cpu.matmul(fmt_name, w, x, integer=True)]
        for off in (1, 7, 33):
            wo, xo = _offset_copy(w, off), _offset_copy(x, 4 * (off // 4 + 1))
            results.append(cpu.matmul(fmt_name, wo, xo, integer=True))
    finally:
        torch.set_num_threads(threads)
    for y in results:
        assert torch.equal(bits(y), bits(one))


@pytest.mark.parametrize(
    ("fmt_name", "T", "n"),
    [("q8_0", T, 224) for T in (64, 65, 66)]
    + [("q6_k", T, 512) for T in (2, 3, 5, 6)]
    + [("iq4_nl", T, 224) for T in (64, 65, 66)]
    + [("iq1_m", T, 512) for T in (3, 5, 6, 7)]
    + [
        ("q8_0", 300, 2048),
        ("q4_k", 300, 2048),
        ("q6_k", 300, 2048),
        ("q5_1", 300, 2048),
        ("iq4_xs", 300, 2048),
        ("iq3_xxs", 300, 2048),
        ("iq3_s", 300, 2048),
        ("iq2_xxs", 300, 2048),
        ("iq2_xs", 300, 2048),
        ("iq2_s", 300, 2048),
        ("iq1_s", 300, 2048),
        ("iq1_m", 300, 2048),
        ("tq2_0", 300, 2048),
        ("tq1_0", 300, 2048),
    ],
)
def test_gemm_every_token_remainder_and_a_long_prompt(fmt_name, T, n):
    # q8_0 takes the GEMM from 4 tokens: 64..67 tokens cover each remainder of the 4-token
    # micro-kernel, as q6_k's 2..6 (its GEMM from 2 tokens) and iq1_m's 3..7 (from 3); 300 tokens
    # of 2048 inputs pass the activation chunk (~512 KiB: q8_0 84 tokens, q4_k 224, q6_k 200, q5_1
    # 168, iq4_xs and the other q8_K lane formats 192), after which the rows are decoded again
    if fmt_name not in GEMM_FORMATS:
        pytest.skip(f"no {fmt_name} GEMM in the {cpu.isa()} kernels")
    w, x = make_weight(fmt_name, out=10, n=n), make_x(T, n)
    y = cpu.matmul(fmt_name, w, x, integer=True)
    assert torch.equal(bits(y), bits(cpu.matmul(fmt_name, w, x, integer=True, gemm=False)))
