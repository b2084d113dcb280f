"""A streamed expert projection described, not built: where each expert's bytes lie and how they join.

moerun's canonical expert projection is one [E, out, in] tensor. Some checkpoints store it in
pieces that the loader joins in RAM for a resident model: per-expert names stacked, GGUF gate and
up experts fused (for gpt-oss interleaved row by row), GPT-OSS MXFP4 `*_blocks` and `*_scales`
regrouped into 17-byte blocks. With expert streaming the loader describes such a projection as an
`ExpertPieces` instead: views of the stored tensors (of the checkpoint's map: nothing is read) and a
recipe. The expert store (moerun.offload.store) reads expert e's share of each piece straight from
the file into its slot. The loader says where the bytes are; only the store reads them.

A plain [E, out, in] tensor (or QTensor) is the one-piece case (`ExpertPieces.of`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from moerun.quant.formats import QFormat, QTensor

ROWS = "rows"  # each piece fills slot rows row, row + step, ... with its rows
MXFP4_GPT_OSS = "mxfp4_gpt_oss"  # pieces (blocks, scales) joined into `mxfp4_gpt_oss` 17-byte blocks
JOINS = (ROWS, MXFP4_GPT_OSS)


@dataclass(frozen=True)
class Piece:
    """One stored tensor's share of every expert. `views[e]` is expert e's share as stored: dense
    [rows, in], quantised bytes uint8 [rows, row_bytes], or with `transposed` [in, rows] (transformers'
    GPT-OSS layout). It fills slot rows `row`, `row + step`, ... (step 2: gate and up interleaved)."""

    views: Sequence[torch.Tensor]  # indexed by expert: an [E, ...] tensor or a list of per-expert views
    row: int = 0
    step: int = 1
    transposed: bool = False

    @property
    def rows(self) -> int:
        return self.views[0].shape[-1 if self.transposed else 0]


@dataclass(frozen=True)
class ExpertPieces:
    """One projection of one layer's experts: logical `shape` [E, out, in]; `dtype` is the dense
    dtype the joined tensor would have (torch.uint8 when quantised, with its `format`)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    format: QFormat | None
    pieces: tuple[Piece, ...]
    join: str = ROWS

    def __post_init__(self):
        if self.join not in JOINS:
            raise ValueError(f"Unknown expert join {self.join!r}; known: {', '.join(JOINS)}.")

    @classmethod
    def of(cls, weight: torch.Tensor | QTensor) -> ExpertPieces:
        """A whole [E, out, in] tensor or QTensor as one piece."""
        if isinstance(weight, QTensor):
            return cls(tuple(weight.shape), torch.uint8, weight.format, (Piece(weight.data),))
        stored = weight.transpose(-1, -2)
        if not weight[0].is_contiguous() and stored[0].is_contiguous():  # a transposed view of [E, in, out]
            return cls(tuple(weight.shape), weight.dtype, None, (Piece(stored, transposed=True),))
        return cls(tuple(weight.shape), weight.dtype, None, (Piece(weight),))

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    def slot_shape(self) -> tuple[int, ...]:
        """One expert as a slot holds it: [out, in] dense, [out, row_bytes] quantised."""
        out, cols = self.shape[1:]
        if self.format is None:
            return (out, cols)
        return (out, self.format.row_bytes(cols, f"tensor of shape {self.shape}"))

    def stand_in(self) -> torch.Tensor | QTensor:
        """Storage-free (device "meta") tensor of this projection's shape and dtype or format, for the
        checks and layers that only read shapes while the store serves the bytes."""
        if self.format is None:
            return torch.empty(self.shape, dtype=self.dtype, device="meta")
        data = torch.empty((self.shape[0], *self.slot_shape()), dtype=torch.uint8, device="meta")
        return QTensor(self.format, self.shape, data)


def stand_ins(tensors: Mapping[str, object]) -> dict[str, object]:
    """`tensors` with every ExpertPieces replaced by its stand-in."""
    return {k: v.stand_in() if isinstance(v, ExpertPieces) else v for k, v in tensors.items()}
