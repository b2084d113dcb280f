"""glibc's allocator kept from handing a forward pass's freed buffers back to the kernel.

A forward pass on the CPU allocates and frees the same few-MiB activations in every layer (torch's CPU
tensors come from malloc). glibc serves blocks above its mmap threshold with fresh mappings and
returns the heap's free top above its trim threshold, so every step pays a page fault and a zeroed
page per 4 KiB it touches, and every unmap a TLB flush on each thread: 10-20% of a 256-token prompt
(docs/PERFORMANCE.md). When a process loads moerun's native CPU kernels, `tune()` raises both
thresholds (blocks under 32 MiB from the heap; up to 256 MiB of free heap top kept), what users of
jemalloc or tcmalloc get by preloading them. `MOERUN_CPU_MALLOC=default` leaves glibc as it is; other
C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import functools

from moerun.settings import settings

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 256 << 20


@functools.cache
def tune() -> bool:
    """Raise glibc's thresholds once per process; whether they were set."""
    if settings().cpu_malloc != "tuned":
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
