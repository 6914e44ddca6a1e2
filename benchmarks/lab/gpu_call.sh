#!/usr/bin/env bash
# One device call: install what the image lacks (benchmarks/lab/gpu_payload.sh's wheels) and this tree, then
# TESTS (pytest, at most T1 s) and BENCH (a shell line, at most T2 s). Logs and JSON into $OUT/s.tgz.
#   TESTS=tests/gpu/test_structured_gpu.py BENCH="python3 -m benchmarks.lab.structured ..." bash benchmarks/lab/gpu_call.sh
set -u
cd "$(dirname "$0")/../.." || exit 1
S=/tmp/s; mkdir -p "$S"
{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  python3 -m pip install -q --no-deps --no-index .whl/*.whl .gpu/fi/*.whl .gpu/serve/*.whl
  python3 -m pip install -q --no-deps --no-index --no-build-isolation .
} > "$S/setup.log" 2>&1
tail -3 "$S/setup.log"
export INFER_TEST_TOKENIZER=$PWD/.gpu/tok
if [ -n "${TESTS:-}" ]; then
  timeout "${T1:-200}" python3 -m pytest -q -x -p no:cacheprovider ${TESTS} > "$S/tests.log" 2>&1
  echo "tests rc=$?"; tail -15 "$S/tests.log"
fi
if [ -n "${BENCH:-}" ]; then
  timeout "${T2:-300}" bash -c "$BENCH" > "$S/bench.log" 2>&1
  echo "bench rc=$?"; tail -60 "$S/bench.log"
fi
cp -f ./*.json "$S/" 2>/dev/null
tar czf "${OUT:-/tmp}/s.tgz" -C /tmp s
