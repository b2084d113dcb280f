"""What a GGUF file written by `moerun quantize` stores for each tensor: the formats a user asks for
(`QuantizeSpec`) and the conversion of one GGUF-named tensor to them (`TensorConverter`), with
llama-quantize's fallbacks where rows are not whole blocks of a format."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moerun.quant.dequant import dequantize
from moerun.quant.formats import FLOAT_DTYPES, FORMATS, FormatError, QFormat, QTensor, get_format
from moerun.quant.mxfp4_layouts import gpt_oss_layout_to_mxfp4
from moerun.quant.quantize import READ_ONLY, not_writable, quantize_rows

Tensor = torch.Tensor | QTensor

EXPERT_FORMATS = (
    *("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs", "iq4_nl", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0"),
    *("tq1_0", "tq2_0", "mxfp4", "f16", "bf16", "f32"),
)
# llama.cpp's types for 2-D weights outside the experts, besides the float ones
REST_FORMATS = ("f16", "bf16", "f32", "q8_0", "q5_1", "q5_0", "iq4_nl")
# llama-quantize's type for rows that are not whole blocks of the one asked for (tensor_type_fallback
# in llama-quant.cpp); f16 where the fallback's blocks do not fit either, or there is none.
FALLBACKS = {
    "q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0", "iq4_xs": "iq4_nl",
    "tq1_0": "q4_0", "tq2_0": "q4_0",
}  # fmt: skip
_EXPERT_PROJECTION = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight")
_CHUNK_ELEMENTS = 1 << 22  # rows are converted a slice of about this many elements at a time


def _kind(name: str) -> str:
    """A GGUF tensor name without its layer: blk.3.ffn_down_exps.weight -> ffn_down_exps.weight."""
    return re.sub(r"^blk\.\d+\.", "", name)


class ExportError(ValueError):
    """A conversion moerun refuses; the message says why and what to do."""


@dataclass(frozen=True)
class QuantizeSpec:
    """Formats: `experts` for the expert projections (gate and up; down too unless `down` is given),
    `rest` for the other 2-D weights."""

    experts: str
    down: str | None = None
    rest: str = "f16"

    def __post_init__(self):
        for option, fmt, known in (
            ("--experts", self.experts, EXPERT_FORMATS),
            ("--down", self.down or self.experts, EXPERT_FORMATS),
            ("--rest", self.rest, REST_FORMATS),
        ):
            if fmt in READ_ONLY:
                raise ExportError(f"{option} {fmt}: {not_writable(fmt)}")
            if fmt not in known:
                where = " for the other 2-D weights" if fmt in EXPERT_FORMATS else ""
                raise ExportError(
                    f"{option} {fmt!r} is not a format moerun writes{where}; use one of {', '.join(known)}."
                )

    @property
    def down_format(self) -> str:
        return self.down or self.experts


class TensorConverter:
    """GGUF-named tensors -> what the file stores (see the module docstring for the formats)."""

    def __init__(self, spec: QuantizeSpec, log: Callable[[str], None]):
        self.spec, self.log = spec, log
        self._said: set[str] = set()
        # tensor kind (the GGUF name without blk.N.) -> {format stored: why, "" where it was asked for}
        self.stored: dict[str, dict[str, str]] = {}

    def __call__(self, name: str, tensor: Tensor) -> Tensor:
        expert = _EXPERT_PROJECTION.fullmatch(name)
        if expert:
            fmt = self.spec.down_format if expert.group(1) == "down" else self.spec.experts
        elif len(tensor.shape) <= 1 or not name.endswith(".weight") or name.endswith("ffn_gate_inp.weight"):
            return tensor.to(torch.float32).contiguous()
        else:
            fmt = self.spec.rest
        fmt, why = self._fitting(name, fmt, tensor.shape[-1])
        self.stored.setdefault(_kind(name), {}).setdefault(fmt, why)
        if expert:
            return self._experts(name, tensor, fmt)
        return self._rows(name, tensor, fmt)

    def _fitting(self, name: str, fmt: str, row: int) -> tuple[str, str]:
        """(`fmt`, "") or, where rows of `row` elements are not whole blocks of it, (its fallback, why)."""
        block = FORMATS[fmt].block_size
        if row % block == 0:
            return fmt, ""
        fallback = FALLBACKS.get(fmt, "f16")
        if row % FORMATS[fallback].block_size:
            fallback = "f16"
        what = _kind(name)  # one message for all layers
        if what not in self._said:
            self._said.add(what)
            self.log(
                f"{what}: rows of {row} are not whole {fmt} blocks of {block}; storing them as {fallback}."
            )
        return fallback, f"rows of {row} are not whole {block}-element {fmt} blocks"

    def experts_stored(self) -> str:
        """The expert projections' formats as stored so far, e.g. "gate/up q4_k, down q8_0 (rows of 96
        are not whole 256-element q4_k blocks)"."""
        gate, up, down = (self._formats(f"ffn_{p}_exps.weight") for p in ("gate", "up", "down"))
        parts = [f"gate/up {gate}"] if gate == up else [f"gate {gate}", f"up {up}"]
        return ", ".join([*parts, f"down {down}"])

    def summary(self) -> str:
        """What the file stores: the experts' formats, the other 2-D weights' (kinds stored otherwise
        named with why), and f32 for the rest."""
        rest = {
            kind: f for kind, f in self.stored.items() if not _EXPERT_PROJECTION.fullmatch(f"blk.0.{kind}")
        }
        others = [f"{kind} {self._formats(kind)}" for kind, f in rest.items() if set(f) != {self.spec.rest}]
        weights = ", ".join([f"other 2-D weights {self.spec.rest}", *others])
        return f"experts {self.experts_stored()}; {weights}; norms, biases and routers f32"

    def _formats(self, kind: str) -> str:
        formats = self.stored.get(kind, {})
        return ", ".join(f"{fmt} ({why})" if why else fmt for fmt, why in formats.items()) or "none"

    def _experts(self, name: str, t: Tensor, fmt: str) -> QTensor:
        """[E, out, in] quantised one expert at a time; GPT-OSS's MXFP4 is moved, not requantised."""
        if isinstance(t, QTensor):
            if t.format.name == fmt:
                return t
            if t.format.name == "mxfp4_gpt_oss" and fmt == "mxfp4":
                return QTensor(get_format("mxfp4"), t.shape, gpt_oss_layout_to_mxfp4(t.data))
            if "requantise" not in self._said:
                self._said.add("requantise")
                self.log(
                    f"requantising the MXFP4 experts to {fmt} (lossy; --experts mxfp4 keeps them exactly)."
                )
        target = get_format(fmt)
        if not isinstance(t, QTensor) and target.is_float and t.dtype == FLOAT_DTYPES[fmt]:
            return t
        experts, rows, cols = t.shape
        out = torch.empty((experts, rows, target.row_bytes(cols)), dtype=torch.uint8)
        for e in range(experts):
            x = dequantize(t.expert(e)) if isinstance(t, QTensor) else t[e]
            out[e] = self._row_bytes(f"{name} (expert {e})", x, target)
        return QTensor(target, tuple(t.shape), out)

    def _rows(self, name: str, x: torch.Tensor, fmt: str) -> Tensor:
        """A 2-D weight in `fmt`; a float tensor already in `fmt` is kept as it is."""
        target = get_format(fmt)
        if target.is_float and x.dtype == FLOAT_DTYPES[fmt]:
            return x
        return QTensor(target, tuple(x.shape), self._row_bytes(name, x, target))

    @staticmethod
    def _row_bytes(name: str, x: torch.Tensor, target: QFormat) -> torch.Tensor:
        """[.., in] float -> uint8 [.., row_bytes] of `target`, a slice of rows at a time, so that no
        whole-tensor temporary (an fp32 copy, finiteness masks) is made."""
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty((rows.shape[0], target.row_bytes(x.shape[-1])), dtype=torch.uint8)
        step = max(1, _CHUNK_ELEMENTS // x.shape[-1])
        try:
            for start in range(0, rows.shape[0], step):
                out[start : start + step] = quantize_rows(target, rows[start : start + step].float())
        except FormatError as err:
            hint = " (--rest bf16 or f32 keeps it)" if target.name == "f16" else ""
            raise ExportError(f"{name}: {err}{hint}") from None
        return out.reshape(*x.shape[:-1], -1)
