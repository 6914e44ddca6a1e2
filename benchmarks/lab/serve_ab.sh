#!/usr/bin/env bash
# `infer serve` throughput of this tree against another (BASE, default .base: e.g. `git archive REV | tar -x -C .base`),
# dummy llama3-8b on one GPU: each tree's server started in turn, A B A B, and `infer bench serve` (this tree's)
# running random-256x256 x 1000 and sharegpt-like x 600 against each, all requests at once. Figures to $OUT.
# Needs the serve extra's wheels in .whl (fastapi, starlette, uvicorn, pydantic, pydantic_core, annotated-types,
# typing-inspection, partial-json-parser, structlog, gguf): see shared/GPU.md.
set -u
export PYTHONUNBUFFERED=1
BASE=${BASE:-.base}
MODEL=${MODEL:-llama3-8b:load_format=dummy}
WORKLOADS=${WORKLOADS:-random-256x256:1000 sharegpt-like:600}
OUT=${OUT:-/tmp/out}
W=/tmp/serve-ab; mkdir -p "$W" "$OUT"
[ -d .whl ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1; }
for tree in new base; do
  src=.; [ $tree = base ] && src=$BASE
  python3 -m pip install -q --no-deps --no-index --no-build-isolation --no-compile --target /tmp/$tree "$src" || exit 1
done
port=8100
serve_and_bench() {  # tree round
  local tree=$1 round=$2
  port=$((port + 1))
  PYTHONPATH=/tmp/$tree:/tmp/site python3 -m infer.cli.main serve --model "$MODEL" \
    --port $port >"$W/serve-$tree-$round.log" 2>&1 &
  local pid=$!
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 $pid 2>/dev/null || { echo "server $tree died"; tail -20 "$W/serve-$tree-$round.log"; return; }
    sleep 1
  done
  for workload in $WORKLOADS; do
    local name=${workload%%:*} num=${workload##*:}
    PYTHONPATH=/tmp/new:/tmp/site python3 -m infer.cli.main bench serve --base-url "http://127.0.0.1:$port" \
      --workload "$name" --num-prompts "$num" --json "$W/$tree-$round-$name.json" >"$W/bench-$tree-$round-$name.log" 2>&1
    echo "== $tree round $round $name"; sed -n 3,5p "$W/bench-$tree-$round-$name.log"
  done
  kill -TERM $pid; wait $pid
  echo "$tree round $round: server exit $?"
}
serve_and_bench base 1
serve_and_bench new 1
serve_and_bench base 2
serve_and_bench new 2
tar -czf "$OUT/serve-ab.tgz" -C "$W" .
