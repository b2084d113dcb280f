"""The torch.compile'd CPU decode kernels (the fallback where numba is not installed) against torch.mv
on the gguf-exact dequantised weights; the numba kernels are tested in test_numba_matvec.py."""

import pytest
import torch
from conftest import rel_err

from moerun.quant.cpu_matvec import fused_matvec
from moerun.quant.dequant import dequantize_bytes
from moerun.quant.formats import FORMATS
from moerun.quant.quantize import quantize


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "mxfp4", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"])
def test_fused_matvec_equals_dequantised_mv(fmt, capsys):
    gen = torch.Generator().manual_seed(0)
    width = 512 if fmt.endswith("_k") else 160  # 2 super-blocks or 5 blocks per row
    weights = quantize(torch.randn(96, width, generator=gen), fmt)
    x = torch.randn(width, generator=gen)
    expected = torch.mv(dequantize_bytes(FORMATS[fmt], weights.data), x)
    assert rel_err(fused_matvec(FORMATS[fmt], weights.data, x, numba=False), expected) <= 1e-6
    assert f"compiling the {fmt} decode kernel for [96, {width}]" in capsys.readouterr().err


def test_e2m1_decode_matches_the_table():
    from moerun.quant.cpu_matvec import _e2m1_doubled
    from moerun.quant.dequant import MXFP4_VALUES

    assert _e2m1_doubled(torch.arange(16, dtype=torch.uint8)).tolist() == [float(v) for v in MXFP4_VALUES]
