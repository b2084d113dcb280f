#!/usr/bin/env bash
# ONE command for a CUDA machine: the GPU-marked tests, then the GPU kernel benchmarks (decode per MoE
# layer against the HBM roofline, prefill TFLOP/s against torch._grouped_mm and the torch backend).
# Prints a short table; every figure goes to $OUT (default gpu_check_out/). Under 5 minutes (timeouts
# included); FULL=1 adds every kernel's unit tests compiled for the GPU (minutes more).
#
#   bash bench/gpu_check.sh [OUT]
#
# Needs python with torch, triton, transformers, pytest, hypothesis and gguf (PYTHON=... to choose it);
# moerun runs from this checkout. Wheels placed in bench/wheels/ are installed first, for offline
# machines: `pip download --no-deps pytest pluggy iniconfig gguf hypothesis sortedcontainers attrs
# -d bench/wheels` (about 2 MB) on a machine with an index, then carry the folder over.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls bench/wheels/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --find-links bench/wheels bench/wheels/*.whl >"$OUT/pip.txt" 2>&1
fi
if ! $PY - <<'PY' | tee "$OUT/env.txt"
import sys, torch, triton
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh needs a CUDA GPU; this python sees none (CPU checks: bash scripts/test.sh).")
print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
PY
then
    exit 1
fi

echo "== GPU tests: the triton backend end to end on CUDA tensors, and every test marked gpu"
timeout 110 $PY -m pytest -q -p no:cacheprovider tests/test_triton_backend.py >"$OUT/tests.txt" 2>&1
echo "triton backend tests exit $? : $(tail -n 1 "$OUT/tests.txt")"
timeout 60 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_dequant.py tests/test_q8_1.py \
    >>"$OUT/tests.txt" 2>&1
echo "gpu-marked tests exit $? : $(tail -n 1 "$OUT/tests.txt")"

echo "== GPU benchmarks"
timeout 170 $PY bench/gpu_kernels.py --json "$OUT/kernels.json" 2>"$OUT/kernels.stderr"
echo "bench exit $? ; full figures in $OUT/"

if [ "${FULL:-0}" = 1 ]; then  # every kernel's unit tests compiled for this GPU: minutes more
    echo "== kernel unit tests on CUDA"
    $PY -m pytest -q -p no:cacheprovider tests/test_kernel_weights.py tests/test_kernel_prefill.py \
        tests/test_kernel_decode.py >"$OUT/kernel_tests.txt" 2>&1
    echo "kernel tests exit $? : $(tail -n 1 "$OUT/kernel_tests.txt")"
fi
