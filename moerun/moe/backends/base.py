"""The interface every backend implements (moerun.moe.backends says what each does)."""

from __future__ import annotations

import enum
from typing import ClassVar


class ActivationMode(enum.Enum):
    """How activations meet a quantised weight in its dot products, decided once at load."""

    EXACT = "exact"  # in the compute dtype (fp32 in the native kernels): the reference's numbers
    INT8 = "int8"  # quantised per block to int8 (q8_K/q8_0 on the CPU, q8_1 on the GPU), as llama.cpp


class Backend:
    """The interface; moerun.moe.backends.torch_backend.TorchBackend implements it as the reference.
    `activations`: how its kernels feed quantised weights, decided once at load (`make_backend`)."""

    name: ClassVar[str]
    streams_prefill: ClassVar[bool] = True
    native_linears: ClassVar[bool] = False
    one_call_decode: ClassVar[bool] = False
    reads_experts_in_place: ClassVar[bool] = False

    def __init__(self, activations: ActivationMode = ActivationMode.EXACT):
        self.activations = activations

    @property
    def int8_activations(self) -> bool:
        return self.activations is ActivationMode.INT8

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.activations.value} activations)"

    def unsupported(self, experts) -> str | None:
        """Why this backend cannot run a layer's experts (None: it can)."""
        return None
