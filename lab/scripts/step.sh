# step NAME COMMAND...: the lab queues' step, sourced by them: a timestamped header, then the command; a
# failing step is logged and the queue goes on (each step resumes from its rows when run again).
step() {
  echo "=== $(date -u +%FT%TZ) $1"
  shift
  "$@" || echo "=== step failed (exit $?): $*"
}
