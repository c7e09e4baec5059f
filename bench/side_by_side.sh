#!/usr/bin/env bash
# Several GPU benchmarks at once, each on its own GPUs, their results brought back within the device's $OUT limits
# (at most 8 files): every job's JSON results and profile tables, and one jobs.log with each job's [bench] lines,
# errors and last lines.
#   bash bench/side_by_side.sh "0: bench/trainer_throughput.py --shape 4b" "1,2: VAR=x bench/weight_sync.py ..."
# A job is "GPUS: [VAR=VALUE ...] SCRIPT ARGS"; each runs through bench/run.sh with CUDA_VISIBLE_DEVICES=GPUS, for at
# most $SIDE_BY_SIDE_TIMEOUT seconds (default 580).
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
limit=${SIDE_BY_SIDE_TIMEOUT:-580}
dirs=()
for job in "$@"; do
  gpus=${job%%:*}
  read -r -a words <<<"${job#*:}"
  assigns=()
  while [[ ${words[0]} == *=* ]]; do assigns+=("${words[0]}"); words=("${words[@]:1}"); done
  dir=$(mktemp -d /tmp/side-by-side-XXXX)
  dirs+=("$dir")
  echo "$job" >"$dir/job"
  (timeout -k 10 "$limit" env CUDA_VISIBLE_DEVICES="$gpus" OUT="$dir" "${assigns[@]}" bash bench/run.sh "${words[@]}" \
    >"$dir/stdout" 2>&1; echo "[side-by-side] exit status $?" >>"$dir/stdout") &
done
wait
for dir in "${dirs[@]}"; do
  # the results this job wrote (bench/run.sh's own copy takes every new result, the other jobs' too)
  grep -ao -- '-> [^ ]*\.json$' "$dir/bench.log" 2>/dev/null | cut -c4- | sort -u | xargs -r -I{} cp {} "$out/"
  cp "$dir"/profile_*.txt "$out/" 2>/dev/null
  {
    echo "=== $(cat "$dir/job")"
    grep -a "^\[bench\]\|Error\|error:\|Traceback" "$dir/bench.log" 2>/dev/null | tail -60
    echo "--- last lines"
    tail -n 15 "$dir/stdout"
  } >>"$out/jobs.log"
done
