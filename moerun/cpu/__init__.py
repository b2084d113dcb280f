"""moerun's native CPU kernel layer in C + OpenMP: quantised matrix products, the MoE step (one
token or many) and one token's attention block (`AttentionDecode`) and MoE routing (`moe_route`)
as single calls.

Weights stay in their file format (`moerun.quant.formats`): rows of raw bytes uint8 [out, row_bytes]
(ggml's block layouts), or dense f32/f16/bf16 [out, in]. Two modes:
  exact    fp32 activations; weights decoded with dequant.py's float operations; fp32 multiply-adds.
  integer  activations quantised per block (q8_K for the 256-element formats: k-quants, i-quants,
           tq1_0/tq2_0; q8_0 for the 32-element ones, with its sum for q4_1's and q5_1's min; float
           weights keep fp32), integer dot products, scales applied per block in fp32, as llama.cpp.
Results are bitwise reproducible: each output element is computed by one thread in an order that
depends on neither the thread count nor buffer addresses. The layer builds itself on first use
(`moerun.cpu.build`); where it cannot, `available()` is False, `unavailable_reason()` says why and
the torch path runs instead (dequantise, then multiply). This layer is moerun's one fast CPU path.
The torch reference of the matmul and the MoE step is `moerun.cpu.reference`; the decode calls
are tested against moerun's own torch modules, which they compute in one call: `AttentionDecode`
against moerun.decoder.attention (with the model's RMSNorm), `moe_route` against moerun.moe.routing,
`dequantize_rows` against moerun.quant.dequant (bit for bit).

Prefill: on avx512, integer-mode matmul of many tokens (q4_k, q5_k from T = 16; q6_k from 2; q8_0
from 4; q4_0, mxfp4 from 8; q5_0, iq4_nl, iq4_xs, iq2_xxs, iq1_s from 2; q4_1, q5_1, iq3_xxs, iq3_s,
iq2_xs, iq2_s, iq1_m, tq2_0, tq1_0 from 3) runs a GEMM (native/gemm_*.c) that decodes each weight
block once per 4 rows (gemm_lanes_*.c: 16 rows, one per zmm lane) and token chunk; it computes every
output with the row kernels' own integer sums and fp32 steps, so prefill equals decode (T = 1) bit
for bit. The MoE step takes it per expert, for the experts with that many tokens.

The formats added second (q4_1, q5_0, q5_1, iq4_nl, iq4_xs, the grid i-quants, tq1_0, tq2_0) give the
same bits on every variant: their SIMD kernels (avx2_iq4.c, avx512_iq4.c, avx2_iq.c, avx512_iq.c,
avx512_ternary.c) compute generic.c's exact int32 sums (integer mode) or decoded values in its 16
lanes (exact mode) and its fp32 steps in its order.

Not yet done (correct, via the compiler-vectorised generic C, but slow, ~1-2 GB/s per core):
exact mode for q2_k/q3_k/q5_k on every variant and for q8_0, q4_0, mxfp4, q4_k, q6_k on avx2;
integer mode for q2_k/q3_k/q5_k on avx2. No GEMM for exact mode, for q2_k/q3_k, or on avx2: there,
large T is tiled (weights stay in L2) through the row kernels.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from moerun.activations import GLU, Activation, GptOssSwiGLU
from moerun.cpu import library
from moerun.cpu.library import FORMAT_IDS, INTEGER_ACT, Q8_0_BYTES, Q8K_BYTES
from moerun.quant.formats import FLOAT_DTYPES, FormatError, get_format

__all__ = [
    "available",
    "unavailable_reason",
    "isa",
    "gemm_formats",
    "matmul",
    "moe_decode",
    "moe_decode_table",
    "ExpertTable",
    "moe_route",
    "dequantize_rows",
    "AttentionDecode",
    "AttentionShape",
    "quantize",
]

Weight = tuple[str, torch.Tensor]  # (format name, uint8 [out, row_bytes] or dense [out, in])


def available() -> bool:
    """Whether the native kernels are built and loaded (building them on first use)."""
    return not isinstance(library.load(), str)


def unavailable_reason() -> str | None:
    """Why the native kernels are unavailable (one sentence), or None where they run."""
    loaded = library.load()
    return loaded if isinstance(loaded, str) else None


def isa() -> str:
    """The variant that runs: 'generic', 'avx2' or 'avx512' (RuntimeError where unavailable)."""
    return library.native().variant


def gemm_formats(variant: str | None = None) -> frozenset[str]:
    """The formats whose integer-mode matmul runs the prefill GEMM for many tokens (from T = 2 to 64,
    per format) in `variant` (default: the dispatched one); the others run the row kernels."""
    return library.native(variant).gemm_formats


def _check_weight(fmt_name: str, data: torch.Tensor, n: int, what: str) -> int:
    """Validates one weight of `n` inputs; returns its row bytes."""
    fmt = get_format(fmt_name)
    row_bytes = fmt.row_bytes(n, what)
    if data.dtype != torch.uint8 and FLOAT_DTYPES.get(fmt_name) != data.dtype:
        raise FormatError(
            f"{what}: {fmt_name} weights must be uint8 bytes or {fmt_name} values, got {data.dtype}."
        )
    if data.ndim != 2 or data.device.type != "cpu" or not data.is_contiguous():
        raise FormatError(
            f"{what}: weights must be a contiguous 2-D CPU tensor, got shape {tuple(data.shape)}."
        )
    if data.shape[1] * data.element_size() != row_bytes:
        raise FormatError(
            f"{what}: {fmt_name} rows of {n} inputs take {row_bytes} bytes, got {tuple(data.shape)}."
        )
    return row_bytes


def _check_x(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"{what}: activations must be float32 on the CPU, got {x.dtype} on {x.device}.")
    return x.contiguous()


def matmul(
    fmt_name: str,
    data: torch.Tensor,
    x: torch.Tensor,
    integer: bool = False,
    variant: str | None = None,
    gemm: bool = True,
) -> torch.Tensor:
    """x float32 [T, in] (or [in]) times the weight's rows -> float32 [T, out] (or [out]).

    data: uint8 [out, row_bytes] of `fmt_name`, or (f32/f16/bf16) a dense [out, in] tensor.
    variant: run that ISA variant instead of the dispatched one (tests, benchmarks).
    gemm: False runs the row kernels for every T, where the prefill GEMM would take larger T (integer
    mode, formats in `gemm_formats()`); the two agree bit for bit, so this only changes the speed."""
    native = library.native(variant)
    x2 = _check_x(x, "matmul").reshape(-1, x.shape[-1])
    row_bytes = _check_weight(fmt_name, data, x.shape[-1], "matmul")
    out = torch.empty(x2.shape[0], data.shape[0], dtype=torch.float32)
    rc = native.matmul(
        FORMAT_IDS[fmt_name],
        data.data_ptr(),
        data.shape[0],
        x.shape[-1],
        row_bytes,
        x2.data_ptr(),
        x2.shape[0],
        out.data_ptr(),
        int(integer) | (0 if gemm else 2),
        torch.get_num_threads(),
    )
    library.check(rc, "moerun_matmul")
    return out if x.ndim == 2 else out[0]


def dequantize_rows(fmt_name: str, data: torch.Tensor, n: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` (int64 [count]) of a weight (as `matmul` takes it, n inputs a row) as float32
    [count, n], each value as the exact mode computes it (dequant.py's, bit for bit): the embedding
    lookup of a quantised table. Rows outside the weight: IndexError."""
    row_bytes = _check_weight(fmt_name, data, n, "dequantize_rows")
    rows = rows.reshape(-1).to(torch.int64).contiguous()
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= data.shape[0]):
        raise IndexError(f"dequantize_rows: rows must lie in [0, {data.shape[0]}).")
    out = torch.empty(rows.numel(), n, dtype=torch.float32)
    rc = library.native().dequantize_rows(
        FORMAT_IDS[fmt_name], data.data_ptr(), row_bytes, n, rows.data_ptr(), rows.numel(), out.data_ptr()
    )
    library.check(rc, "moerun_dequantize_rows")
    return out


