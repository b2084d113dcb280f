"""moerun.cpu.moe_decode against the torch reference (dequantised experts, moerun's GLU and
GPT-OSS activations, the weighted sum in each token's expert order); its bitwise reproducibility;
the build's fallback when the compiler fails; MOERUN_CPU_ISA; the shared OpenMP pool."""

import functools
import os
import subprocess
import sys

import pytest
import torch
from test_cpu_kernels import VARIANTS, make_weight, make_x

from moerun import cpu
from moerun.activations import GLU, GptOssSwiGLU
from moerun.cpu import library
from moerun.cpu import reference as ref

needs_native = pytest.mark.skipif(
    not cpu.available(), reason=f"native CPU kernels: {cpu.unavailable_reason()}"
)
H, I, E, K = 256, 256, 5, 3


@functools.cache
def make_step(gu_fmt, down_fmt, T, biases=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = [(gu_fmt, make_weight(gu_fmt, 2 * I, H, seed=10 + e)) for e in range(E)]
    down = [(down_fmt, make_weight(down_fmt, H, I, seed=20 + e)) for e in range(E)]
    slot_expert = torch.stack([torch.randperm(E, generator=g)[:K].sort().values for _ in range(T)]).int()
    slot_weight = torch.rand(T, K, generator=g)
    gub = [torch.randn(2 * I, generator=g) * 0.1 for _ in range(E)] if biases else None
    db = [torch.randn(H, generator=g) * 0.1 for _ in range(E)] if biases else None
    return make_x(T, H), gate_up, down, slot_expert, slot_weight, gub, db


CASES = [
    ("q4_k", "q6_k", GLU("silu"), False),
    ("q8_0", "q8_0", GLU("gelu"), False),
    ("q4_0", "q5_k", GLU("gelu_tanh"), False),
    ("mxfp4_gpt_oss", "mxfp4_gpt_oss", GptOssSwiGLU(), True),
    ("mxfp4", "q2_k", GptOssSwiGLU(alpha=1.5, limit=0.5), True),
    ("bf16", "q3_k", GLU("silu"), True),
    ("iq4_xs", "q5_0", GLU("silu"), False),
    ("q4_1", "iq2_xxs", GLU("gelu"), True),
    ("iq3_s", "tq2_0", GLU("silu"), False),
]


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("gu_fmt", "down_fmt", "act", "biases"), CASES)
@pytest.mark.parametrize("T", [1, 16])
def test_exact_moe_decode_matches_torch_reference(variant, gu_fmt, down_fmt, act, biases, T):
    x, gu, dn, se, sw, gub, db = make_step(gu_fmt, down_fmt, T, biases)
    out = cpu.moe_decode(x, gu, dn, (se, sw), act, False, (gub, db), variant=variant)
    expected = ref.moe_decode(x, gu, dn, (se, sw), act, False, (gub, db))
    # fp32 sums over H and I elements and fp32 activations: a few 1e-6 of the output's scale
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("gu_fmt", "down_fmt", "act", "biases"), CASES)
@pytest.mark.parametrize("T", [1, 8])
def test_integer_moe_decode_matches_integer_reference(variant, gu_fmt, down_fmt, act, biases, T):
    x, gu, dn, se, sw, gub, db = make_step(gu_fmt, down_fmt, T, biases)
    out = cpu.moe_decode(x, gu, dn, (se, sw), act, True, (gub, db), variant=variant)
    expected = ref.moe_decode(x, gu, dn, (se, sw), act, True, (gub, db))
    # The activation is computed from fp32 gate_up outputs (reference: float64) and re-quantised, so
    # an element within rounding of a q8 step may land one step apart: allow 8 such steps per token,
    # each at most max|down weight| * the block's step (max|a| / 127) * the slot weight.
    exact = ref.moe_decode(x, gu, dn, (se, sw), act, False, (gub, db))
    step = 8 * max(float(cpu_dense(d).abs().max()) for d in dn) * float(exact.abs().max() + 1) / 127
    err = (out.double() - expected).abs().max()
    assert err <= 1e-5 * float(expected.abs().max()) + step
    assert (out.double() - exact).abs().max() < 0.05 * exact.abs().max()  # and it is near the exact value


@needs_native
@pytest.mark.parametrize(
    ("gu_fmt", "down_fmt"),
    [
        ("iq4_xs", "q5_0"),
        ("q4_1", "iq4_nl"),
        ("iq3_s", "q5_1"),
        ("iq2_xxs", "iq4_xs"),
        ("iq1_s", "tq2_0"),
        ("tq1_0", "iq1_s"),
        ("iq3_xxs", "iq2_xs"),
        ("iq2_s", "iq1_m"),
        ("iq1_m", "iq3_xxs"),
    ],
)
def test_integer_moe_decode_gemm_experts_equal_row_kernels_bitwise(gu_fmt, down_fmt):
    # 24 tokens, 3 of 5 experts each: every expert gets more tokens than its formats' GEMM threshold
    # (4 at most), so the step takes the GEMM for each; it must give the row kernels' bits
    if not {gu_fmt, down_fmt} <= cpu.gemm_formats():
        pytest.skip(f"no {gu_fmt} / {down_fmt} GEMM in the {cpu.isa()} kernels")
    x, gu, dn, se, sw, _, _ = make_step(gu_fmt, down_fmt, 24)
    assert int(torch.bincount(se.flatten().long(), minlength=E).min()) > 4
    y = cpu.moe_decode(x, gu, dn, (se, sw), GLU("silu"), True)
    rows = cpu.moe_decode(x, gu, dn, (se, sw), GLU("silu"), True, gemm=False)
    assert torch.equal(y.view(torch.int32), rows.view(torch.int32))


