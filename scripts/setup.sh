#!/usr/bin/env bash
# Creates .venv with moerun installed in it. On a CPU-only machine it pins the CPU build of torch
# first (a bare `torch` would pull a multi-GB CUDA build). Extras: "bench" (transformers, the peer)
# or "test" (everything the tests need).
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-bench}"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        .venv/bin/python -m pip install -q torch
    else
        .venv/bin/python -m pip install -q torch==2.13.0
    fi
fi
.venv/bin/python -m pip install -q -e ".[${extra}]"
# The native CPU kernels (moerun/cpu), compiled once with the system C compiler into a cache; where
# that fails moerun says why and runs the torch path, so the setup goes on.
.venv/bin/python -m moerun.cpu.build >/dev/null || true
