"""The routed experts' gate_up projection as its two halves stored apart, used where they lie.

moerun's canonical gate_up is one [E, 2I, H] weight: gate rows then up rows, or (GPT-OSS) gate row j
at 2j and up row j at 2j + 1. GGUF files store gate and up as two [E, I, H] tensors. Joining them
copies every expert's gate and up into anonymous memory (10 GiB for a 30B-A3B model), so the loader
hands them on as `GateUpHalves` instead: two views of the file, which the native CPU kernels read in
place (each output row of gate_up is one row of one half, the same dot product either way). Backends
that want the joined weight get it from `joined()` when the layer is placed; one expert's joined
weight (`expert`) is a copy of its two halves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerun.quant.formats import QTensor, storage_free

Weight = torch.Tensor | QTensor


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

    def joined(self) -> Weight:
        """The whole joined [E, 2I, H] (a copy)."""
        data = join_halves(_data(self.gate), _data(self.up), self.interleaved)
        return QTensor(self.format, self.shape, data) if self.quantised else data

    def stand_in(self) -> Weight:
        """Storage-free (device "meta") stand-in of the joined weight, for checks that read shapes."""
        if not self.quantised:
            return torch.empty(self.shape, dtype=self.dtype, device="meta")
        data = join_halves(storage_free(self.gate).data, storage_free(self.up).data, False)
        return QTensor(self.format, self.shape, data)


def _data(t: Weight) -> torch.Tensor:
    return t.data if isinstance(t, QTensor) else t


def _cut(t: Weight, start: int, stop: int) -> Weight:
    if isinstance(t, QTensor):
        return QTensor(t.format, (stop - start, *t.shape[1:]), t.data[start:stop])
    return t[start:stop]


def join_halves(gate: torch.Tensor, up: torch.Tensor, interleaved: bool, dim: int = -2) -> torch.Tensor:
    """Two halves joined along `dim` (-2: the rows of weights [.., I, cols] -> [.., 2I, cols]; -1:
    biases [.., I] -> [.., 2I]): gate's then up's, or alternating (gate j at 2j, up j at 2j + 1)."""
    if not interleaved:
        return torch.cat([gate, up], dim=dim)
    return torch.stack([gate, up], dim=dim).flatten(dim - 1, dim)  # via [.., I, 2, cols] or [.., I, 2]
