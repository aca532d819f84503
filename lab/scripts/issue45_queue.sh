#!/bin/bash
# The remaining runs of issues #45 and #48, one after the other, resumable.
#
#     nohup bash lab/scripts/issue45_queue.sh > runs/queue.log 2>&1 &
#
# Run from the repository root (or a snapshot worktree of it, so that edits to src/ do not reach a
# running job: PYTHONPATH=$PWD/src there). Every step skips the rows it already finished, so after a
# stop (a session's end, a fresh machine: the committed gzip parts are the state) the same command
# goes on where the rows end. A step that fails is logged and the queue goes on to the next.
# Progress: tr '\r' '\n' < runs/queue.log | grep -E "===|done in" | tail
set -u
PY=${PY:-.venv/bin/python}
KVB=${KVB:-.venv/bin/kvbudget}
RUN="$PY lab/scripts/leaderboard_run.py"
CORE=needle,niah_single_2,niah_multikey_1,niah_multikey_2,vt,lcc
P=lab/results/claims-baklava/profile.json

# FROM="kvpress screen's best" starts at the step of that name: the finished steps before it would
# each load the model and read their rows only to skip them (about 9 minutes in all).
FROM=${FROM:-}
run_source "$(dirname "$0")/step.sh"
step() {
  if [ -n "$FROM" ] && [ "$1" != "$FROM" ]; then
    echo "=== skipped (before FROM): $1"
    return 0
  fi
  FROM=
  run_step "$@"
}

