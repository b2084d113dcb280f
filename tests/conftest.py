import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Without CUDA the Triton kernels run in triton's interpreter, on CPU tensors. triton reads this when
# a kernel is defined, so it is set before any test imports moerun.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in fp64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@pytest.fixture
def trace_env(monkeypatch):
    """Set MOERUN_TRACE for one test; the cached settings are re-read before and after."""
    from moerun.settings import settings

    def set_trace(value: str | None):
        if value is None:
            monkeypatch.delenv("MOERUN_TRACE", raising=False)
        else:
            monkeypatch.setenv("MOERUN_TRACE", value)
        settings.cache_clear()

    yield set_trace
    monkeypatch.delenv("MOERUN_TRACE", raising=False)
    settings.cache_clear()
