"""load_weight_tile (moerun.kernels.weights) under the Triton interpreter: every format read tile by
tile through a small kernel gives bit for bit the values of moerun.quant.dequant.dequantize (itself
bit-exact against the gguf package), for tiles that cut rows and super-blocks in several ways."""

import os

import pytest
import torch

# As conftest.py does: without CUDA, set before triton is imported, the kernels run in triton's
# interpreter on CPU tensors (repeated here so the module also runs on its own).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from test_dequant import assert_same_bits, random_bytes  # noqa: E402

from moerun.kernels.weights import FORMAT_CODES, kernel_weight, load_weight_tile  # noqa: E402
from moerun.quant.dequant import dequantize  # noqa: E402
from moerun.quant.formats import FORMATS, QTensor  # noqa: E402

BLOCK_FORMATS = [name for name in FORMAT_CODES if not FORMATS[name].is_float]
N, K = 10, 512  # 2 super-blocks per row; N is cut unevenly by BN = 4 and 8
TILES = [(8, 32), (16, 64), (4, 256)]  # (BN, BK)
# MXFP4's scale byte 255 times 6 overflows to inf (in ggml and dequantize too); numpy warns of it.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


@triton.jit
def _read_tiles(
    w_ptr,
    expert,
    expert_stride,
    row_stride,
    table_ptr,
    out_ptr,
    N,
    K,
    FMT: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """out fp32 [cdiv(N, BN) * BN, cdiv(K, BK) * BK] <- expert `expert`'s weight, a [BK, BN] tile
    per program (entries beyond N and K included, as load_weight_tile returns them)."""
    n_offs = tl.program_id(0) * BN + tl.arange(0, BN)
    k_offs = tl.program_id(1) * BK + tl.arange(0, BK)
    w_expert = w_ptr + expert * expert_stride
    tile = load_weight_tile(w_expert, row_stride, n_offs, k_offs, N, K, table_ptr, FMT)  # [BK, BN]
    out_cols = tl.num_programs(1) * BK
    tl.store(out_ptr + n_offs[None, :] * out_cols + k_offs[:, None], tile)


def read_through_kernel(w, expert: int, bn: int, bk: int) -> torch.Tensor:
    """Expert `expert` of `w` (as kernel_weight gives it) read tile by tile: fp32 [n, k], after
    checking that the tiles' entries beyond n and k read as +0."""
    grid = (triton.cdiv(w.n, bn), triton.cdiv(w.k, bk))
    out = torch.full((grid[0] * bn, grid[1] * bk), float("nan"), device=DEVICE)
    data = w.data.to(DEVICE)
    table = w.table.to(DEVICE)
    _read_tiles[grid](data, expert, w.expert_stride, w.row_stride, table, out, w.n, w.k, w.fmt, bn, bk)
    out = out.cpu()
    padding = out.clone()
    padding[: w.n, : w.k] = 0.0
    assert_same_bits(padding, torch.zeros_like(padding))
    return out[: w.n, : w.k]


def random_qtensor(name: str, shape: tuple[int, ...], seed: int = 0) -> QTensor:
    data = torch.from_numpy(random_bytes(name, shape, seed))
    if name.startswith("mxfp4"):  # E8M0's edge cases: subnormal scales, and 2^127 (times 12: inf)
        blocks = data.view(-1, 17)
        blocks[:4, 0] = torch.tensor([0, 1, 254, 255], dtype=torch.uint8)
    return QTensor(FORMATS[name], shape, data)


@pytest.mark.parametrize("bn,bk", TILES, ids=str)
@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_block_formats_are_bit_exact(name, bn, bk):
    q = random_qtensor(name, (N, K), seed=bk)
    w = kernel_weight(QTensor(q.format, (1, N, K), q.data[None]))
    assert_same_bits(read_through_kernel(w, 0, bn, bk), dequantize(q, torch.float32))


def test_a_tile_wider_than_the_row():
    """A row of 2 blocks read by one BK = 128 tile: the k beyond the row read as 0."""
    q = random_qtensor("q4_0", (1, 5, 64), seed=1)
    assert_same_bits(read_through_kernel(kernel_weight(q), 0, 8, 128), dequantize(q)[0])


@pytest.mark.parametrize("name", ["q4_k", "mxfp4_gpt_oss"])
def test_kernel_weight_of_a_qtensor_reads_each_expert(name):
    q = random_qtensor(name, (3, 6, 256), seed=2)
    w = kernel_weight(q)
    assert (w.fmt, w.n, w.k, w.row_stride) == (FORMAT_CODES[name], 6, 256, q.data.shape[-1])
    assert_same_bits(read_through_kernel(w, 1, 8, 64), dequantize(q.expert(1)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_weight_of_a_dense_tensor_reads_each_expert(dtype):
    """A non-contiguous [E, n, k] tensor (a transposed view) is read as its values."""
    weight = torch.randn(3, 40, 6, generator=torch.Generator().manual_seed(0)).to(dtype).transpose(1, 2)
    w = kernel_weight(weight)
    assert (w.n, w.k, w.row_stride, w.expert_stride) == (6, 40, 40, 240)
    assert_same_bits(read_through_kernel(w, 1, 4, 32), weight[1].float())


def test_kernel_weight_refuses_other_dtypes():
    with pytest.raises(ValueError, match="float64"):
        kernel_weight(torch.zeros(2, 3, 4, dtype=torch.float64))