def cpu_dense(weight):
    from moerun.quant import dequant
    from moerun.quant.formats import get_format

    fmt, data = weight
    return dequant.dequantize_bytes(
        get_format(fmt), data if data.dtype == torch.uint8 else data.view(torch.uint8)
    )


@needs_native
@pytest.mark.parametrize("integer", [False, True])
def test_moe_decode_bitwise_over_threads_and_resident_vs_copied_weights(integer):
    x, gu, dn, se, sw, gub, db = make_step("q4_k", "q6_k", 8)
    resident_gu = torch.stack([d for _, d in gu])  # [E, 2I, row_bytes]
    resident_dn = torch.stack([d for _, d in dn])
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(
                cpu.moe_decode(
                    x,
                    [("q4_k", resident_gu[e]) for e in range(E)],
                    [("q6_k", resident_dn[e]) for e in range(E)],
                    (se, sw),
                    GLU(),
                    integer,
                )
            )
        for off in (3, 17):
            moved = []
            for _, d in gu + dn:
                raw = torch.empty(d.numel() + 64, dtype=torch.uint8)
                moved.append(raw[off : off + d.numel()].view(d.shape))
                moved[-1].copy_(d)
            results.append(
                cpu.moe_decode(
                    x,
                    [("q4_k", m) for m in moved[:E]],
                    [("q6_k", m) for m in moved[E:]],
                    (se, sw),
                    GLU(),
                    integer,
                )
            )
    finally:
        torch.set_num_threads(threads)
    for r in results[1:]:
        assert torch.equal(r.view(torch.int32), results[0].view(torch.int32))


@needs_native
def test_moe_decode_refuses_an_out_of_range_expert():
    x, gu, dn, se, sw, _, _ = make_step("q8_0", "q8_0", 1)
    with pytest.raises(ValueError, match="index the 5 experts"):
        cpu.moe_decode(x, gu, dn, (se + 10, sw), GLU())


def _child(env_extra: dict[str, str], code: str) -> subprocess.CompletedProcess:
    # the parent's build dir (MOERUN_CPU_BUILD_DIR) is kept, so the child finds the libraries built
    env = {k: v for k, v in os.environ.items() if k not in ("MOERUN_CPU_ISA", "CC")} | env_extra
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_failing_compiler_reports_one_line_and_unavailable(tmp_path):
    done = _child(
        {"CC": "false", "MOERUN_CPU_BUILD_DIR": str(tmp_path)},
        "from moerun import cpu; print(cpu.available()); print(cpu.unavailable_reason())",
    )
    assert done.returncode == 0, done.stderr
    available, reason = done.stdout.splitlines()
    assert available == "False" and "could not be built" in reason and "false" in reason
    lines = [line for line in done.stderr.splitlines() if "native CPU kernels" in line]
    assert len(lines) == 1 and "Using the torch path." in lines[0]


@needs_native
@pytest.mark.parametrize("forced", ["generic", "off"] + (["avx2"] if "avx2" in VARIANTS else []))
def test_forced_isa_is_honoured(forced):
    done = _child(
        {"MOERUN_CPU_ISA": forced},
        "from moerun import cpu; print(cpu.available(), cpu.unavailable_reason())"
        + "; print(cpu.isa() if cpu.available() else '-')",
    )
    assert done.returncode == 0, done.stderr
    available, *_ = done.stdout.split()
    if forced == "off":
        assert available == "False" and "MOERUN_CPU_ISA=off" in done.stdout
    else:
        assert done.stdout.split()[-1] == forced


@needs_native
def test_threads_follow_torch_and_share_its_libgomp():
    native = library.native()
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert native.threads_used(torch.get_num_threads()) == n
    finally:
        torch.set_num_threads(threads)
    with open("/proc/self/maps") as maps:
        gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomp) == 1 and "torch" in next(iter(gomp))


@needs_native
@pytest.mark.parametrize("integer", [False, True])
def test_moe_decode_with_skewed_routing_splits_work_and_keeps_bits(integer):
    # every token on expert 0, one token also on expert 4: the threads split rows by work (rows x
    # tokens), so their boundaries land inside expert 0's rows; results must not depend on them
    x, gu, dn, _, _, _, _ = make_step("q4_k", "q6_k", 8)
    se = torch.tensor([[0, 1, 2]] * 7 + [[0, 3, 4]], dtype=torch.int32)
    sw = torch.rand(8, 3, generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.moe_decode(x, gu, dn, (se, sw), GLU(), integer)
        torch.set_num_threads(2)
        two = cpu.moe_decode(x, gu, dn, (se, sw), GLU(), integer)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one.view(torch.int32), two.view(torch.int32))
    expected = ref.moe_decode(x, gu, dn, (se, sw), GLU(), False)
    tol = (0.05 if integer else 1e-4) * float(expected.abs().max())
    assert (one.double() - expected).abs().max() <= tol