def quantize(x: torch.Tensor, act: str) -> torch.Tensor:
    """x float32 [T, n] -> the native activation blocks as bytes uint8 [T, nbytes]: act 'q8_k' (292
    bytes per 256: fp32 d, int8 qs[256], int16 bsums[16]) or 'q8_0' (40 bytes per 32: fp32 d holding
    an fp16 value, int32 sum of qs, int8 qs[32])."""
    native = library.native()
    x = _check_x(x, "quantize")
    kind, per, size = (
        (library.ACT_Q8_K, 256, Q8K_BYTES) if act == "q8_k" else (library.ACT_Q8_0, 32, Q8_0_BYTES)
    )
    if act not in ("q8_k", "q8_0") or x.shape[-1] % per:
        raise ValueError(
            f"quantize: act must be 'q8_k' or 'q8_0' over rows of whole blocks, got {act!r}, {x.shape}."
        )
    out = torch.empty(x.shape[0], x.shape[1] // per * size, dtype=torch.uint8)
    library.check(
        native.quantize(kind, x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr()), "moerun_quantize"
    )
    return out


def _activation(act: Activation) -> tuple[int, float, float]:
    if isinstance(act, GptOssSwiGLU):
        return library.ACTIVATION_IDS["gpt_oss"], act.alpha, act.limit
    if isinstance(act, GLU):
        return library.ACTIVATION_IDS[act.gate_fn], 0.0, 0.0
    raise TypeError(f"moe_decode: activation {act!r} is not a GLU or GptOssSwiGLU.")


@dataclass(frozen=True)
class ExpertTable:
    """A step's experts as `moe_decode_table` reads them (the caller keeps the tensors the pointers
    point into alive and checked): pointers int64 [E, 6] per expert: the addresses of its gate_up's
    gate half [I, H] and up half [I, H], the bytes from one of their rows to the next (each half's
    rows that far apart, wherever the two lie), the address of its down [H, I], of its fp32 gate_up
    bias [2I] (gate's then up's) and of its down bias [H] (0: none); formats int32 [E, 2], FORMAT_IDS
    of gate_up and down; the experts' intermediate size I."""

    pointers: torch.Tensor
    formats: torch.Tensor
    intermediate: int


Slots = tuple[torch.Tensor, torch.Tensor]  # (slot_expert int32 [T, k], slot_weight float32 [T, k])


def moe_decode_table(
    x: torch.Tensor,
    table: ExpertTable,
    slots: Slots,
    act: Activation,
    integer: bool = False,
    *,
    out: torch.Tensor | None = None,
    variant: str | None = None,
    gemm: bool = True,
) -> torch.Tensor:
    """The MoE step over a prebuilt pointer table (no per-expert Python), for one token or many:
    each expert's rows are read once for all its tokens (through the prefill GEMM where an expert
    has enough of them).

    x float32 [T, H]; slots: slot_expert int32 [T, k], rows of the table, each token's slots in
    ascending expert id, -1 for a slot this call leaves out, and slot_weight float32 [T, k]. ->
    float32 [T, H]: per token o = o + weight * (down(act(gate_up(x) + b_gu)) + b_down) over its
    slots in order, from 0 into a new tensor, or onto what `out` holds (a step split into calls over
    ascending groups of experts then sums the same sequence as one call). gemm=False: the row
    kernels only (the same bits)."""
    native = library.native(variant)
    x = _check_x(x, "moe_decode")
    T, H = x.shape
    slot_expert, slot_weight = slots
    kind, alpha, limit = _activation(act)
    accumulate = out is not None
    if out is None:
        out = torch.empty(T, H, dtype=torch.float32)
    elif out.shape != (T, H) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"moe_decode: out must be contiguous float32 [{T}, {H}].")
    rc = native.moe_decode(
        table.pointers.shape[0],
        table.pointers.data_ptr(),
        table.formats.data_ptr(),
        H,
        table.intermediate,
        T,
        slot_expert.shape[1],
        slot_expert.data_ptr(),
        slot_weight.data_ptr(),
        x.data_ptr(),
        out.data_ptr(),
        kind,
        alpha,
        limit,
        int(integer) | (2 if accumulate else 0) | (0 if gemm else 4),
        torch.get_num_threads(),
    )
    library.check(rc, "moerun_moe_decode")
    return out


