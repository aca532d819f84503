#!/bin/bash
# Byte budget pilot (issue: quantized KV with eviction), resumable: eviction alone, quantization alone,
# the two together at one precision, and byte budgets (memory=: two precisions chosen per head) on the
# shared-context tasks, question-agnostic, five samples a task, written beside the eviction-only rows
# already in lab/results/shared-context-agnostic (the same samples, so the rows pair).
# qwen2.5-coder-0.5b (4-bit GGUF dequantized to bf16) at 2K tokens.
#
#     KVBUDGET_LOCK=/tmp/kvb-torch.lock nohup bash lab/scripts/byte_budget_pilot.sh >> runs/bytes-pilot.log 2>&1 &
#     .venv/bin/python lab/scripts/equal_bytes_plot.py lab/results/shared-context-agnostic
#
# Bytes of the full bf16 cache (an entry: 2 x 64 channels x 2 bytes = 256 B): bf16 at ratio r keeps
# 1 - r of them; at 4 bits an entry takes about 82 B (codes 64, scales and minima 16, key group 2),
# 32%; at 2 bits about 50 B, 20% (plus a full-precision tail under 32 tokens a head).
set -u
PY=${PY:-.venv/bin/python}
RUN="$PY lab/scripts/leaderboard_run.py"
OUT=lab/results/shared-context-agnostic
TASKS=sc_keys,sc_code,sc_vt
source "$(dirname "$0")/step.sh"
# quantization alone: the full cache at 8, 4 and 2 bits (a ratio only picks the runner's part of the
# plan: the full cache runs once whatever it is)
step "quantization alone" $RUN $OUT --agnostic --tasks $TASKS --limit 5 --compression-ratios 0.5 \
  --methods full:kv_bits=8,full:kv_bits=4,full:kv_bits=2
# the mixes at one precision: the question-agnostic methods' kept entries at 4 and 2 bits
step "eviction + 4 bits" $RUN $OUT --agnostic --tasks $TASKS --limit 5 \
  --compression-ratios 0.875,0.75,0.5 --methods snapkv:kv_bits=4,kvzip:kv_bits=4,expected-attention:kv_bits=4
step "eviction + 2 bits" $RUN $OUT --agnostic --tasks $TASKS --limit 5 \
  --compression-ratios 0.75,0.5 --methods snapkv:kv_bits=2,kvzip:kv_bits=2
# byte budgets: 12.5% and 6.25% of the full cache's bytes, each head's best entries at 8 bits, the rest at 4
step "byte budgets" $RUN $OUT --agnostic --tasks $TASKS --limit 5 --compression-ratios 0.5 \
  --methods kvzip:memory=0.125,expected-attention:memory=0.125,snapkv:memory=0.125,kvzip:memory=0.0625,expected-attention:memory=0.0625
echo "=== $(date -u +%FT%TZ) pilot done"
