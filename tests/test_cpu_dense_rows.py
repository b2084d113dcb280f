"""The dense float row kernels (f32 / f16 / bf16 weights, exact mode) group rows and tokens into
register blocks whatever T is; each (row, token) must still be summed exactly as a one-token call
sums it, so a T-token call equals T one-token calls bit for bit, for every row count (the blocks'
remainders), every token count up to a call's 16 (the groups' remainders) and past it, and every
n (the tail past the last 32 elements), in every ISA variant. Values are checked against float64."""

import pytest
import torch

from moerun import cpu
from moerun.cpu import library
from moerun.quant.formats import FLOAT_DTYPES

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"native CPU kernels: {cpu.unavailable_reason()}")

VARIANTS = library.runnable_variants() if cpu.available() else ["generic"]
DENSE = ["f32", "f16", "bf16"]


def bits(y: torch.Tensor) -> torch.Tensor:
    return y.view(torch.int32)


def weight_and_x(fmt_name: str, out: int, n: int, T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out, n, generator=g) * 0.05).to(FLOAT_DTYPES[fmt_name])
    return w, torch.randn(T, n, generator=g)


def one_token_calls(fmt_name: str, w: torch.Tensor, x: torch.Tensor, variant: str) -> torch.Tensor:
    return torch.stack([cpu.matmul(fmt_name, w, x[t], variant=variant) for t in range(x.shape[0])])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt_name", DENSE)
def test_every_token_count_gives_each_token_its_one_token_bits(variant, fmt_name):
    # 23 rows: 5 blocks of 4 and 3 left over, or 11 of 2 and 1; n = 200 = 6 x 32 + a tail of 8
    w, x = weight_and_x(fmt_name, out=23, n=200, T=20)
    alone = one_token_calls(fmt_name, w, x, variant)
    for T in range(1, 21):  # 1 .. 16 (each remainder of groups of 4), 17 .. 20 (a second call)
        assert torch.equal(bits(cpu.matmul(fmt_name, w, x[:T], variant=variant)), bits(alone[:T])), T


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt_name", DENSE)
@pytest.mark.parametrize("out", [1, 2, 3, 5, 7, 9])
@pytest.mark.parametrize("n", [16, 31, 32, 33, 64, 95])
def test_row_and_element_remainders_keep_the_one_token_bits(variant, fmt_name, out, n):
    w, x = weight_and_x(fmt_name, out=out, n=n, T=7, seed=out * 100 + n)
    alone = one_token_calls(fmt_name, w, x, variant)
    for T in (2, 3, 4, 5, 7):
        assert torch.equal(bits(cpu.matmul(fmt_name, w, x[:T], variant=variant)), bits(alone[:T])), T
    # each row alone too: a one-row weight takes the blocks' remainder path for every row
    single = torch.cat([cpu.matmul(fmt_name, w[r : r + 1], x, variant=variant) for r in range(out)], dim=1)
    assert torch.equal(bits(single), bits(alone))
    wd = w.double()
    expected, magnitude = x.double() @ wd.T, x.double().abs() @ wd.abs().T
    assert ((alone.double() - expected).abs() <= 1e-5 * magnitude).all()


@pytest.mark.parametrize("fmt_name", DENSE)
def test_rows_past_an_l2_tile_keep_the_one_token_bits(fmt_name):
    # 2048 inputs: 8 KiB (f32) or 4 KiB rows; 77 rows span several of the kernel's weight tiles,
    # which 5..16 tokens visit group by group; two threads split the rows mid-tile
    w, x = weight_and_x(fmt_name, out=77, n=2048, T=16)
    alone = one_token_calls(fmt_name, w, x, None)
    threads = torch.get_num_threads()
    try:
        for nthreads in (1, 2):
            torch.set_num_threads(nthreads)
            for T in (5, 8, 13, 16):
                assert torch.equal(bits(cpu.matmul(fmt_name, w, x[:T])), bits(alone[:T])), (nthreads, T)
    finally:
        torch.set_num_threads(threads)