def gate_then_up(bias: torch.Tensor) -> torch.Tensor:
    """Interleaved gate_up biases [.., 2I] (gate j at 2j, up j at 2j + 1, GPT-OSS's) in the order the
    MoE step adds them: gate's [.., I] then up's."""
    return bias.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def moe_decode(
    x: torch.Tensor,
    gate_up: Sequence[Weight],
    down: Sequence[Weight],
    slots: Slots,
    act: Activation,
    integer: bool = False,
    biases: tuple[Sequence[torch.Tensor | None], Sequence[torch.Tensor | None]] | None = None,
    variant: str | None = None,
    gemm: bool = True,
) -> torch.Tensor:
    """`moe_decode_table` over the step's E distinct experts given as (format, data) pairs: gate_up[e]
    [2I, H], down[e] [H, I]; slots' slot_expert int32 [T, k] indexes these lists. `biases`: (gate_up
    biases, down biases), one fp32 [2I] / [H] or None per expert. gemm=False: the row kernels only."""
    if len(gate_up) != len(down) or not gate_up:
        raise ValueError(
            f"moe_decode: need as many gate_up as down weights (>0), got {len(gate_up)}, {len(down)}."
        )
    gate_up_bias, down_bias = biases if biases is not None else (None, None)
    slot_expert, slot_weight = slots
    H = x.shape[-1]
    inter = down[0][1].shape[1] * down[0][1].element_size() // get_format(down[0][0]).block_bytes
    inter *= get_format(down[0][0]).block_size
    rows, row_bytes = [], {}
    kept = []  # biases reordered for the kernel, alive until it returns
    for e, ((gf, gd), (df, dd)) in enumerate(zip(gate_up, down, strict=True)):
        for fmt_name, data, n, out, what in ((gf, gd, H, 2 * inter, "gate_up"), (df, dd, inter, H, "down")):
            key = (fmt_name, n)
            if key not in row_bytes:
                row_bytes[key] = get_format(fmt_name).row_bytes(n, f"expert {e} {what}")
            if data.dtype != torch.uint8 or data.shape != (out, row_bytes[key]) or not data.is_contiguous():
                _check_weight(fmt_name, data, n, f"expert {e} {what}")  # says what is wrong, or passes
                if data.shape[0] != out:
                    raise FormatError(
                        f"moe_decode: expert {e}'s {what} has {data.shape[0]} rows; need {out}."
                    )
        expert_biases = []
        for bias, size in (
            (gate_up_bias[e] if gate_up_bias else None, 2 * inter),
            (down_bias[e] if down_bias else None, H),
        ):
            if bias is not None and (
                bias.dtype != torch.float32 or bias.shape != (size,) or not bias.is_contiguous()
            ):
                raise FormatError(f"moe_decode: expert {e}'s bias must be contiguous float32 [{size}].")
            if bias is not None and size == 2 * inter and act.interleaved:  # the kernel's order
                bias = gate_then_up(bias).contiguous()
                kept.append(bias)
            expert_biases.append(0 if bias is None else bias.data_ptr())
        rb = gd.stride(0) * gd.element_size()
        up = gd.data_ptr() + (rb if act.interleaved else inter * rb)
        rows.append([gd.data_ptr(), up, rb * (2 if act.interleaved else 1), dd.data_ptr(), *expert_biases])
    formats = torch.tensor(
        [[FORMAT_IDS[g[0]], FORMAT_IDS[d[0]]] for g, d in zip(gate_up, down, strict=True)], dtype=torch.int32
    )
    table = ExpertTable(torch.tensor(rows, dtype=torch.int64), formats, inter)
    slot_expert = slot_expert.to(torch.int32).contiguous()
    if slot_expert.shape[0] != x.shape[0] or slot_weight.shape != slot_expert.shape:
        raise ValueError(
            f"moe_decode: slot_expert {tuple(slot_expert.shape)} and slot_weight "
            f"{tuple(slot_weight.shape)} must both be [T={x.shape[0]}, k]."
        )
    if slot_expert.numel() and (int(slot_expert.min()) < 0 or int(slot_expert.max()) >= len(gate_up)):
        raise ValueError(f"moe_decode: slot_expert must index the {len(gate_up)} experts given.")
    weights = slot_weight.float().contiguous()
    return moe_decode_table(x, table, (slot_expert, weights), act, integer, variant=variant, gemm=gemm)


