"""Fused dequantise-and-multiply matrix-vector products for CPU decode, compiled by numba.

Each kernel multiplies rows [r0, r1) of one expert's quantised weights, data uint8 [out, row_bytes]
in ggml's block layout (see moerun.quant.dequant's unpack_* functions), by x float32 [in], writing
float32 y[r0:r1]. The kernels are single-threaded and release the GIL; `numba_matvec` splits the rows
into torch.get_num_threads() ranges and runs them on a module-level thread pool. Numba's own
parallel loops are deliberately not used: its OpenMP pool and torch's libgomp pool fought over the
cores (calls stalling 8-50 ms, one run hung). Per block the integer quants are dotted with x as
uint8 converted to float32 (which vectorises), and the block's scales are applied to those dots;
offsets (q4_0's 8, the k-quants' mins) go through per-sub-block sums of x. fp16 scales are decoded
through an exponent table, as numba has no float16 type.

The first call per format compiles (seconds) and says so on stderr; numba caches the machine code on
disk (`cache=True`), so later processes only load it, and say nothing (`first_call`).
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import torch
from numba.core import event

_jit = numba.njit(nogil=True, cache=True, fastmath=True)
_inline = numba.njit(inline="always", fastmath=True, cache=True)

# fp16 exponent e -> the float32 weight of one mantissa unit (e = 0: subnormal, 2^-24).
_F16_UNIT = np.array([2.0**-24] + [2.0 ** (e - 25) for e in range(1, 31)] + [np.inf], np.float32)
# E8M0 byte -> half its scale, 2^(e - 128) (ggml's ggml_e8m0_to_fp32_half, as dequant.e8m0_half_scale).
_E8M0_HALF_BITS = [(0x00200000 << e) if e < 2 else ((e - 1) << 23) for e in range(256)]
E8M0_HALF = np.array(_E8M0_HALF_BITS, np.uint32).view(np.float32)


@_inline
def _f16(lo, hi):
    """The fp16 with little-endian bytes lo, hi as float32 (NaN payloads are not kept)."""
    h = np.int32(lo) | (np.int32(hi) << 8)
    e = (h >> 10) & 31
    m = h & 1023
    v = np.float32(m | (np.int32(e != 0) << 10)) * _F16_UNIT[e]
    return -v if h & 0x8000 else v


@_inline
def _block_sums(x, size):
    """x float32 [in] -> the sums of its runs of `size` elements, float32 [in / size]."""
    n = x.shape[0] // size
    sums = np.empty(n, np.float32)
    for s in range(n):
        acc = np.float32(0)
        for l in range(size):
            acc += x[s * size + l]
        sums[s] = acc
    return sums


@_jit
def q8_0_rows(data, x, y, r0, r1):
    """Q8_0 (34-byte blocks: fp16 d, 32 int8 q): y[r] = sum over blocks of d * (q . x)."""
    signed = data.view(np.int8)
    nb = x.shape[0] // 32
    acc = np.empty(32, np.float32)
    for r in range(r0, r1):
        row, qs = data[r], signed[r]
        acc[:] = 0
        for b in range(nb):
            o = b * 34
            d = _f16(row[o], row[o + 1])
            for l in range(32):
                acc[l] += d * (np.float32(qs[o + 2 + l]) * x[b * 32 + l])
        y[r] = acc.sum()


@_jit
def q4_0_rows(data, x, y, r0, r1):
    """Q4_0 (18-byte blocks: fp16 d, 16 bytes: element j low nibble, j + 16 high, both offset by 8)."""
    nb = x.shape[0] // 32
    acc = np.empty(16, np.float32)
    for r in range(r0, r1):
        row = data[r]
        acc[:] = 0
        for b in range(nb):
            o, xo = b * 18, b * 32
            d = _f16(row[o], row[o + 1])
            for l in range(16):
                q = row[o + 2 + l]
                low = np.float32(np.uint8(q & 15)) - np.float32(8)
                high = np.float32(np.uint8(q >> 4)) - np.float32(8)
                acc[l] += d * (low * x[xo + l] + high * x[xo + 16 + l])
        y[r] = acc.sum()


@_inline
def _e2m1_doubled(code):
    """An E2M1 code 0..15 -> twice its value (0, 1, 2, 3, 4, 6, 8, 12, then negated), by arithmetic:
    it vectorises, where a table lookup becomes a gather."""
    m = np.int32(code & 7)
    magnitude = np.float32(m if m < 4 else (2 + (m & 1)) << ((m >> 1) - 1))
    return -magnitude if code & 8 else magnitude


@_jit
def mxfp4_rows(data, x, y, r0, r1):
    """GGUF MXFP4 (17-byte blocks: E8M0 byte, 16 bytes: element j low nibble, j + 16 high nibble)."""
    nb = x.shape[0] // 32
    acc = np.empty(16, np.float32)
    for r in range(r0, r1):
        row = data[r]
        acc[:] = 0
        for b in range(nb):
            o, xo = b * 17, b * 32
            scale = E8M0_HALF[row[o]]
            for l in range(16):
                q = row[o + 1 + l]
                acc[l] += scale * (_e2m1_doubled(q & 15) * x[xo + l] + _e2m1_doubled(q >> 4) * x[xo + 16 + l])
        y[r] = acc.sum()


@_inline
def _k4_scale_min(row, o, j):
    """Sub-block j's 6-bit (scale, min) from a Q4_K/Q5_K block's 12 bytes at o + 4 (get_scale_min_k4)."""
    if j < 4:
        return np.float32(row[o + 4 + j] & 63), np.float32(row[o + 8 + j] & 63)
    sc = (row[o + 8 + j] & 15) | ((row[o + j] >> 6) << 4)
    m = (row[o + 8 + j] >> 4) | ((row[o + 4 + j] >> 6) << 4)
    return np.float32(sc), np.float32(m)


@_inline
def _k4_mins(row, o, xsum, b):
    """sum over the 8 sub-blocks of min * (sum of x over the sub-block), for super-block b at o."""
    acc = np.float32(0)
    for j in range(8):
        _, m = _k4_scale_min(row, o, j)
        acc += m * xsum[b * 8 + j]
    return acc


@_jit
def q4_k_rows(data, x, y, r0, r1):
    """Q4_K (144-byte blocks: fp16 d, dmin, 12 bytes of scales and mins, 128 bytes whose 32-byte chunk
    i holds sub-block 2i in its low nibbles and 2i + 1 in its high): value = d*sc*q - dmin*m."""
    nb = x.shape[0] // 256
    xsum = _block_sums(x, 32)
    for r in range(r0, r1):
        row = data[r]
        total = np.float32(0)
        for b in range(nb):
            o = b * 144
            acc = np.float32(0)
            for i in range(4):
                qo, xo = o + 16 + 32 * i, b * 256 + 64 * i
                lo = np.float32(0)
                hi = np.float32(0)
                for l in range(32):
                    q = row[qo + l]
                    lo += np.float32(np.uint8(q & 15)) * x[xo + l]
                    hi += np.float32(np.uint8(q >> 4)) * x[xo + 32 + l]
                sc0, _ = _k4_scale_min(row, o, 2 * i)
                sc1, _ = _k4_scale_min(row, o, 2 * i + 1)
                acc += sc0 * lo + sc1 * hi
            mins = _k4_mins(row, o, xsum, b)
            total += _f16(row[o], row[o + 1]) * acc - _f16(row[o + 2], row[o + 3]) * mins
        y[r] = total


@_jit
def q5_k_rows(data, x, y, r0, r1):
    """Q5_K (176-byte blocks): Q4_K's with 32 `qh` bytes after the scales; bit s of qh[l] is the
    fifth bit of element l of sub-block s."""
    nb = x.shape[0] // 256
    xsum = _block_sums(x, 32)
    for r in range(r0, r1):
        row = data[r]
        total = np.float32(0)
        for b in range(nb):
            o = b * 176
            acc = np.float32(0)
            for i in range(4):
                qo, xo = o + 48 + 32 * i, b * 256 + 64 * i
                lo = np.float32(0)
                hi = np.float32(0)
                for l in range(32):
                    q = row[qo + l]
                    h = row[o + 16 + l] >> (2 * i)
                    lo += np.float32(np.uint8((q & 15) | ((h & 1) << 4))) * x[xo + l]
                    hi += np.float32(np.uint8((q >> 4) | ((h & 2) << 3))) * x[xo + 32 + l]
                sc0, _ = _k4_scale_min(row, o, 2 * i)
                sc1, _ = _k4_scale_min(row, o, 2 * i + 1)
                acc += sc0 * lo + sc1 * hi
            mins = _k4_mins(row, o, xsum, b)
            total += _f16(row[o], row[o + 1]) * acc - _f16(row[o + 2], row[o + 3]) * mins
        y[r] = total


@_jit
def q6_k_rows(data, x, y, r0, r1):
    """Q6_K (210-byte blocks: ql[128], qh[64], 16 int8 scales, fp16 d): in 128-element half n,
    element 32k + l takes the low (k < 2) or high nibble of ql[64n + 32 (k & 1) + l] and bits 2k of
    qh[32n + l]; q = those 6 bits - 32, one scale per 16 elements."""
    nb = x.shape[0] // 256
    signed = data.view(np.int8)
    acc = np.empty(32, np.float32)
    scales = np.empty(8, np.float32)
    for r in range(r0, r1):
        row, srow = data[r], signed[r]
        acc[:] = 0
        for b in range(nb):
            o = b * 210
            d = _f16(row[o + 208], row[o + 209])
            for n in range(2):
                ql, qh, xo = o + 64 * n, o + 128 + 32 * n, b * 256 + 128 * n
                for s in range(8):  # scale s covers elements 16 s .. 16 s + 15 of the half
                    scales[s] = d * np.float32(srow[o + 192 + 8 * n + s])
                for l in range(32):
                    a, c, h = np.int32(row[ql + l]), np.int32(row[ql + 32 + l]), np.int32(row[qh + l])
                    q0 = np.float32(((a & 15) | ((h & 3) << 4)) - 32)
                    q1 = np.float32(((c & 15) | (((h >> 2) & 3) << 4)) - 32)
                    q2 = np.float32(((a >> 4) | (((h >> 4) & 3) << 4)) - 32)
                    q3 = np.float32(((c >> 4) | (((h >> 6) & 3) << 4)) - 32)
                    t = l >> 4
                    acc[l] += (
                        scales[t] * (q0 * x[xo + l])
                        + scales[2 + t] * (q1 * x[xo + 32 + l])
                        + scales[4 + t] * (q2 * x[xo + 64 + l])
                        + scales[6 + t] * (q3 * x[xo + 96 + l])
                    )
        y[r] = acc.sum()


@_jit
def q2_k_rows(data, x, y, r0, r1):
    """Q2_K (84-byte blocks: 16 bytes of (scale | min << 4), qs[64], fp16 d, dmin): element
    128h + 32j + l is bits 2j of qs[32h + l], sub-blocks of 16; value = d*sc*q - dmin*m."""
    nb = x.shape[0] // 256
    xsum = _block_sums(x, 16)
    acc = np.empty(16, np.float32)
    for r in range(r0, r1):
        row = data[r]
        acc[:] = 0
        mins = np.float32(0)
        for b in range(nb):
            o = b * 84
            d, dmin = _f16(row[o + 80], row[o + 81]), _f16(row[o + 82], row[o + 83])
            for h in range(2):
                for j in range(4):
                    s, qo, xo = 8 * h + 2 * j, o + 16 + 32 * h, b * 256 + 128 * h + 32 * j
                    p0, p1 = np.int32(row[o + s]), np.int32(row[o + s + 1])
                    s0, s1 = d * np.float32(p0 & 15), d * np.float32(p1 & 15)
                    for l in range(16):
                        q0 = np.float32(np.uint8((row[qo + l] >> (2 * j)) & 3))
                        q1 = np.float32(np.uint8((row[qo + 16 + l] >> (2 * j)) & 3))
                        acc[l] += s0 * (q0 * x[xo + l]) + s1 * (q1 * x[xo + 16 + l])
                    mins += dmin * (
                        np.float32(p0 >> 4) * xsum[16 * b + s] + np.float32(p1 >> 4) * xsum[16 * b + s + 1]
                    )
        y[r] = acc.sum() - mins


@_inline
def _q3_k_scale(row, o, s):
    """Q3_K sub-block s's 6-bit scale (from the 12 bytes at o + 96), minus 32."""
    low = (np.int32(row[o + 96 + s]) & 15) if s < 8 else (np.int32(row[o + 88 + s]) >> 4)
    high = (np.int32(row[o + 104 + (s & 3)]) >> (2 * (s >> 2))) & 3
    return np.float32((low | (high << 4)) - 32)


