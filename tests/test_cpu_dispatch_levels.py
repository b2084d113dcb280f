"""The bitwise claims (streamed == resident, the same input gives the same output, in one process
and across processes) under every CPU dispatch level torch and its libraries honour, not only this
machine's fastest kernels: ATen's vector width (ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA),
MKL's code path (MKL_ENABLE_INSTRUCTIONS) and moerun's native kernel variant (MOERUN_CPU_ISA). A
claim that holds on one vendor's kernels only fails here on a machine of either vendor. Slow: each
level reruns those tests in a fresh process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

BITWISE_TESTS = [
    "test_offload_model.py::test_logits_with_any_cache_size_equal_all_resident",
    "test_offload_model.py::test_prefetch_changes_nothing_but_the_counters",
    "test_offload_model.py::test_host_ram_tier_serves_refetched_experts_without_reading_the_file",
    "test_layer.py::test_same_input_gives_bitwise_same_output",
    "test_layer.py::test_bitwise_same_output_across_processes",
    "test_placement.py",
    "test_cpu_backend.py",
]

LEVELS = {
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "aten-avx512": {"ATEN_CPU_CAPABILITY": "avx512"},
    "onednn-avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    # moerun's own native kernels: each variant, and none (the torch backend)
    "moerun-generic": {"MOERUN_CPU_ISA": "generic"},
    "moerun-avx2": {"MOERUN_CPU_ISA": "avx2"},
    "moerun-off": {"MOERUN_CPU_ISA": "off"},
}


def _child_env(level: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST")}
    return env | level


@pytest.mark.slow
@pytest.mark.parametrize("level", list(LEVELS))
def test_bitwise_claims_hold_at_each_dispatch_level(level):
    env = _child_env(LEVELS[level])
    if "ATEN_CPU_CAPABILITY" in env:
        # the level is honoured (a CPU without the instructions falls back: then say so, not pass)
        got = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if got.lower() != env["ATEN_CPU_CAPABILITY"]:
            pytest.skip(f"this CPU runs ATen at {got}, not {env['ATEN_CPU_CAPABILITY']}")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *(f"tests/{t}" for t in BITWISE_TESTS),
        ],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1]