ensure_kvzap() {  # before step $1, unless FROM names a later step: the steps from $1 on need them
  [ -n "$FROM" ] && [ "$FROM" != "$1" ] && return 0
  ls "${KVBUDGET_HOME:-$HOME/.cache/kvbudget}"/kvzap/*-mlp.safetensors >/dev/null 2>&1 ||
    run_step "kvzap surrogates" $KVB train kvzap --model qwen2.5-coder-0.5b
}

# 1. The verdict runs at the claims' own settings (docs/claims.md, runs 1-3a): question-aware,
#    r = 0.875, the core tasks, in one pass so that each sample is prefilled once.
step "verdicts: @lava, @asl, BaKlaVa tuned" $RUN lab/results/leaderboard --compression-ratios 0.875 \
  --tasks $CORE --methods "snapkv@lava,ada-snapkv@lava,pyramidkv@lava,ada-pyramidkv@lava,cake@lava,fastkv@asl,gemfilter@asl,baklava:profile=$P,squeezeattention:profile=$P"

# 2. kvpress's best question-agnostic presses at the other ratios: Expected Attention (its best at
#    r = 0.5) at each, KeyDiff (its second) at 0.25 only. Cut: KeyDiff at 0.875 and 0.75, where
#    kvbudget's keydiff (the same kept positions, oracle test) scores half of Expected Attention.
step "kvpress agnostic, other ratios" $RUN lab/results/leaderboard-agnostic --agnostic \
  --compression-ratios 0.875,0.75,0.25 --tasks $CORE --peer-presses expected_attention
step "kvpress keydiff agnostic 0.25" $RUN lab/results/leaderboard-agnostic --agnostic \
  --compression-ratios 0.25 --tasks $CORE --peer-presses keydiff

# 3. kvpress's ChunkKV question-agnostic (question-aware after step 4: the issue's priorities put the
#    question-agnostic track at every ratio first).
step "kvpress chunkkv agnostic 0.5" $RUN lab/results/leaderboard-agnostic --agnostic \
  --compression-ratios 0.5 --tasks $CORE --peer-presses chunkkv

# 3a. The screen's best kvpress presses, question-agnostic r = 0.5: before step 4's surrogate
#     training, which they do not need (a fresh machine reaches kvpress's rows 15-24 min sooner).
step "kvpress screen's best" $RUN lab/results/leaderboard-agnostic --agnostic --compression-ratios 0.5 \
  --tasks $CORE --peer-presses cur,non_causal_attn,adakv_compactor,compactor

# 3b. kvpress's best presses at r = 0.5 question-agnostic (AdaKV-Compactor 84.6, Compactor 82.9,
#     CUR 78.7 over the core tasks, all above its Expected Attention's 77.4) at the other ratios, in
#     that order, and kvbudget's counterpart of AdaKV-Compactor (compactor with AdaKV's head split)
#     at r = 0.5 for the same-method pair. Cut for compute: NonCausalAttn (69.7, below Expected
#     Attention at r = 0.5) at the other ratios.
step "kvpress adakv_compactor agnostic, other ratios" $RUN lab/results/leaderboard-agnostic --agnostic \
  --compression-ratios 0.875,0.75,0.25 --tasks $CORE --peer-presses adakv_compactor
step "compactor ada agnostic 0.5" $RUN lab/results/leaderboard-agnostic --agnostic --compression-ratios 0.5 \
  --tasks $CORE --methods "compactor:head_alloc=ada"
# kvbudget's compactor with two more seeds of its random sketches (kvpress's press draws its own from
# torch's global generator, in bf16): how much of compactor's gap to kvpress's Compactor at
# r = 0.5 (82.9 against 79.4, +3.5 [+0.0, +7.6]) the draw alone moves (about 15 min).
step "compactor other draws 0.5" $RUN lab/results/leaderboard-agnostic --agnostic --compression-ratios 0.5 \
  --tasks $CORE --methods "compactor:seed=1,compactor:seed=2"
step "kvpress compactor, cur agnostic, other ratios" $RUN lab/results/leaderboard-agnostic --agnostic \
  --compression-ratios 0.875,0.75,0.25 --tasks $CORE --peer-presses compactor,cur

# 3b. The 1.5B check (docs/claims.md, run 5; about 1.3 h on an AMX machine, 3 h on the pilot's):
#     a #45 must-show, so it runs before the steps below that are done (4, 4a: they skip) or are
#     diagnostics and extras.
step "fetch the 1.5B" $KVB fetch model qwen2.5-coder-1.5b
step "1.5B check" $KVB eval --model qwen2.5-coder-1.5b --dtype bfloat16 --tasks $CORE \
  --lengths 4096 --seed 0 --limit 10 --compression-ratios 0.875 --out lab/results/check-1.5b \
  --methods full,snapkv,lava,snapkv@lava,ada-snapkv@lava,pyramidkv@lava,ada-pyramidkv@lava,cake@lava,asl,fastkv@asl,gemfilter@asl,baklava,streamingllm,squeezeattention,laq,laq++

# The must-shows that need no KVzap surrogate run before the steps that train it (6–14 min here).
# 4b. kvpress's ChunkKV question-aware.
step "kvpress chunkkv aware 0.875, 0.5" $RUN lab/results/leaderboard \
  --compression-ratios 0.875,0.5 --tasks $CORE --peer-presses chunkkv

# 6. D2O's throughput at the paper's setting (budget = the prompt's length; docs/claims.md, run 4).
if [ ! -f lab/results/claims-d2o-throughput/budget-equals-prompt/throughput.json ]; then
  step "D2O throughput, budget = prompt" $KVB bench throughput --model qwen2.5-coder-0.5b --dtype bfloat16 \
    --methods full,d2o,h2o,d2o-nomerge --budgets 300 --lengths 256 --new-tokens 1024 --memory-cap 40MiB \
    --out lab/results/claims-d2o-throughput/budget-equals-prompt
fi

ensure_kvzap "agnostic, every ratio: top and 2026 methods"
# 4. Question-agnostic, every ratio: kvbudget's top methods and the 2026 query-agnostic family (#48).
#    The steps that use KVzap train its surrogates for the 0.5B first (ensure_kvzap above) unless
#    this machine has them.
step "agnostic, every ratio: top and 2026 methods" $RUN lab/results/leaderboard-agnostic --agnostic \
  --compression-ratios 0.25,0.5,0.75,0.875 --tasks $CORE \
  --methods "kvzip,expected-attention,random,kvzip+,kvzap,kvzap:kind=linear,leverage,compactor"

# 4a. KVzap by threshold (adaptive), question-agnostic r = 0.5 (the question-agnostic track before
#     the question-aware one, as the issue's priorities put it).
step "kvzap threshold" $RUN lab/results/leaderboard-agnostic --agnostic --compression-ratios 0.5 \
  --tasks $CORE --methods "kvzap:threshold=-6"
# KVzap at r = 0.5 with the threshold variant's 128-entry window: separates the window from the
# adaptive per-head budgets in the threshold variant's lead over the fixed ratio (about 45 min).
step "kvzap window 128" $RUN lab/results/leaderboard-agnostic --agnostic --compression-ratios 0.5 \
  --tasks $CORE --methods "kvzap:window=128"

# 7. KVgrad question-agnostic at every ratio (the question-agnostic track first; it needs no
#    surrogate), then the 2026 family question-aware.
step "kvgrad agnostic" $RUN lab/results/leaderboard-agnostic --agnostic \
  --compression-ratios 0.25,0.5,0.75,0.875 --tasks $CORE --methods kvgrad
ensure_kvzap "2026 family aware"
step "2026 family aware" $RUN lab/results/leaderboard --compression-ratios 0.875,0.5 --tasks $CORE \
  --methods "kvzip+,kvzap,kvzap:kind=linear,leverage,compactor,kvgrad"
# 8. kvpress's KVgrad question-agnostic at r = 0.875: kvbudget's best there is its `kvgrad`, so the
#    summary's line compares against another press until kvpress's own KVgrad has the same samples
#    (about a minute a row, two hours).
step "kvpress kvgrad agnostic 0.875" $RUN lab/results/leaderboard-agnostic --agnostic \
  --compression-ratios 0.875 --tasks $CORE --peer-presses kvgrad
# 9. kvpress's LeverageScore question-agnostic on every sample (#48 names it among the presses to
#    beat; its random sketches come from torch's global generator, so its kept positions need not be
#    kvbudget's `leverage`'s). The ratios where kvbudget's `leverage` is within a few points of
#    kvpress's best press first; one step per ratio, so a stop leaves whole ratios behind it.
for ratio in 0.875 0.75 0.25 0.5; do
  step "kvpress leverage agnostic $ratio" $RUN lab/results/leaderboard-agnostic --agnostic \
    --compression-ratios $ratio --tasks $CORE --peer-presses leverage
done
echo "=== $(date -u +%FT%TZ) queue finished"