@_jit
def q3_k_rows(data, x, y, r0, r1):
    """Q3_K (110-byte blocks: hmask[32], qs[64], 12 bytes of scales, fp16 d): element 128h + 32j + l
    has 2 low bits as Q2_K's and bit 4h + j of hmask[l]; q = low - 4 where that bit is clear."""
    nb = x.shape[0] // 256
    acc = np.empty(32, np.float32)
    for r in range(r0, r1):
        row = data[r]
        acc[:] = 0
        for b in range(nb):
            o = b * 110
            d = _f16(row[o + 108], row[o + 109])
            for h in range(2):
                for j in range(4):
                    s, g, xo = 8 * h + 2 * j, 4 * h + j, b * 256 + 128 * h + 32 * j
                    s0, s1 = d * _q3_k_scale(row, o, s), d * _q3_k_scale(row, o, s + 1)
                    for l in range(32):
                        low = (np.int32(row[o + 32 + 32 * h + l]) >> (2 * j)) & 3
                        q = np.float32((low | (((np.int32(row[o + l]) >> g) & 1) << 2)) - 4)
                        acc[l] += (s0 if l < 16 else s1) * (q * x[xo + l])
        y[r] = acc.sum()


def _gpt_oss_order(x: np.ndarray) -> np.ndarray:
    """x [in] reordered so that `mxfp4_rows` reads `mxfp4_gpt_oss` blocks, whose byte j holds
    elements 2j (low nibble) and 2j + 1 (high): per 32, the even elements then the odd ones."""
    return np.ascontiguousarray(x.reshape(-1, 16, 2).transpose(0, 2, 1)).reshape(-1)


