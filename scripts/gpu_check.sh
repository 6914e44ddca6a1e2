#!/usr/bin/env bash
# One run on the GPU machine: install what it lacks, GPU tests, benchmarks, end-to-end table last.
#   bash scripts/gpu_check.sh [tests|bench|e2e ...]   (default: all three)
# Expects wheels in $WHEELS (default .whl/): structlog, gguf, flashinfer-python with apache-tvm-ffi and
# nvidia-cudnn-frontend, xformers, and infer itself (`pip wheel --no-deps . -w .whl`); the GPU image has the rest.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
steps=${*:-tests bench e2e}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export FLASHINFER_WORKSPACE_BASE=$PWD/.cache/flashinfer   # keep JIT-compiled kernels in an ignored folder
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${WHEELS:-.whl}"/*.whl || exit 1
export PYTHONPATH=/tmp/site
export PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
for step in $steps; do
  case $step in
    tests) python3 -m pytest -m gpu tests/gpu -v -rfs -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | grep -v PASSED | tail -40 ;;
    bench) python3 -m pytest benchmarks -q -p no:cacheprovider --benchmark-enable --benchmark-only \
             --benchmark-json "$OUT/bench.json" --benchmark-columns=mean,median,min,rounds 2>&1 | tee "$OUT/bench.log" | tail -60 ;;
    e2e)   python3 scripts/gpu_bench.py --out "$OUT/e2e.json" ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e.log" | grep -v "^\s*$" | tail -30 ;;
  esac
done
