#!/bin/bash
# The shared-context grid (issue: compress a document once, answer many), one step after the other,
# resumable: each step skips the rows it already has, so after a stop the same command goes on.
#
#     nohup bash lab/scripts/shared_context_queue.sh > runs/sc-queue.log 2>&1 &
#
# Question-agnostic track first (kvpress's protocol), five samples a task before twenty so that a
# first table exists early; qwen2.5-coder-0.5b (4-bit GGUF dequantized to bf16) at 2K tokens.
# Progress: tr '\r' '\n' < runs/sc-queue.log | grep -E "===|done in" | tail
set -u
PY=${PY:-.venv/bin/python}
KVB=${KVB:-.venv/bin/kvbudget}
RUN="$PY lab/scripts/leaderboard_run.py"
TASKS=sc_keys,sc_code,sc_vt,sc_aggregate  # kvzap's step
RATIOS=0.875,0.75,0.5
AGNOSTIC=full,snapkv,chunkkv,expected-attention,kvzip,kvzip+,kvgrad
AWARE=full,snapkv,chunkkv,laq
# kvpress's best question-agnostic presses on the leaderboard's core tasks (docs/leaderboard.md);
# its pipeline answers several questions about one context as separate requests only
PRESSES=expected_attention,chunkkv
source "$(dirname "$0")/step.sh"
need_model qwen2.5-coder-0.5b
# sc_aggregate after both rounds of the other three: its 64-token answers, which compressed caches often
# run to the cap, make a run about 40 s (the other tasks: 5-11 s), about an hour a track at 5 samples
for tasks in sc_keys,sc_code,sc_vt sc_aggregate; do
  for limit in 5 20; do
    step "agnostic, $tasks, $limit a task" $RUN lab/results/shared-context-agnostic --agnostic \
      --compression-ratios $RATIOS --tasks $tasks --methods $AGNOSTIC --limit $limit
    step "aware, $tasks, $limit a task" $RUN lab/results/shared-context \
      --compression-ratios $RATIOS --tasks $tasks --methods $AWARE --limit $limit
    step "kvpress agnostic (multi-request), $tasks, $limit a task" $RUN lab/results/shared-context-agnostic \
      --agnostic --compression-ratios $RATIOS --tasks $tasks --methods full --peer-presses $PRESSES --limit $limit
  done
done
ls "${KVBUDGET_HOME:-$HOME/.cache/kvbudget}"/kvzap/*-mlp.safetensors >/dev/null 2>&1 ||
  step "kvzap surrogates" $KVB train kvzap --model qwen2.5-coder-0.5b
step "kvzap agnostic" $RUN lab/results/shared-context-agnostic --agnostic \
  --compression-ratios $RATIOS --tasks $TASKS --methods kvzap
echo "=== $(date -u +%FT%TZ) queue done"
