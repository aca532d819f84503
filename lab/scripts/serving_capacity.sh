#!/bin/bash
# How many 8K conversations the cap holds at once under the byte budget, with prompts read at once
# (--chunk-tokens 0: every waiting request that fits is prefilled before the next decode step), then
# docs/benchmarks.md's 8K table remeasured with the grouped one-token layout.
#
#     nohup bash lab/scripts/serving_capacity.sh > runs/serving-capacity.log 2>&1 &
set -u
KVB=${KVB:-.venv/bin/kvbudget}
source "$(dirname "$0")/step.sh"
step "8K needles: byte budget, prompts read at once" $KVB bench serve --model qwen2.5-coder-0.5b \
  --length 8192 --clients 9 --requests 9 --max-tokens 64 --ignore-eos --chunk-tokens 0 \
  --methods snapkv:memory=0.125 --out lab/results/serve-cpu-8k-bytes-at-once
step "bench 8K" env OMP_NUM_THREADS=2 $KVB bench --methods full,snapkv,ada-snapkv,lava --budgets 256 \
  --lengths 8192 --repeats 3 --new-tokens 64 --threads 2 --out lab/results/bench-cpu-8k
echo "=== $(date -u +%FT%TZ) done"
