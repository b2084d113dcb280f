#!/usr/bin/env bash
# ONE command for a CUDA machine: the GPU-marked tests, then the GPU kernel benchmarks (decode per MoE
# layer against the HBM roofline, prefill TFLOP/s against torch._grouped_mm and the torch backend).
# Prints a short table; every figure goes to $OUT (default gpu_check_out/). Under 5 minutes on an H200.
#
#   bash bench/gpu_check.sh [OUT]
#
# Needs python with torch, triton, transformers and pytest (PYTHON=... to choose it); moerun runs from
# this checkout. Wheels placed in bench/wheels/ are installed first (offline machines).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls bench/wheels/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --find-links bench/wheels bench/wheels/*.whl >"$OUT/pip.txt" 2>&1
fi
$PY - <<'PY' | tee "$OUT/env.txt"
import torch, triton
print(f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA'} | torch {torch.__version__} | triton {triton.__version__}")
PY

echo "== GPU tests (tests marked gpu, and the Triton kernel tests on CUDA tensors)"
timeout 150 $PY -m pytest -q -p no:cacheprovider -x \
    tests/test_kernel_weights.py tests/test_kernel_prefill.py tests/test_kernel_decode.py \
    tests/test_triton_backend.py tests/test_q8_1.py tests/test_dequant.py -m "gpu or not slow" \
    >"$OUT/tests.txt" 2>&1
echo "tests exit $? : $(tail -n 1 "$OUT/tests.txt")"

echo "== GPU benchmarks"
timeout 200 $PY bench/gpu_kernels.py --json "$OUT/kernels.json" 2>"$OUT/kernels.stderr"
echo "bench exit $? ; full figures in $OUT/"
