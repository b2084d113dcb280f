"""GGUF expert and gate/up tensors -> canonical ones: the old per-expert layout stacked, gate and
up stored apart fused (gate rows then up rows, or interleaved row by row for GPT-OSS), whole or
described for expert streaming (`ExpertPieces` over views of the file); llama's permuted q/k rows
put back. Read by moerun.checkpoint.gguf."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerun.errors import TensorError
from moerun.loader import CheckpointError, GGUFFile
from moerun.loader.mapped import release_mapped
from moerun.offload.pieces import ExpertPieces, Piece
from moerun.quant.dequant import dequantize
from moerun.quant.formats import QTensor
from moerun.quant.halves import GateUpHalves, join_halves

Tensor = torch.Tensor | QTensor


@dataclass(frozen=True)
class GateUp:
    """One gate/up pair of a block, stored apart: its two GGUF names, whether they are routed
    experts (which must share a format to be fused), and whether their rows interleave when joined."""

    names: tuple[str, str]
    expert: bool
    interleave: bool


def per_expert_parts(
    gguf: GGUFFile, block: str, by_projection: dict[str, dict[int, str]]
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """The old layout (blk.N.ffn_{gate,up,down}.E.weight, one tensor per expert, as llama.cpp wrote
    Mixtral before merged expert tensors): each projection's experts, checked to be complete and
    alike; `stacked_experts` or `described_experts` makes the canonical projections of them."""
    count = max(len(names) for names in by_projection.values())
    parts: dict[str, list[Tensor]] = {}
    for proj in ("gate", "up", "down"):
        names = by_projection.get(proj, {})
        if sorted(names) != list(range(count)):
            missing = sorted(set(range(count)) - set(names))
            raise CheckpointError(
                f"{gguf.path}: the per-expert tensors {block}ffn_{proj}.E.weight are incomplete: "
                f"experts {missing} are missing."
            )
        parts[proj] = [gguf.tensor(names[e]) for e in range(count)]
        if len(_kinds(parts[proj])) > 1 or (proj == "up" and _kinds(parts["up"]) != _kinds(parts["gate"])):
            raise CheckpointError(
                f"{gguf.path}: the per-expert tensors {block}ffn_{proj}.E.weight differ in shape or type "
                "between experts (or from ffn_gate's); moerun stacks them into one tensor."
            )
    return parts["gate"], parts["up"], parts["down"]


def described_experts(gate: list[Tensor], up: list[Tensor], down: list[Tensor]) -> dict[str, ExpertPieces]:
    """Per-expert tensors -> gate_up [E, 2I, H] and down [E, H, I] described over their views, for
    streaming (nothing is read)."""
    rows = gate[0].shape[0]
    gate_up = (Piece([_data(t) for t in gate]), Piece([_data(t) for t in up], row=rows))
    return {
        "gate_up": _pieces_of(gate, gate_up, 2 * rows),
        "down": _pieces_of(down, (Piece([_data(t) for t in down]),), down[0].shape[0]),
    }


def stacked_experts(
    gguf: GGUFFile, gate: list[Tensor], up: list[Tensor], down: list[Tensor], by_projection: dict
) -> dict[str, Tensor]:
    """Per-expert tensors -> gate_up [E, 2I, H] and down [E, H, I] stacked in RAM; the mapped pages
    they were copied from are given back."""
    out = {"gate_up": _stack(gate + up, len(gate)), "down": _stack(down, len(down))}
    for names in by_projection.values():
        for name in names.values():
            gguf.release(name)
    return out


def _kinds(tensors: list[Tensor]) -> set:
    return {(tuple(t.shape), getattr(t, "format", None) or t.dtype) for t in tensors}


def _pieces_of(experts: list[Tensor], pieces: tuple[Piece, ...], rows: int) -> ExpertPieces:
    first = experts[0]
    shape = (len(experts), rows, first.shape[-1])
    if isinstance(first, QTensor):
        return ExpertPieces(shape, torch.uint8, first.format, pieces)
    return ExpertPieces(shape, first.dtype, None, pieces)


def _stack(parts: list[Tensor], num_experts: int) -> Tensor:
    """parts = gate of experts 0..E-1 then up of 0..E-1 (or just one projection's) -> [E, rows, in],
    each part copied once, straight into place (no intermediate stacks held beside the result), and
    its mapped pages given back."""
    halves = [parts[i : i + num_experts] for i in range(0, len(parts), num_experts)]
    first = parts[0].data if isinstance(parts[0], QTensor) else parts[0]
    rows = first.shape[0]
    out = torch.empty((num_experts, rows * len(halves), *first.shape[1:]), dtype=first.dtype)
    for h, half in enumerate(halves):
        for e, t in enumerate(half):
            source = t.data if isinstance(t, QTensor) else t
            out[e, h * rows : (h + 1) * rows] = source
            release_mapped(source)  # copied: the map's pages go now, not after the whole layer
    if isinstance(parts[0], QTensor):
        return QTensor(parts[0].format, (num_experts, out.shape[1], parts[0].shape[-1]), out)
    return out


def described(gguf: GGUFFile, parts: GateUp) -> ExpertPieces:
    """What `fuse` would build for gate and up experts, described over views of the file."""
    gate, up = _gate_and_up(gguf, parts)
    return gate_up_pieces(gate, up, parts.interleave)


def gate_up_pieces(gate: Tensor, up: Tensor, interleave: bool) -> ExpertPieces:
    """gate and up experts [E, I, in] as the pieces of gate_up [E, 2I, in]: gate rows then up rows, or
    (interleave) gate row j at 2j and up row j at 2j + 1."""
    rows = gate.shape[-2]
    pieces = (
        (Piece(_data(gate), row=0, step=2), Piece(_data(up), row=1, step=2))
        if interleave
        else (Piece(_data(gate)), Piece(_data(up), row=rows))
    )
    shape = (*gate.shape[:-2], 2 * rows, gate.shape[-1])
    if isinstance(gate, QTensor):
        return ExpertPieces(shape, torch.uint8, gate.format, pieces)
    dtype = gate.dtype if gate.dtype == up.dtype else torch.float32  # as `fuse` joins them
    return ExpertPieces(shape, dtype, None, pieces)


def _data(t: Tensor) -> torch.Tensor:
    return t.data if isinstance(t, QTensor) else t


def rows(t: Tensor, begin: int, end: int) -> Tensor:
    """Rows [begin, end) of every expert of [E, rows, in]."""
    if isinstance(t, QTensor):
        return QTensor(t.format, (*t.shape[:-2], end - begin, t.shape[-1]), t.data[..., begin:end, :])
    return t[..., begin:end, :]


def _gate_and_up(gguf: GGUFFile, parts: GateUp) -> tuple[Tensor, Tensor]:
    """The gate and up tensors, checked to have the same shape and, for experts, the same format."""
    names = parts.names
    gate, up = (gguf.tensor(n) for n in names)
    for name, t in zip(names, (gate, up), strict=True):
        if not isinstance(t, QTensor) and not t.is_floating_point():
            raise TensorError(f"{gguf.path}: {name} is {t.dtype}, not a floating-point weight.")
    if tuple(gate.shape) != tuple(up.shape):
        raise CheckpointError(
            f"{gguf.path}: {names[0]} is {tuple(gate.shape)} but {names[1]} is {tuple(up.shape)}; "
            "gate and up must have the same shape."
        )
    quantised = isinstance(gate, QTensor) or isinstance(up, QTensor)
    if quantised and not (isinstance(gate, QTensor) and isinstance(up, QTensor) and gate.format == up.format):
        if parts.expert:
            kinds = [gguf.info(n).type_name for n in names]
            raise CheckpointError(
                f"{gguf.path}: {names[0]} is {kinds[0]} but {names[1]} is {kinds[1]}; moerun fuses gate and "
                "up experts into one tensor, so both must have the same type (requantise one of them)."
            )
        gate, up = dequantize(gate), dequantize(up)
    return gate, up


def fuse(gguf: GGUFFile, parts: GateUp, share=None) -> Tensor | GateUpHalves:
    """gate [.., I, in] and up [.., I, in] (or biases [.., I]) -> [.., 2I, in]: gate rows then up rows,
    or (interleave) gate row j at 2j and up row j at 2j + 1. Quantised parts stay quantised when they
    share a format; expert parts must, the small dense MLPs are dequantised. Routed experts' weights
    are not copied: `GateUpHalves` over the file's two tensors, cut to `share` (expert parallelism, a
    moerun.distributed.ExpertShard); the rest are joined in RAM."""
    names, interleave = parts.names, parts.interleave
    gate, up = _gate_and_up(gguf, parts)
    if share is not None and parts.expert:
        gate, up = share.cut_one(gate), share.cut_one(up)
    if parts.expert and not names[0].endswith(".bias"):
        return GateUpHalves(gate, up, interleave)
    if isinstance(gate, QTensor):
        data = join_halves(gate.data, up.data, interleave)
        fused = QTensor(gate.format, (*gate.shape[:-2], 2 * gate.shape[-2], gate.shape[-1]), data)
    else:
        if gate.dtype != up.dtype:
            gate, up = gate.float(), up.float()
        fused = join_halves(gate, up, interleave, dim=-1 if names[0].endswith(".bias") else -2)
    for name in names:  # copied out: give back the mapped pages, so the file is not held twice
        gguf.release(name)
    return fused


def interleave_halves(t: Tensor, dim: int) -> Tensor:
    """[.., 2I, in] gate rows then up rows (or biases [.., 2I]) -> gate row j at 2j, up row j at 2j + 1."""
    if isinstance(t, QTensor):
        return QTensor(t.format, t.shape, interleave_halves(t.data, -2))
    return t.unflatten(dim, (2, -1)).transpose(dim - 1, dim).flatten(dim - 1, dim)


def unpermute(t: Tensor, heads: int) -> Tensor:
    """Undo LlamaModel.permute: w.reshape(heads, 2, rows / heads / 2, ...).swapaxes(1, 2)."""
    if isinstance(t, QTensor):
        return QTensor(t.format, t.shape, unpermute(t.data, heads))
    rows = t.shape[0]
    return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
