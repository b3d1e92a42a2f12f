#!/bin/sh
# The program strata_launch_test runs under strata-launch. $1 picks the behaviour; files
# it leaves go to $2 (a directory the test reads).
#   env DIR            print the launch variables (stdout) and a line on stderr
#   fail DIR R CODE    rank R exits CODE once every rank is up; the others wait, and note
#                      SIGTERM in DIR/stopped-RANK before exiting 143
#   kill DIR R SIG     as fail, but rank R kills itself with SIG
#   wait DIR           note DIR/ready-RANK, then wait; a SIGINT/SIGTERM/SIGHUP is noted in
#                      DIR/got-NAME-RANK and ends the rank with 0
#   split DIR          note DIR/ready-RANK; on SIGINT rank 0 exits 5, the others ignore it and
#                      note SIGTERM in DIR/stopped-RANK before exiting 143
#   stubborn DIR       note DIR/ready-RANK and ignore SIGTERM (the launcher must SIGKILL it)
#   lines DIR N        print N long lines of the rank's digit, unflushed pieces in between
set -u
mode=$1
dir=$2

ready_and_wait_for_all() {
  : >"$dir/ready-$RANK"
  while [ "$(ls "$dir" | grep -c '^ready-')" -lt "$LOCAL_WORLD_SIZE" ]; do sleep 0.05; done
}

case "$mode" in
  env)
    echo "RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE GROUP_RANK=$GROUP_RANK MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"
    echo "on stderr from $RANK" >&2
    ;;
  fail | kill)
    trap ': >"$dir/stopped-$RANK"; exit 143' TERM
    ready_and_wait_for_all
    if [ "$RANK" = "$3" ]; then
      if [ "$mode" = fail ]; then exit "$4"; fi
      kill -s "$4" $$
    fi
    sleep 60 &
    wait $!
    exit 0
    ;;
  wait)
    for name in INT TERM HUP; do trap ": >\"$dir/got-$name-$RANK\"; exit 0" $name; done
    : >"$dir/ready-$RANK"
    sleep 60 &
    wait $!
    ;;
  split)
    if [ "$RANK" = 0 ]; then trap 'exit 5' INT; else trap '' INT; fi
    trap ': >"$dir/stopped-$RANK"; exit 143' TERM
    : >"$dir/ready-$RANK"
    sleep 60 &
    wait $!
    ;;
  stubborn)
    trap '' TERM
    : >"$dir/ready-$RANK"
    # A loop of short sleeps: the SIGTERM to the group ends a sleep, not the loop.
    i=0
    while [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
    ;;
  lines)
    line=$(printf "%06000d" 0 | tr 0 "$RANK")
    i=0
    while [ $i -lt "$3" ]; do
      printf '%s' "$line"
      printf '%s\n' "$line"
      i=$((i + 1))
    done
    ;;
esac
