#!/bin/bash
# The serving figures of session 25 (issues: one byte budget; compress a document once), one after the
# other on a quiet machine; each step writes its own folder (see docs/serving.md for the tables).
#
#     nohup bash lab/scripts/serving_figures.sh > runs/serving-figures.log 2>&1 &
set -u
KVB=${KVB:-.venv/bin/kvbudget}
PY=${PY:-.venv/bin/python}
step() {
  echo "=== $(date -u +%FT%TZ) $1"
  shift
  "$@" || echo "=== step failed (exit $?): $*"
}
# TPOT of 4-bit against bf16 storage at 8K and 32K tokens (a synthetic cache: no prefill)
step "tpot synthetic" $PY lab/scripts/tpot_synthetic.py --lengths 8192,32768 --bits 16,4 --steps 24 --repeats 3
# one document, eight clients, four questions each: the shared documents at 8K
step "shared 8K, documents" $KVB bench serve --workload shared --model qwen2.5-coder-0.5b --length 8192 \
  --clients 8 --modes document,document:reload,document:full --out lab/results/serve-shared-8k
# chunked prefill: SnapKV's decoding while the others' 8K prompts are read a layer at a time
step "snapkv, chunked prefill" $KVB bench serve --model qwen2.5-coder-0.5b --length 8192 --clients 9 \
  --requests 9 --max-tokens 64 --ignore-eos --methods snapkv --chunk-tokens 1024 \
  --out lab/results/serve-cpu-8k-chunked
echo "=== $(date -u +%FT%TZ) done"
