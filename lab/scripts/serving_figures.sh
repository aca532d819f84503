#!/bin/bash
# The serving figures (issues: one byte budget; compress a document once), one after the other on a
# quiet machine; each step writes its own folder (docs/serving.md renders the tables from them).
# Chunked prefill is the default (--chunk-tokens 1024), decode steps read quantized layers through
# the fused read. Then the equal-bytes grid resumes.
#
#     nohup bash lab/scripts/serving_figures.sh > runs/serving-figures.log 2>&1 &
set -u
KVB=${KVB:-.venv/bin/kvbudget}
source "$(dirname "$0")/step.sh"
# the byte budget under the cap of two full conversations, beside the full cache, SnapKV keeping
# 12.5% and quantization alone; the others' TPOT while 8K prompts are read in pieces
step "8K needles: bytes, chunked prefill" $KVB bench serve --model qwen2.5-coder-0.5b --length 8192 \
  --clients 9 --requests 9 --max-tokens 64 --ignore-eos \
  --methods full,snapkv,snapkv:memory=0.125,full:kv_bits=4 --out lab/results/serve-cpu-8k-bytes-chunked
# one document, eight clients, four questions each: the shared documents at 8K
step "shared 8K, documents" $KVB bench serve --workload shared --model qwen2.5-coder-0.5b --length 8192 \
  --clients 8 --modes document,document:reload,document:full --out lab/results/serve-shared-8k
# docs/benchmarks.md's 8K table, remeasured with the grouped one-token layout
step "bench 8K" env OMP_NUM_THREADS=2 $KVB bench --methods full,snapkv,ada-snapkv,lava --budgets 256 \
  --lengths 8192 --repeats 3 --new-tokens 64 --threads 2 --out lab/results/bench-cpu-8k
echo "=== $(date -u +%FT%TZ) serving figures done"
KVBUDGET_LOCK=/tmp/kvb-torch.lock bash lab/scripts/byte_budget_grid.sh >> runs/bytes-grid.log 2>&1
