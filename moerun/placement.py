"""Placing a weight where the model computes with it: on the device, in the compute dtype,
contiguous, and starting on a 64-byte boundary.

Why the boundary: a BLAS matrix-vector product (MKL's sgemv on AMD Zen, for one) sums in an order
that depends on the matrix's address modulo 16 or 64 bytes, so the same weights at two alignments
give logits that differ in the last bits. A tensor viewed straight out of a checkpoint's memory map
starts wherever the file put it (safetensors pads to 8 bytes, GGUF to 32), while a fresh torch
allocation starts on a 64-byte boundary. Placing every weight through `place` gives a resident
model and a streamed one (whose expert slots and dense copies are fresh allocations) the same
alignment, so they run the same arithmetic in the same order on any CPU. A copy made off a file map
gives the map's pages back, so a resident model is not held twice while it loads.
"""

from __future__ import annotations

import torch

from moerun.loader.mapped import release_mapped

ALIGNMENT = 64  # bytes: a cache line, and the widest vector load (AVX-512) any CPU kernel makes


def is_aligned(tensor: torch.Tensor) -> bool:
    return tensor.data_ptr() % ALIGNMENT == 0


def place(
    tensor: torch.Tensor,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    own: bool = False,
) -> torch.Tensor:
    """`tensor` on `device` in `dtype`, contiguous and 64-byte aligned: the same tensor where it
    already is all that, else a copy. `own`: never share memory with `tensor` (e.g. to keep a
    streamed model's dense part off the checkpoint's map, which only the expert store reads)."""
    out = tensor.detach().to(device=device, dtype=dtype).contiguous()
    if (own and out.data_ptr() == tensor.data_ptr()) or (out.device.type == "cpu" and not is_aligned(out)):
        out = out.clone()  # a fresh allocation: torch's CPU allocator aligns to 64 bytes
    if out.data_ptr() != tensor.data_ptr() and tensor.device.type == "cpu":
        release_mapped(tensor)  # a copy of a file map's bytes: the map's pages are not held twice
    return out


def given_back(*views: torch.Tensor) -> None:
    """Views of a file map that were copied elsewhere: the map's pages of them go (read again from
    the file if touched); anything else is left alone."""
    for view in views:
        release_mapped(view)
