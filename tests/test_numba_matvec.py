"""The numba CPU decode kernels against dequantise-then-multiply in fp64 (moerun.quant.dequant)."""

import pytest
import torch
from conftest import rel_err
from test_dequant import FP16_FIELDS

from moerun.quant.dequant import dequantize_bytes
from moerun.quant.formats import FORMATS
from moerun.quant.quantize import quantize

numba_matvec = pytest.importorskip("moerun.quant.numba_matvec", reason="numba is not installed")

BLOCK_FORMATS = ["q8_0", "q4_0", "mxfp4", "mxfp4_gpt_oss"]
K_FORMATS = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
# Byte offsets of the fp16 scales (d, dmin) inside each k-quant block.
SHAPES = [(out, n) for out in (1, 7, 256, 300) for n in (256, 512, 2048)]


def _x(n: int, gen: torch.Generator) -> torch.Tensor:
    """Gaussian x with some entries scaled up by 1e4 and some down by 1e-4."""
    x = torch.randn(n, generator=gen)
    scale = torch.ones(n)
    scale[torch.randperm(n, generator=gen)[: n // 8]] = 1e4
    scale[torch.randperm(n, generator=gen)[: n // 8]] = 1e-4
    return x * scale


def _check(fmt: str, data: torch.Tensor, x: torch.Tensor) -> None:
    """Error at most 1e-5 of max |y|, or where x's 1e4 entries make a few rows cancel (out = 1),
    of max |W| . |x| (float32 accumulation cannot do better on such rows)."""
    w = dequantize_bytes(FORMATS[fmt], data).double()
    expected = w @ x.double()
    actual = numba_matvec.numba_matvec(fmt, data, x)
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    error = (actual.double() - expected).abs().max()
    assert error <= 1e-5 * (w.abs() @ x.double().abs()).max()
    if data.shape[0] >= 7:
        assert rel_err(actual, expected) <= 1e-5


@pytest.mark.parametrize("fmt", BLOCK_FORMATS + K_FORMATS)
def test_quantised_gaussian_rows(fmt):
    gen = torch.Generator().manual_seed(0)
    widths = (32, 96) if fmt in BLOCK_FORMATS else ()
    for out, n in SHAPES + [(out, n) for out in (1, 7, 300) for n in widths]:
        weights = quantize(torch.randn(out, n, generator=gen), fmt)
        _check(fmt, weights.data, _x(n, gen))


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_random_k_quant_bytes(fmt):
    """Every bit pattern of quants and sub-block scales, with finite fp16 super-block scales."""
    gen = torch.Generator().manual_seed(1)
    block = FORMATS[fmt].block_bytes
    for out, n in [(7, 256), (300, 2048)]:
        blocks = torch.randint(0, 256, (out, n // 256, block), dtype=torch.uint8, generator=gen)
        for start in FP16_FIELDS[fmt]:
            blocks[..., start + 1] &= 0x7B  # exponent below 31 (no inf/NaN) and at most 2^15
        _check(fmt, blocks.reshape(out, -1), _x(n, gen))


def test_gpt_oss_layout_matches_gguf_layout():
    """The same values in both MXFP4 layouts give the same products."""
    from moerun.quant.mxfp4_layouts import mxfp4_to_gpt_oss_layout

    gen = torch.Generator().manual_seed(2)
    data = quantize(torch.randn(64, 512, generator=gen), "mxfp4").data
    x = _x(512, gen)
    gguf = numba_matvec.numba_matvec("mxfp4", data, x)
    assert rel_err(numba_matvec.numba_matvec("mxfp4_gpt_oss", mxfp4_to_gpt_oss_layout(data), x), gguf) <= 1e-6


def test_threads_split_rows_as_one_thread_does():
    """Chunks run on the pool thread must write the same rows the calling thread alone would."""
    gen = torch.Generator().manual_seed(3)
    data = quantize(torch.randn(2048, 1024, generator=gen), "q4_k").data  # 576 KiB: several chunks
    x = _x(1024, gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = numba_matvec.numba_matvec("q4_k", data, x)
        torch.set_num_threads(2)
        for _ in range(20):
            assert torch.equal(numba_matvec.numba_matvec("q4_k", data, x), alone)
    finally:
        torch.set_num_threads(threads)


def test_fused_matvec_prefers_numba(monkeypatch, capsys):
    from moerun.quant import cpu_matvec

    gen = torch.Generator().manual_seed(4)
    weights = quantize(torch.randn(16, 256, generator=gen), "mxfp4_gpt_oss")
    assert cpu_matvec.has_fused_matvec(FORMATS["mxfp4_gpt_oss"])  # numba only
    calls = []
    monkeypatch.setattr(numba_matvec, "numba_matvec", lambda *args: calls.append(args) or torch.zeros(16))
    cpu_matvec.fused_matvec(FORMATS["mxfp4_gpt_oss"], weights.data, torch.randn(256))
    assert len(calls) == 1
    assert not cpu_matvec.has_fused_matvec(FORMATS["mxfp4_gpt_oss"], numba=False)
