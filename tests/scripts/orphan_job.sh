#!/bin/sh
# Rank program for tests/test_orphan_guard.py: a shell that runs the Python rank as its child
# (not exec: the shell stays its parent) with stderr appended to PIDDIR/rank<R>.err.
# Usage: orphan_job.sh PIDDIR [orphan_rank.py options]
piddir="$1"
echo $$ > "$piddir/shell$RANK.pid.tmp" && mv "$piddir/shell$RANK.pid.tmp" "$piddir/shell$RANK.pid"
"$ORPHAN_PYTHON" "$(dirname "$0")/orphan_rank.py" "$@" 2>>"$piddir/rank$RANK.err"
status=$?
exit $status
