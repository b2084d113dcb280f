"""A layer's routed experts: gate_up [E, 2I, H] and down [E, H, I], each dense or quantised (gate_up
possibly as its two halves where the file stores them, moerun.quant.halves; one expert's is then
joined when asked for).

Backends ask for one expert's dense projections (`dense`, for prefill: dequantised once and kept in
the optional DequantCache) or for a matrix-vector product (`matvec`, for decode: quantised weights
are dequantised tile by tile, so a whole expert is never materialised). With expert streaming
(`stream`, a moerun.offload.LayerStream) an expert's projections are read from its cache slot, which
holds the same bytes in the same dtype or format; the biases stay resident.
"""

from __future__ import annotations

import torch

from moerun.quant.cache import DequantCache
from moerun.quant.dequant import dequantize, dequantize_bytes
from moerun.quant.formats import QTensor
from moerun.quant.halves import ExpertViews, GateUpHalves

Weight = torch.Tensor | QTensor | GateUpHalves | ExpertViews

# Rows of a quantised projection dequantised at once in `matvec`: 2 MiB of fp32 (256 rows of H=2048).
# Smaller tiles measured 3-4x slower: eager dequantisation is a dozen torch ops per tile, so per-op
# overhead dominates small tiles.
_TILE_BYTES = 2 * 1024 * 1024


class ExpertWeights:
    def __init__(
        self,
        gate_up: Weight,
        down: Weight,
        biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
        *,
        dtype: torch.dtype,
        layer_name: str,
        cache: DequantCache | None = None,
        stream=None,
        owned: range | None = None,
    ):
        """`biases`: (gate_up [E, 2I], down [E, H]), each or both None. `owned` (expert
        parallelism): the stacked tensors hold only these experts (a contiguous share), in order;
        expert e is row e - owned.start of them. The one place a layer's ownership is asked."""
        self.gate_up, self.down = gate_up, down
        self.owned = owned
        self._row = {e: i for i, e in enumerate(owned)} if owned is not None else None
        self.gate_up_bias, self.down_bias = biases
        self.dtype = dtype  # compute dtype of the projections
        self.layer_name = layer_name
        self.cache = cache
        self.quantised = (
            isinstance(gate_up, QTensor)
            or isinstance(down, QTensor)
            or (isinstance(gate_up, GateUpHalves) and gate_up.quantised)
        )
        self.stream = stream  # moerun.offload.LayerStream, or None: every expert resident

    def stored(self, projection: str, e: int) -> Weight:
        """Expert e's weights of `projection`: [out, in] dense, or a QTensor of one expert."""
        weight = self.gate_up if projection == "gate_up" else self.down
        if self.stream is None:
            e = e if self._row is None else self._row[e]
            return weight.expert(e) if isinstance(weight, QTensor | GateUpHalves | ExpertViews) else weight[e]
        data = self.stream.tensors(e)[projection]
        return QTensor(weight.format, weight.shape[1:], data) if isinstance(weight, QTensor) else data

    def dense(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, H], down [H, I]) as dense tensors in the compute dtype."""
        if not self.quantised:
            return self.stored("gate_up", e), self.stored("down", e)
        if self.cache is None:
            return self._dequantised(e)
        return self.cache.get((self.layer_name, e, self.dtype), lambda: self._dequantised(e))

    def _dequantised(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _dense(self.stored("gate_up", e), self.dtype), _dense(self.stored("down", e), self.dtype)

    def matvec(self, projection: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """W_e · x for projection "gate_up" or "down" of expert e; x [in] -> [out] in the compute dtype."""
        weight = self.stored(projection, e)
        x = x.to(self.dtype)
        if not isinstance(weight, QTensor):
            return torch.mv(weight, x)
        data = weight.data  # [out, row_bytes]
        out_features, in_features = weight.shape[-2:]
        tile = max(1, _TILE_BYTES // (4 * in_features))
        out = torch.empty(out_features, dtype=self.dtype, device=x.device)
        for start in range(0, out_features, tile):
            rows = dequantize_bytes(weight.format, data[start : start + tile], self.dtype)
            torch.mv(rows, x, out=out[start : start + tile])
        return out

    def bytes_per_expert(self) -> int:
        """Bytes one expert's projections and biases occupy as stored (quantised or dense)."""
        total = 0
        for tensor in (self.gate_up, self.down, self.gate_up_bias, self.down_bias):
            if isinstance(tensor, GateUpHalves):
                total += tensor.nbytes // tensor.shape[0]
            elif isinstance(tensor, QTensor):
                total += tensor.data[0].numel()
            elif tensor is not None:
                total += tensor[0].numel() * tensor.element_size()
        return total

    def owned_of(self, experts: list[int]) -> list[int]:
        """Those of `experts` this process computes: all, or with expert parallelism its share's."""
        return experts if self.owned is None else [e for e in experts if e in self.owned]

    def bias(self, projection: str, e: int) -> torch.Tensor | None:
        bias = self.gate_up_bias if projection == "gate_up" else self.down_bias
        if bias is None:
            return None
        return bias[e if self._row is None else self._row[e]]


def _dense(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(weight, QTensor):
        return dequantize(weight, dtype)
    return weight.to(dtype)
