#!/bin/bash
# kvpress's own KVgrad, KVzip+ and KVzip where kvbudget's question-agnostic best is that method and the
# summary's same-method line says "not run" (docs/leaderboard.md, Summary): KVgrad at r = 0.75, KVzip+
# at 0.5, KVzip at 0.25. The whole grid does not fit (KVgradPress took 1.3–3.8 min a prompt here, answers included: the `done in` lines), so
# the same subsample at every ratio: the first 3 samples of the five core tasks that take --limit
# (needle's depths spread over its samples, so it has none). Resumable; the lock is held per task.
#
#     KVBUDGET_LOCK=/tmp/kvb-torch.lock nohup bash lab/scripts/kvpress_same_method.sh >> runs/kvpress-same.log 2>&1 &
set -u
PY=${PY:-.venv/bin/python}
RUN="$PY lab/scripts/leaderboard_run.py lab/results/leaderboard-agnostic --agnostic --limit 3"
TASKS=niah_single_2,niah_multikey_1,niah_multikey_2,vt,lcc
source "$(dirname "$0")/step.sh"
step "kvgrad 0.75" $RUN --tasks $TASKS --compression-ratios 0.75 --peer-presses kvgrad
step "kvzip+ 0.5" $RUN --tasks $TASKS --compression-ratios 0.5 --peer-presses kvzip+
step "kvzip 0.25" $RUN --tasks $TASKS --compression-ratios 0.25 --peer-presses kvzip
echo "=== $(date -u +%FT%TZ) done"
