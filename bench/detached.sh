#!/usr/bin/env bash
# A GPU run longer than one device call (10 minutes): started in its own process session, which the device machine
# lets outlive the call, then waited for by the next calls (each within 30 s of the last, or the machine goes back).
#   bash bench/detached.sh start NAME bench/seed_headline.py --gpus 4 ...   # returns at once
#   bash bench/detached.sh wait NAME 560                                     # up to 560 s; again in the next call
# The run goes through bench/run.sh with OUT=/tmp/detached/NAME/out; every wait prints its [bench] lines so far and
# copies what that folder holds (results are written after every step) into this call's $OUT, and says whether the
# run has ended ("[detached] NAME ended: exit status N") or is still going.
set -u
root=/tmp/detached
action=${1:?start or wait}
name=${2:?a name for the run}
dir=$root/$name
case $action in
start)
  shift 2
  [ -e "$dir" ] && { echo "[detached] $name exists already in $dir" >&2; exit 1; }
  mkdir -p "$dir/out"
  OUT=$dir/out setsid bash -c 'bash bench/run.sh "$@" >"$0/stdout" 2>&1; echo $? >"$0/status"' "$dir" "$@" \
    </dev/null >/dev/null 2>&1 &
  echo "[detached] $name started (pid $!): bench/run.sh $*"
  ;;
wait)
  limit=${3:?seconds to wait}
  [ -d "$dir" ] || { echo "[detached] no run named $name in $root" >&2; exit 1; }
  deadline=$((SECONDS + limit))
  while [ ! -e "$dir/status" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
  grep -a "^\[bench\]\|Error\|error:" "$dir/stdout" | tail -40
  out=${OUT:-/tmp/gpu-out}
  mkdir -p "$out"
  cp "$dir"/out/* "$out/" 2>/dev/null
  if [ -e "$dir/status" ]; then
    echo "[detached] $name ended: exit status $(cat "$dir/status")"
  else
    echo "[detached] $name still running after ${limit} s more: wait again in the next call"
  fi
  ;;
*)
  echo "usage: bash bench/detached.sh start NAME SCRIPT ARGS... | wait NAME SECONDS" >&2
  exit 2
  ;;
esac
