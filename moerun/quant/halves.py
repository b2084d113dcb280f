"""The routed experts' projections as the file stores them, used where they lie.

moerun's canonical gate_up is one [E, 2I, H] weight: gate rows then up rows, or (GPT-OSS) gate row j
at 2j and up row j at 2j + 1. GGUF files store gate and up as two [E, I, H] tensors; Hugging Face
checkpoints store every expert's gate, up and down as tensors of their own. Joining them copies every
expert into anonymous memory (10 GiB for a 30B-A3B model), so the loaders hand them on as they lie:
`GateUpHalves` (gate and up apart) whose halves are [E, I, H] views of the file or `ExpertViews` (one
view per expert, at whatever address the file put it), and a down projection as `ExpertViews`. The
native CPU kernels read them in place (each output row is one row of one view, the same dot product
either way). Backends that want the joined weight get it (`joined()`, `stacked()`) when the layer is
placed; one expert's weight (`expert(e)`) is a copy, joined and 64-byte aligned (for BLAS, whose
sums may depend on the address).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerun.quant.formats import QTensor, storage_free


class ExpertViews:
    """One projection of E experts, [E, rows, cols], as E matrices that lie apart (a checkpoint's
    per-expert tensors, views of its file map): alike in shape, dtype and row stride. `views[e]` is
    expert e's matrix as it lies; `expert(e)` a copy of it, 64-byte aligned; `stacked()` all of them
    as one tensor (a copy)."""

    def __init__(self, views: list[torch.Tensor]):
        first = views[0]
        if first.dim() != 2 or first.stride(-1) != 1:
            raise ValueError(f"an expert's matrix must be 2-D with contiguous rows, not {list(first.shape)}.")
        for view in views:
            if (view.shape, view.dtype, view.stride()) != (first.shape, first.dtype, first.stride()):
                raise ValueError(
                    f"every expert's matrix must be alike: {list(view.shape)} {view.dtype} against "
                    f"{list(first.shape)} {first.dtype}."
                )
        self.views = list(views)
        self.shape = torch.Size((len(views), *first.shape))
        self.dtype, self.device = first.dtype, first.device

    def __len__(self) -> int:
        return len(self.views)

    def __getitem__(self, index: int | slice) -> torch.Tensor | ExpertViews:
        if isinstance(index, slice):
            return ExpertViews(self.views[index])
        return self.views[index]

    def dim(self) -> int:
        return 3

    def element_size(self) -> int:
        return self.views[0].element_size()

    def numel(self) -> int:
        return len(self.views) * self.views[0].numel()

    @property
    def nbytes(self) -> int:
        return self.numel() * self.element_size()

    def is_floating_point(self) -> bool:
        return self.views[0].is_floating_point()

    @property
    def is_meta(self) -> bool:
        return self.views[0].is_meta

    @property
    def row_stride(self) -> int:
        """Bytes from one row of an expert's matrix to the next."""
        return self.views[0].stride(0) * self.element_size()

    def experts(self, start: int, stop: int) -> ExpertViews:
        return ExpertViews(self.views[start:stop])

    def expert(self, e: int) -> torch.Tensor:
        return self.views[e].clone()  # a fresh allocation, aligned; the map's pages stay, still read

    def stacked(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[E, rows, cols] in `dtype` (default the views'), a copy."""
        out = torch.empty(self.shape, dtype=dtype or self.dtype, device=self.device)
        for e, view in enumerate(self.views):
            out[e].copy_(view)
        return out


Weight = torch.Tensor | QTensor | ExpertViews


@dataclass(frozen=True)
class GateUpHalves:
    """gate [E, I, H] and up [E, I, H], dense or quantised alike; `interleaved`: the joined weight's
    rows alternate gate and up (GPT-OSS), else gate rows then up rows."""

    gate: Weight
    up: Weight
    interleaved: bool = False

    def __post_init__(self):
        if tuple(self.gate.shape) != tuple(self.up.shape) or type(self.gate) is not type(self.up):
            raise ValueError(
                f"gate {tuple(self.gate.shape)} and up {tuple(self.up.shape)} must be alike to be joined."
            )
        if self.quantised and self.gate.format != self.up.format:
            raise ValueError(f"gate is {self.gate.format.name} but up is {self.up.format.name}.")

    @property
    def shape(self) -> tuple[int, ...]:
        """The joined weight's [E, 2I, H]."""
        *experts, rows, cols = self.gate.shape
        return (*experts, 2 * rows, cols)

    @property
    def quantised(self) -> bool:
        return isinstance(self.gate, QTensor)

    @property
    def format(self):
        return self.gate.format if self.quantised else None

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantised else self.gate.dtype

    def is_floating_point(self) -> bool:
        return not self.quantised and self.gate.is_floating_point()

    @property
    def nbytes(self) -> int:
        return sum(_data(t).numel() * _data(t).element_size() for t in (self.gate, self.up))

    def experts(self, start: int, stop: int) -> GateUpHalves:
        """Experts [start, stop) (views)."""
        return GateUpHalves(_cut(self.gate, start, stop), _cut(self.up, start, stop), self.interleaved)

    def expert(self, e: int) -> Weight:
        """Expert e's joined [2I, H] (a copy)."""
        data = join_halves(_data(self.gate)[e], _data(self.up)[e], self.interleaved)
        return QTensor(self.format, self.shape[1:], data) if self.quantised else data

    def joined(self, dtype: torch.dtype | None = None) -> Weight:
        """The whole joined [E, 2I, H] (a copy; halves whose experts lie apart stacked in `dtype`,
        default theirs; the others keep theirs)."""
        data = join_halves(_whole(self.gate, dtype), _whole(self.up, dtype), self.interleaved)
        return QTensor(self.format, self.shape, data) if self.quantised else data

    def stand_in(self) -> Weight:
        """Storage-free (device "meta") stand-in of the joined weight, for checks that read shapes."""
        if not self.quantised:
            return torch.empty(self.shape, dtype=self.dtype, device="meta")
        data = join_halves(storage_free(self.gate).data, storage_free(self.up).data, False)
        return QTensor(self.format, self.shape, data)


def _data(t: Weight) -> torch.Tensor:
    return t.data if isinstance(t, QTensor) else t


def _whole(t: Weight, dtype: torch.dtype | None) -> torch.Tensor:
    """A half's [E, I, H] data as one tensor: the tensor itself, or its experts stacked (a copy)."""
    return t.stacked(dtype) if isinstance(t, ExpertViews) else _data(t)


def _cut(t: Weight, start: int, stop: int) -> Weight:
    if isinstance(t, QTensor):
        return QTensor(t.format, (stop - start, *t.shape[1:]), t.data[start:stop])
    return t[start:stop]


def file_views(weight) -> list[torch.Tensor]:
    """The tensors of a file map that `weight` (a tensor, QTensor, ExpertViews or GateUpHalves)
    reads, to give their pages back once it is copied."""
    if isinstance(weight, GateUpHalves):
        return [*file_views(weight.gate), *file_views(weight.up)]
    if isinstance(weight, ExpertViews):
        return list(weight.views)
    return [weight.data if isinstance(weight, QTensor) else weight]


def join_halves(gate: torch.Tensor, up: torch.Tensor, interleaved: bool, dim: int = -2) -> torch.Tensor:
    """Two halves joined along `dim` (-2: the rows of weights [.., I, cols] -> [.., 2I, cols]; -1:
    biases [.., I] -> [.., 2I]): gate's then up's, or alternating (gate j at 2j, up j at 2j + 1)."""
    if not interleaved:
        return torch.cat([gate, up], dim=dim)
    return torch.stack([gate, up], dim=dim).flatten(dim - 1, dim)  # via [.., I, 2, cols] or [.., I, 2]
