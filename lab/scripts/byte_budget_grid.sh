#!/bin/bash
# The equal-bytes grid (issue: one byte budget), resumable: byte budgets (memory=, two precisions chosen
# per head) against eviction alone at the same bytes, the rule in docs/leaderboard.md ("Equal bytes")
# written before these rows. qwen2.5-coder-0.5b (4-bit GGUF dequantized to bf16) at 2K tokens.
#
#     KVBUDGET_LOCK=/tmp/kvb-torch.lock nohup bash lab/scripts/byte_budget_grid.sh >> runs/bytes-grid.log 2>&1 &
#     .venv/bin/python lab/scripts/equal_bytes_plot.py ...   (the table and plot: docs/leaderboard.md)
#
# Headline rows first (the three families), then the server default's candidates, then the
# exploratory points of the plot.
set -u
PY=${PY:-.venv/bin/python}
RUN="$PY lab/scripts/leaderboard_run.py"
SC=lab/results/shared-context-agnostic
AWARE=lab/results/equal-bytes
AGNOSTIC=lab/results/equal-bytes-agnostic
SC_TASKS=sc_keys,sc_code,sc_vt
CORE=needle,niah_single_2,niah_multikey_1,niah_multikey_2,vt,lcc
source "$(dirname "$0")/step.sh"
need_model qwen2.5-coder-0.5b
# the leaderboard's rows of the same samples (same keys): nothing measured twice
step "seed aware" $PY lab/scripts/seed_rows.py lab/results/leaderboard $AWARE --labels full,snapkv \
  --ratios 0.875 --tasks $CORE
step "seed agnostic" $PY lab/scripts/seed_rows.py lab/results/leaderboard-agnostic $AGNOSTIC \
  --labels full,snapkv,kvzip,expected-attention --ratios 0.875 --tasks $CORE
# 1. the shared-context family: M:memory=0.125 against M at r = 0.875, later turns, 20 samples a task
step "sc headline" $RUN $SC --agnostic --tasks $SC_TASKS --limit 20 --compression-ratios 0.875 \
  --methods full,snapkv,expected-attention,kvzip,snapkv:memory=0.125,expected-attention:memory=0.125,kvzip:memory=0.125
# 2. the leaderboard's core tasks, one question: question-aware SnapKV, question-agnostic KVzip and
# Expected Attention
step "core aware" $RUN $AWARE --tasks $CORE --compression-ratios 0.875 --methods full,snapkv,snapkv:memory=0.125
step "core agnostic" $RUN $AGNOSTIC --agnostic --tasks $CORE --compression-ratios 0.875 \
  --methods full,expected-attention,kvzip,expected-attention:memory=0.125,kvzip:memory=0.125
# 2b. the server default's cheap candidates (docs/leaderboard.md, "The server's default"), 20 samples a
# task: Expected Attention at r = 0.75 / 0.5, also stored at 4 bits, and under a smaller byte budget;
# quantization alone
step "sc cheap points" $RUN $SC --agnostic --tasks $SC_TASKS --limit 20 --compression-ratios 0.75,0.5 \
  --methods expected-attention,expected-attention:kv_bits=4,expected-attention:memory=0.0625,full:kv_bits=4,full:kv_bits=2
# 3. exploratory points: KVzip stored at 4 bits and under a smaller byte budget
step "sc points" $RUN $SC --agnostic --tasks $SC_TASKS --limit 20 --compression-ratios 0.75,0.5 \
  --methods kvzip:kv_bits=4,kvzip:memory=0.0625
# 3b. the plot's other byte shares (the issue: 25%, 12.5% and 6.25%): eviction at r = 0.9375 beside
# memory=0.0625, memory=0.25 beside r = 0.75, and quantization alone at 8 bits
step "sc bytes, cheap" $RUN $SC --agnostic --tasks $SC_TASKS --limit 20 --compression-ratios 0.9375 \
  --methods expected-attention,expected-attention:memory=0.25,full:kv_bits=8
step "sc bytes, kvzip" $RUN $SC --agnostic --tasks $SC_TASKS --limit 20 --compression-ratios 0.9375 \
  --methods kvzip,kvzip:memory=0.25
# 4. the anchors, in kvpress's environment: transformers' QuantizedCache (quanto, residual 128) alone at 4
# and 2 bits, and under kvpress's Expected Attention (its best question-agnostic press that runs here)
ANCHORS=no_press+quanto4,no_press+quanto2,expected_attention+quanto4
step "sc anchors" $RUN $SC --agnostic --tasks $SC_TASKS --limit 20 --compression-ratios 0.5,0.75 \
  --peer-presses $ANCHORS
step "core anchors" $RUN $AGNOSTIC --agnostic --tasks $CORE --compression-ratios 0.5,0.75 --peer-presses $ANCHORS
# 5. the core tasks' other byte shares (25%, 6.25%), both tracks, last: eviction at r = 0.75 from the
# leaderboard's rows, at r = 0.9375 here; the byte budgets beside them; quantization alone
step "seed aware 0.75" $PY lab/scripts/seed_rows.py lab/results/leaderboard $AWARE --labels snapkv \
  --ratios 0.75 --tasks $CORE
step "seed agnostic 0.75" $PY lab/scripts/seed_rows.py lab/results/leaderboard-agnostic $AGNOSTIC \
  --labels expected-attention,kvzip --ratios 0.75 --tasks $CORE
step "core aware bytes" $RUN $AWARE --tasks $CORE --compression-ratios 0.9375 \
  --methods snapkv,snapkv:memory=0.25,snapkv:memory=0.0625,full:kv_bits=8,full:kv_bits=4,full:kv_bits=2
step "core agnostic bytes, cheap" $RUN $AGNOSTIC --agnostic --tasks $CORE --compression-ratios 0.9375 \
  --methods expected-attention,expected-attention:memory=0.25,expected-attention:memory=0.0625,full:kv_bits=8,full:kv_bits=4,full:kv_bits=2
step "core agnostic bytes, kvzip" $RUN $AGNOSTIC --agnostic --tasks $CORE --compression-ratios 0.9375 \
  --methods kvzip,kvzip:memory=0.25,kvzip:memory=0.0625
# 6. the issue's best question-agnostic scorer, KVgrad (the core tasks' best evicting alone at r = 0.875 and
# 0.75): its byte budgets at 25%, 12.5% and 6.25% beside its eviction at the same shares (exploratory:
# the rules above were written for KVzip, Expected Attention and SnapKV); one gradient pass a sample,
# shared by the four runs
step "seed agnostic kvgrad" $PY lab/scripts/seed_rows.py lab/results/leaderboard-agnostic $AGNOSTIC \
  --labels kvgrad --ratios 0.875,0.75 --tasks $CORE
step "core agnostic bytes, kvgrad" $RUN $AGNOSTIC --agnostic --tasks $CORE --compression-ratios 0.9375 \
  --methods kvgrad,kvgrad:memory=0.25,kvgrad:memory=0.125,kvgrad:memory=0.0625
echo "=== $(date -u +%FT%TZ) grid done"
