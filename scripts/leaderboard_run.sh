#!/bin/sh
# The leaderboard grid (src/kvbudget/eval/suites.py, LEADERBOARD), one task at a time, so that a
# long run can stop between tasks and resume (the runner skips finished rows). Usage:
#   scripts/leaderboard_run.sh OUT [BUDGET OPTIONS]
# Without budget options it runs the suite's budgets and ratios; with them (e.g.
# `--compression-ratios 0.875`) only those. KVBUDGET_LOCK, if set, names a file that serialises
# torch jobs (flock) with other work on the machine.
set -e
OUT=${1:-results/leaderboard}
[ $# -gt 0 ] && shift
eval "$(.venv/bin/python - <<'PY'
from kvbudget.eval.suites import suite
c = suite("leaderboard")
print(f"MODEL={c.model} DTYPE={c.dtype} LIMIT={c.limit}")
print("LENGTHS=" + ",".join(map(str, c.lengths)) + " METHODS=" + ",".join(c.methods))
print("TASKS='" + " ".join(c.tasks) + "'")
print("BUDGETS=" + ",".join(map(str, c.budgets)) + " RATIOS=" + ",".join(map(str, c.compression_ratios)))
PY
)"
[ $# -gt 0 ] || set -- --budgets "$BUDGETS" --compression-ratios "$RATIOS"
for task in $TASKS; do
  ${KVBUDGET_LOCK:+flock "$KVBUDGET_LOCK"} .venv/bin/kvbudget eval --model "$MODEL" --dtype "$DTYPE" \
    --lengths "$LENGTHS" --methods "$METHODS" --limit "$LIMIT" --tasks "$task" --out "$OUT" --no-report "$@"
done
.venv/bin/kvbudget report "$OUT"