LinearWeight = tuple[str, torch.Tensor, torch.Tensor | None]  # (format name, data, bias or None)


def _fp32(t: torch.Tensor | None, size: int, what: str) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.detach().float().contiguous().reshape(-1)
    if t.numel() != size:
        raise FormatError(f"{what} has {t.numel()} values; need {size}.")
    return t


@dataclass(frozen=True)
class AttentionShape:
    """What one attention block computes, as `AttentionDecode` needs it: its sizes, the epsilon of
    the RMSNorm before it (`eps`), q/k norms per head ("head") or over all heads ("full") with
    epsilon `qk_eps`, the sliding window (None: every cached key), and q, k and v clamped to
    [-clip, clip] (None: not)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    qk_norm: str | None = None
    qk_eps: float = 1e-6
    window: int | None = None
    clip: float | None = None


class AttentionDecode:
    """One attention block's decode step as one native call (`moerun_attention_decode`): x += the
    block's output for one token, its key and value written into the cache. Built once from the
    block's weights in their stored format (kept alive here, with fp32 copies of norms and biases).

    linears "q", "k", "v", "o": (format, data, bias) with data as `matmul` takes it; vectors "norm"
    [hidden], "q_norm"/"k_norm" ([head_dim] for qk_norm "head", over all heads for "full") and
    "sinks" [heads], each absent or None where the block has none."""

    def __init__(
        self,
        shape: AttentionShape,
        linears: Mapping[str, LinearWeight],
        vectors: Mapping[str, torch.Tensor | None],
        cache_dtype: torch.dtype,
    ):
        hidden, heads, kv_heads, head_dim = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim
        qk_norm = shape.qk_norm
        if cache_dtype not in library.CACHE_DTYPE_IDS or qk_norm not in library.QK_NORM_IDS:
            raise ValueError(f"AttentionDecode: cache dtype {cache_dtype}, qk_norm {qk_norm!r} unsupported.")
        self.heads, self.kv_heads, self.head_dim, self.cache_dtype = heads, kv_heads, head_dim, cache_dtype
        self._keep = []
        shapes = {"q": (heads * head_dim, hidden), "k": (kv_heads * head_dim, hidden)}
        shapes |= {"v": shapes["k"], "o": (hidden, heads * head_dim)}
        structs = []
        for name in ("q", "k", "v", "o"):
            fmt_name, data, bias = linears[name]
            rows, n = shapes[name]
            _check_weight(fmt_name, data, n, f"attention {name}")
            if data.shape[0] != rows:
                raise FormatError(f"attention {name}: {data.shape[0]} rows; need {rows}.")
            bias = _fp32(bias, rows, f"attention {name} bias")
            self._keep += [data, bias]
            structs.append(
                library.LinearStruct(
                    data.data_ptr(),
                    bias.data_ptr() if bias is not None else None,
                    rows,
                    n,
                    FORMAT_IDS[fmt_name],
                )
            )
        norm_size = {"head": (head_dim, head_dim), "full": (heads * head_dim, kv_heads * head_dim)}
        qn_size, kn_size = norm_size.get(qk_norm, (0, 0))
        kept = [
            _fp32(vectors.get("norm"), hidden, "attention norm"),
            _fp32(vectors.get("q_norm"), qn_size, "q norm") if qk_norm else None,
            _fp32(vectors.get("k_norm"), kn_size, "k norm") if qk_norm else None,
            _fp32(vectors.get("sinks"), heads, "attention sinks"),
        ]
        self._keep += kept
        ptrs = [None if t is None else t.data_ptr() for t in kept]
        self.struct = library.AttentionStruct(
            *structs,
            *ptrs,
            hidden,
            heads,
            kv_heads,
            head_dim,
            shape.window or 0,
            library.QK_NORM_IDS[qk_norm],
            library.CACHE_DTYPE_IDS[cache_dtype],
            shape.eps,
            shape.clip or 0.0,
            head_dim**-0.5,
            shape.qk_eps,
        )

    def __call__(
        self,
        x: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        pos: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        integer: bool = False,
    ) -> None:
        """x float32 [hidden] (contiguous, updated in place); cache_k/cache_v [1, kv_heads, capacity,
        head_dim] contiguous in the cache dtype; cos, sin float32 [head_dim / 2] of position `pos`."""
        shape = (1, self.kv_heads, cache_k.shape[2], self.head_dim)
        for c in (cache_k, cache_v):
            if tuple(c.shape) != shape or c.dtype != self.cache_dtype or not c.is_contiguous():
                raise ValueError(f"attention_decode: a cache must be contiguous {self.cache_dtype} {shape}.")
        if x.dtype != torch.float32 or not x.is_contiguous() or cos.dtype != torch.float32:
            raise TypeError("attention_decode: x, cos and sin must be contiguous float32.")
        rc = library.native().attention_decode(
            ctypes.byref(self.struct),
            x.data_ptr(),
            cache_k.data_ptr(),
            cache_v.data_ptr(),
            shape[2],
            pos,
            cos.data_ptr(),
            sin.data_ptr(),
            int(integer),
            torch.get_num_threads(),
        )
        library.check(rc, "moerun_attention_decode")


class RouterLogitsNotFinite(ValueError):
    """`moe_route` met a NaN or inf router logit (the caller reports the layer)."""


def moe_route(
    x: torch.Tensor,
    norm: torch.Tensor | None,
    eps: float,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor | None,
    kind: str,
    k: int = 0,
    renormalize: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """MoE routing in one native call, x float32 [H] (one token) or [T, H] -> (h = rms_norm(x, norm)
    or None without a norm, router logits [(T,) E] of h (or of x), ids int64 [(T,) k] ascending,
    their weights float32 [(T,) k]). kind: "softmax_topk" (softmax over the experts, the k most
    probable, renormalised if asked), "topk_softmax" (the k largest logits, softmax over them) or
    "logits_only" (ids and weights None: the caller routes). Each token's values are computed alone,
    so they are the same bits in any batch. norm, router_weight [E, H] and router_bias [E]:
    contiguous float32. RouterLogitsNotFinite (with the logits [T, E] as its argument) when a logit is
    NaN or inf."""
    x2 = x.reshape(-1, x.shape[-1])
    T, H, E = x2.shape[0], x2.shape[1], router_weight.shape[0]
    for t in (x2, norm, router_weight, router_bias):
        if t is not None and (t.dtype != torch.float32 or not t.is_contiguous()):
            raise TypeError("moe_route: x, norm and the router's tensors must be contiguous float32.")
    h = torch.empty(T, H) if norm is not None else None
    logits = torch.empty(T, E)
    routes = kind != "logits_only"
    ids = torch.empty(T, k, dtype=torch.int64) if routes else None
    weights = torch.empty(T, k) if routes else None
    rc = library.native().moe_route(
        x2.data_ptr(),
        T,
        H,
        None if norm is None else norm.data_ptr(),
        eps,
        router_weight.data_ptr(),
        None if router_bias is None else router_bias.data_ptr(),
        E,
        library.ROUTE_IDS[kind],
        k,
        int(renormalize),
        None if h is None else h.data_ptr(),
        logits.data_ptr(),
        ids.data_ptr() if routes else None,
        weights.data_ptr() if routes else None,
        torch.get_num_threads(),
    )
    if rc == 1:
        raise RouterLogitsNotFinite(logits)
    library.check(rc, "moerun_moe_route")
    if x.ndim == 1:
        h, logits = (None if h is None else h[0]), logits[0]
        ids, weights = (None, None) if not routes else (ids[0], weights[0])
    return h, logits, ids, weights


INTEGER_ACTIVATIONS = INTEGER_ACT  # weight format -> what integer mode quantises its input to
