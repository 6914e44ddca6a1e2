#!/usr/bin/env bash
# `infer run` of this tree against another (BASE, default .base: e.g. `git archive REV | tar -x -C .base`), dummy
# llama3-8b on one GPU, each workload's runs alternated base new base new (the first pair may compile kernels:
# quote the second). Output tok/s of each run to $OUT/run-ab.txt, the records as JSON in $OUT/run-ab.tgz.
# Needs the wheels the GPU image lacks in .whl (structlog, gguf: see shared/GPU.md).
set -u
export PYTHONUNBUFFERED=1
BASE=${BASE:-.base}
MODEL=${MODEL:-llama3-8b}
WORKLOADS=${WORKLOADS:-latency-1 random-256x256}
OUT=${OUT:-/tmp/out}
W=/tmp/run-ab; mkdir -p "$W" "$OUT"
[ -d .whl ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1; }
for tree in new base; do
  src=.; [ $tree = base ] && src=$BASE
  python3 -m pip install -q --no-deps --no-index --no-build-isolation --no-compile --upgrade --target /tmp/$tree "$src" || exit 1
done
for workload in $WORKLOADS; do
  for round in 1 2; do
    for tree in base new; do
      json="$W/$tree-$round-$workload.json"
      PYTHONPATH=/tmp/$tree:/tmp/site python3 -m infer.cli.main run --model "$MODEL" --load-format dummy \
        --dataset "$workload" --no-progress --show 0 --json-out "$json" >"$W/$tree-$round-$workload.log" 2>&1
      rate=$(python3 -c "import json,sys; d=json.load(open('$json')); r=d[0] if isinstance(d,list) else d; r=r.get('records',[r])[0] if isinstance(r,dict) and 'records' in r else r; print(round(r['output_tokens_per_s'],1))" 2>/dev/null || echo "failed: $(tail -3 "$W/$tree-$round-$workload.log")")
      echo "$workload round $round $tree: $rate output tok/s" | tee -a "$OUT/run-ab.txt"
    done
  done
done
tar -czf "$OUT/run-ab.tgz" -C "$W" .
