"""The GPU scripts in bench/ run end to end (tiny shapes; on CPU in triton's interpreter): slow."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.slow
def test_tune_writes_configs_that_launch_config_reads_back(tmp_path):
    from moerun.kernels.configs import launch_config

    sys.path.insert(0, str(BENCH))
    from tune_kernels import DECODE_GRID, PREFILL_GRID, candidates

    subprocess.run(
        [sys.executable, str(BENCH / "tune_kernels.py"), "--smoke", "--out", str(tmp_path)], check=True
    )
    table = json.loads((tmp_path / "cpu.json").read_text())
    assert {key.split("|")[0] for key in table} == {
        "decode_gate_up",
        "decode_down",
        "prefill_gate_up",
        "prefill_down",
    }
    for key, config in table.items():
        kernel, fmt, shape = key.split("|")
        n, k = map(int, shape.split("x"))
        assert launch_config(kernel, fmt, n, k, "cpu", tmp_path) == config
        grid = DECODE_GRID if kernel.startswith("decode") else PREFILL_GRID
        assert config in candidates(grid, smoke=True)


@pytest.mark.slow
def test_gpu_kernel_bench_prints_its_table_and_writes_figures(tmp_path):
    out = tmp_path / "figures.json"
    run = subprocess.run(
        [sys.executable, str(BENCH / "gpu_kernels.py"), "--smoke", "--json", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert len(figures["decode"]) == 5 and len(figures["prefill"]) == 3
    for row in figures["decode"]:
        assert row["roofline_us"] > 0 and row["layer_us"] > 0 and row["experts_us"] > 0
        assert f"{row['shape']} {row['format']}" in run.stdout
