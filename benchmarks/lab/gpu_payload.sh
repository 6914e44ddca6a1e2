#!/usr/bin/env bash
# The wheels the GPU image lacks (shared/GPU.md), for Python 3.12 / manylinux x86_64, into the ignored
# folders a device call carries (carry [".whl", ".gpu"]), and SmolLM2's tokenizer files into .gpu/tok
# (from `infer models pull smollm2-135m`). About 30 MB in all. Then: benchmarks/lab/gpu_call.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
get() { pip download -q --no-deps --python-version 3.12 --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$@"; }
get .whl structlog gguf xgrammar==0.2.9 apache-tvm-ffi jsonschema==4.17.3 attrs pyrsistent \
  pydantic pydantic-core annotated-types typing-inspection typing_extensions
get .gpu/fi flashinfer-python==0.5.3 nvidia-cudnn-frontend
get .gpu/serve fastapi opentelemetry-api starlette uvicorn h11 anyio sniffio prometheus_client partial-json-parser httpx httpcore \
  certifi idna annotated-doc
mkdir -p .gpu/tok
cp "${INFER_CACHE_DIR:-$HOME/.cache/infer}/models/smollm2-135m/"{tokenizer.json,tokenizer_config.json,config.json} .gpu/tok/
du -sh .whl .gpu