# format -> (rows kernel, x reordering or None)
_KERNELS: dict[str, tuple[Callable, Callable[[np.ndarray], np.ndarray] | None]] = {
    "q8_0": (q8_0_rows, None),
    "q4_0": (q4_0_rows, None),
    "mxfp4": (mxfp4_rows, None),
    "mxfp4_gpt_oss": (mxfp4_rows, _gpt_oss_order),
    "q2_k": (q2_k_rows, None),
    "q3_k": (q3_k_rows, None),
    "q4_k": (q4_k_rows, None),
    "q5_k": (q5_k_rows, None),
    "q6_k": (q6_k_rows, None),
}
# Rows are handed out in chunks of about this many bytes of weights, one at a time, to whichever
# thread is free. A fixed half each would make a call as slow as its slowest thread, and a pool thread
# can be kept off its core for milliseconds: after each parallel torch op, torch's OpenMP workers
# spin-wait on the other core. This way the calling thread does the chunks the pool thread cannot.
_CHUNK_BYTES = 128 * 1024
thread_pool = ThreadPoolExecutor(
    max_workers=max(1, (os.cpu_count() or 1) - 1), thread_name_prefix="moerun-matvec"
)
_ready: set[Callable] = set()  # kernels compiled or loaded in this process
_first_calls = threading.Lock()


