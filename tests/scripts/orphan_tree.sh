#!/bin/sh
# Rank program for tests/test_orphan_reaper.py: a shell that never calls gc.init(), with a
# long `sleep` child; writes PIDDIR/shell<R>.pid and PIDDIR/sleep<R>.pid, then waits.
# Usage: orphan_tree.sh PIDDIR [--ignore-term | --exit-when FILE CODE]
#   --ignore-term         the shell and its sleep ignore SIGTERM (only SIGKILL stops them)
#   --exit-when FILE CODE once FILE exists, exit CODE and leave the sleep running
piddir="$1"
if [ "$2" = "--ignore-term" ]; then trap '' TERM; fi
sleep 1000 >/dev/null 2>&1 &
rank="${RANK:-$OMPI_COMM_WORLD_RANK}"  # gpucoll run and torchrun set RANK; mpirun does not
echo $! > "$piddir/sleep$rank.pid.tmp" && mv "$piddir/sleep$rank.pid.tmp" "$piddir/sleep$rank.pid"
echo $$ > "$piddir/shell$rank.pid.tmp" && mv "$piddir/shell$rank.pid.tmp" "$piddir/shell$rank.pid"
if [ "$2" = "--exit-when" ]; then
    while [ ! -e "$3" ]; do sleep 0.05; done
    exit "$4"
fi
wait
