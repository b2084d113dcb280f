"""Loading the native CPU kernels: which variant runs, and the typed ctypes functions of it.

The variant is the best one this CPU supports (features read at run time by the generic library,
through libgcc's `__builtin_cpu_supports`, which also checks that the OS saves the vector state),
or the one `MOERUN_CPU_ISA` forces, lowered to what the CPU runs. torch is imported first, so the
library's NEEDED libgomp.so.1 resolves to the copy torch loaded: the kernels share torch's OpenMP
pool, and each call asks it for `torch.get_num_threads()` threads.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from dataclasses import dataclass

import torch  # noqa: F401  (loaded first: the kernels then share its libgomp)

from moerun.cpu import allocator
from moerun.quant.formats import FORMATS
from moerun.settings import settings

FORMAT_IDS = {
    name: i
    for i, name in enumerate(
        [
            "f32",
            "f16",
            "bf16",
            "q8_0",
            "q4_0",
            "q2_k",
            "q3_k",
            "q4_k",
            "q5_k",
            "q6_k",
            "mxfp4",
            "mxfp4_gpt_oss",
            "q4_1",
            "q5_0",
            "q5_1",
            "iq4_nl",
            "iq2_xxs",
            "iq2_xs",
            "iq2_s",
            "iq3_xxs",
            "iq3_s",
            "iq1_s",
            "iq1_m",
            "iq4_xs",
            "tq1_0",
            "tq2_0",
        ]
    )
}
ACT_F32, ACT_Q8_0, ACT_Q8_K = 0, 1, 2
# What integer mode quantises activations to, per weight format: q8_K for the 256-element blocks,
# q8_0 (with its sum, for q4_1's and q5_1's min) for the 32-element ones; float weights keep fp32.
INTEGER_ACT = {
    name: ACT_F32 if fmt.is_float else ACT_Q8_K if fmt.block_size == 256 else ACT_Q8_0
    for name, fmt in ((name, FORMATS[name]) for name in FORMAT_IDS)
}
Q8K_BYTES, Q8_0_BYTES = 292, 40  # bytes of the native q8_K block (256 values) and q8_0 block (32)
ACTIVATION_IDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "gpt_oss": 3}

_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx512dq", "avx512bf16")
REQUIRED = {
    "generic": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx512dq"),
}
ERRORS = {
    -1: "an unknown format or activation id",
    -2: "a row length that is not a whole number of the format's blocks (or an expert table row without "
    "a weight, or with gate_up rows closer than a row)",
    -3: "an expert index outside the table",
    -4: "out of memory for the work buffers",
}

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p


@dataclass(frozen=True)
class Native:
    variant: str
    cpu_features: frozenset[str]
    matmul: ctypes._CFuncPtr
    moe_decode: ctypes._CFuncPtr
    quantize: ctypes._CFuncPtr
    threads_used: ctypes._CFuncPtr
    attention_decode: ctypes._CFuncPtr
    moe_route: ctypes._CFuncPtr
    dequantize_rows: ctypes._CFuncPtr
    gemm_formats: frozenset[str]  # formats whose integer matmul takes the prefill GEMM for larger T


class LinearStruct(ctypes.Structure):
    """decode.c's moerun_linear: a weight's rows as the row kernels read them."""

    _fields_ = [
        ("w", _ptr),
        ("bias", _ptr),
        ("rows", _i64),
        ("n", _i64),
        ("fmt", ctypes.c_int32),
        ("pad", ctypes.c_int32),
    ]


class AttentionStruct(ctypes.Structure):
    """decode.c's moerun_attention: one attention block's weights, norms and variant."""

    _fields_ = [
        ("q", LinearStruct),
        ("k", LinearStruct),
        ("v", LinearStruct),
        ("o", LinearStruct),
        ("norm", _ptr),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
        ("sinks", _ptr),
        ("hidden", _i64),
        ("heads", _i64),
        ("kv_heads", _i64),
        ("head_dim", _i64),
        ("window", _i64),
        ("qk_norm", ctypes.c_int32),
        ("cache_dtype", ctypes.c_int32),
        ("eps", _f32),
        ("clip", _f32),
        ("scale", _f32),
        ("qk_eps", _f32),
    ]


QK_NORM_IDS = {None: 0, "head": 1, "full": 2}
CACHE_DTYPE_IDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ROUTE_IDS = {"logits_only": -1, "softmax_topk": 0, "topk_softmax": 1}


def _typed(lib: ctypes.CDLL, name: str, restype, *argtypes) -> ctypes._CFuncPtr:
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


def _cpu_features(generic: ctypes.CDLL) -> frozenset[str]:
    bits = _typed(generic, "moerun_cpu_features", _i32)()
    return frozenset(name for i, name in enumerate(_FEATURES) if bits >> i & 1)


def pick_variant(features: frozenset[str], forced: str | None) -> str:
    """The best variant `features` run, no higher than `forced` (a name of REQUIRED, or None)."""
    order = list(REQUIRED)
    allowed = order[: order.index(forced) + 1] if forced else order
    return [v for v in allowed if set(REQUIRED[v]) <= features][-1]


def runnable_variants() -> list[str]:
    """The variants this CPU can run, lowest first (empty where the kernels are unavailable)."""
    loaded = load()
    return [] if isinstance(loaded, str) else [v for v in REQUIRED if set(REQUIRED[v]) <= loaded.cpu_features]


@functools.cache
def load_variant(variant: str) -> Native:
    """One variant by name (tests and benchmarks compare them); RuntimeError if this CPU cannot run it."""
    dispatched = native()
    if variant not in runnable_variants():
        raise RuntimeError(
            f"this CPU cannot run the {variant} kernels (runs: {', '.join(runnable_variants())})."
        )
    if variant == dispatched.variant:
        return dispatched
    from moerun.cpu import build as _build

    return _bind(ctypes.CDLL(str(_build.build()[variant])), variant, dispatched.cpu_features)


@functools.cache
def load() -> Native | str:
    """The loaded variant, or why the native kernels are unavailable (one sentence)."""
    forced = settings().cpu_isa
    if forced == "off":
        return "the native CPU kernels are off (MOERUN_CPU_ISA=off)."
    from moerun.cpu import build as _build  # not at import: `python -m moerun.cpu.build` runs it as main

    try:
        paths = _build.build(announce=True)
    except _build.BuildError as exc:
        reason = f"the native CPU kernels could not be built: {exc}"
        print(f"moerun: {reason} Using the torch path.", file=sys.stderr)
        return reason
    try:
        features = _cpu_features(ctypes.CDLL(str(paths["generic"])))
        variant = pick_variant(features, forced)
        if forced and variant != forced:
            print(f"moerun: MOERUN_CPU_ISA={forced}, but this CPU runs at most {variant}.", file=sys.stderr)
        lib = ctypes.CDLL(str(paths[variant]))
    except OSError as exc:
        reason = f"the native CPU kernels could not be loaded: {exc}."
        print(f"moerun: {reason} Using the torch path.", file=sys.stderr)
        return reason
    allocator.tune()
    return _bind(lib, variant, features)


def _bind(lib: ctypes.CDLL, variant: str, features: frozenset[str]) -> Native:
    gemm_bits = _typed(lib, "moerun_gemm_formats", _i32)()
    return Native(
        variant=variant,
        cpu_features=features,
        # fmt, w, rows, n, row_bytes, x, T, y, integer, nthreads
        matmul=_typed(lib, "moerun_matmul", _i32, _i32, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i32, _i32),
        # E, table, fmts, H, I, T, k, slot_expert, slot_weight, x, out, act, alpha, limit, integer, nthreads
        moe_decode=_typed(
            lib,
            "moerun_moe_decode",
            _i32,
            *(_i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i32, _f32, _f32, _i32, _i32),
        ),
        # act, x, T, n, out
        quantize=_typed(lib, "moerun_quantize", _i32, _i32, _ptr, _i64, _i64, _ptr),
        threads_used=_typed(lib, "moerun_threads_used", _i32, _i32),
        # attention, x, cache_k, cache_v, capacity, pos, cos, sin, integer, nthreads
        attention_decode=_typed(
            lib, "moerun_attention_decode", _i32, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i32, _i32
        ),
        # fmt, w, row_bytes, n, rows, count, out
        dequantize_rows=_typed(lib, "moerun_dequantize_rows", _i32, _i32, _ptr, _i64, _i64, _ptr, _i64, _ptr),
        # x, T, H, norm, eps, router_w, router_b, E, kind, k, renormalize, h, logits, ids, weights, nthreads
        moe_route=_typed(
            lib,
            "moerun_moe_route",
            _i32,
            *(_ptr, _i64, _i64, _ptr, _f32, _ptr, _ptr, _i64, _i32, _i64, _i32, _ptr, _ptr, _ptr, _ptr, _i32),
        ),
        gemm_formats=frozenset(name for name, i in FORMAT_IDS.items() if gemm_bits >> i & 1),
    )


def native(variant: str | None = None) -> Native:
    """The loaded variant (or `variant` by name); RuntimeError (saying why) where unavailable."""
    if variant is not None:
        return load_variant(variant)
    loaded = load()
    if isinstance(loaded, str):
        raise RuntimeError(loaded)
    return loaded


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise ValueError(f"{what} refused its arguments: {ERRORS.get(rc, f'error {rc}')}.")
