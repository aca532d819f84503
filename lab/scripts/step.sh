# step NAME COMMAND...: the lab queues' step, sourced by them: a timestamped header, then the command; a
# failing step is logged and the queue goes on (each step resumes from its rows when run again).
step() {
  echo "=== $(date -u +%FT%TZ) $1"
  shift
  "$@" || echo "=== step failed (exit $?): $*"
}

# need_model NAME: fetch the registry model a queue's results folders name (a fresh machine's `make
# fetch` fetches only the default one); nothing to do, in under a second, when it is there.
need_model() {
  "${KVB:-.venv/bin/kvbudget}" fetch model "$1" || echo "=== could not fetch $1: every step will fail"
}
