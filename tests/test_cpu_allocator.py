"""moerun.cpu.allocator: once the native kernels load, a freed activation-sized buffer is reused
without new page faults (glibc's default maps and unmaps it each time); MOERUN_CPU_MALLOC=default
keeps glibc's behaviour. Each case in a fresh process, the allocator's settings being per process."""

import ctypes
import os
import subprocess
import sys

import pytest

from moerun import cpu

pytestmark = [
    pytest.mark.skipif(not cpu.available(), reason=f"native CPU kernels: {cpu.unavailable_reason()}"),
    pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"), reason="glibc only"),
]

# minor page faults of rounds 2..9 of four tensors filled, then freed (as a layer's activations
# are), of 8 + r MiB in round r: each size larger than any freed before, which glibc's default
# (its mmap threshold rising to the largest block freed) maps afresh every round
PROBE = """
import resource, torch
from moerun import cpu
assert cpu.available()
faults = []
for r in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    xs = [torch.empty((8 + r) << 18, dtype=torch.float32).fill_(1.0) for _ in range(4)]
    del xs
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[2:]))
"""


def _faults(malloc: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("MOERUN_CPU_MALLOC", None)
    if malloc is not None:
        env["MOERUN_CPU_MALLOC"] = malloc
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return int(run.stdout.split()[-1])


def test_a_freed_buffer_is_reused_without_page_faults():
    pages = sum(4 * (8 + r) << 20 for r in range(2, 10)) // 4096  # the measured rounds' tensors
    # tuned: the heap keeps the freed blocks; only its growth (4 MiB a round) faults
    assert _faults(None) <= pages // 4
    # glibc's default: each round's tensors mapped afresh and faulted in page by page
    assert _faults("default") >= pages // 2


def test_an_unknown_setting_is_refused():
    env = {**os.environ, "MOERUN_CPU_MALLOC": "jemalloc"}
    code = "from moerun.settings import settings; settings()"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "MOERUN_CPU_MALLOC='jemalloc' is not one of tuned, default" in run.stderr