class _SayWhenCompiling(event.Listener):
    """Prints `message` on stderr when numba starts compiling `kernel`. Numba broadcasts its
    "numba:compile" event only on a real compile, never when it loads the kernel from its disk cache."""

    def __init__(self, kernel: Callable, message: str):
        self.kernel, self.message, self.said = kernel, message, False

    def on_start(self, ev: event.Event) -> None:
        if ev.data["dispatcher"] is self.kernel and not self.said:
            self.said = True
            sys.stdout.flush()  # text already written to stdout stays before the message
            print(self.message, file=sys.stderr, flush=True)

    def on_end(self, ev: event.Event) -> None:
        pass


def first_call(kernel: Callable, args: tuple, message: str) -> None:
    """kernel(*args) once per process, on this thread alone, so that numba compiles it (or loads it from
    its disk cache) before pool threads call it; prints `message` on stderr only if it really compiles."""
    if kernel in _ready:
        return
    with _first_calls:
        if kernel not in _ready:
            with event.install_listener("numba:compile", _SayWhenCompiling(kernel, message)):
                kernel(*args)
            _ready.add(kernel)


class RowChunks:
    """One call's rows, split into chunks that the calling thread and pool threads take in turn."""

    def __init__(self, kernel: Callable, rows: np.ndarray, x: np.ndarray, y: np.ndarray, chunk: int):
        self.kernel, self.rows, self.x, self.y, self.chunk = kernel, rows, x, y, chunk
        self.count = -(-rows.shape[0] // chunk)
        self.next = itertools.count()  # next(...) is atomic under the GIL

    def work(self, busy: threading.Lock | None = None) -> None:
        """Multiply chunks until none is left; a pool thread holds `busy` while it owns a chunk."""
        while True:
            if busy is not None:
                busy.acquire()
            try:
                c = next(self.next)
                if c >= self.count:
                    return
                r0 = c * self.chunk
                self.kernel(self.rows, self.x, self.y, r0, min(r0 + self.chunk, self.rows.shape[0]))
            finally:
                if busy is not None:
                    busy.release()


def run_in_chunks(kernel: Callable, rows: np.ndarray, x: np.ndarray, y: np.ndarray, chunk: int) -> None:
    """kernel(rows, x, y, start, end) over all rows, in chunks of `chunk` rows that this thread and
    the pool threads take in turn (one thread alone when torch is set to one, or for one chunk)."""
    helpers = min(torch.get_num_threads(), os.cpu_count() or 1) - 1
    if helpers < 1 or rows.shape[0] <= chunk:
        kernel(rows, x, y, 0, rows.shape[0])
        return
    job = RowChunks(kernel, rows, x, y, chunk)
    locks = [threading.Lock() for _ in range(min(helpers, job.count - 1))]
    for busy in locks:
        thread_pool.submit(job.work, busy)
    job.work()
    # Wait only for chunks a pool thread has taken; one that starts later finds none left.
    for busy in locks:
        with busy:
            pass


def has_numba_matvec(fmt_name: str) -> bool:
    return fmt_name in _KERNELS


def numba_matvec(fmt_name: str, data: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One expert's quantised rows data uint8 [out, row_bytes] (CPU) times x [in] -> float32 [out]."""
    kernel, reorder = _KERNELS[fmt_name]
    rows = data.contiguous().numpy()  # zero-copy views of the torch tensors
    xs = x.detach().to(torch.float32).contiguous().numpy()
    if reorder is not None:
        xs = reorder(xs)
    out = rows.shape[0]
    y = np.empty(out, np.float32)
    message = (
        f"moerun: compiling the {fmt_name} decode kernel with numba "
        "(once; later runs load it from numba's disk cache)"
    )
    first_call(kernel, (rows, xs, y, 0, 0), message)
    run_in_chunks(kernel, rows, xs, y, chunk=max(1, _CHUNK_BYTES // max(1, rows.shape[1])))
    return torch.from_numpy(y)
