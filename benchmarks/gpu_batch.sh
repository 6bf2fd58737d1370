#!/usr/bin/env bash
# Run ON THE DEVICE MACHINE, in the carried checkout (after `bash benchmarks/gpu_prepare.sh` here, carry
# [".whl", ".git_rev"]): installs the wheels, then runs each named benchmark in turn with --out $OUT/<name>.json,
# one log per run under $OUT/log.txt. A failing benchmark is reported and the batch goes on; the exit status is the
# number of failures. Each argument is NAME[:extra args], e.g.
#   bash benchmarks/gpu_batch.sh forward "block" "trajectory:--passes 10" session
# runs benchmarks/benchmark_forward.py --out $OUT/forward.json, and so on.
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh || { echo "gpu_env.sh failed"; exit 99; }
out="${OUT:?OUT must name the folder whose files come back}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader | tee -a "$out/log.txt"
failures=0
for spec in "$@"; do
    name="${spec%%:*}"
    extra=""
    [[ "$spec" == *:* ]] && extra="${spec#*:}"
    echo "=== $name $extra ($(date -u +%H:%M:%S))" | tee -a "$out/log.txt"
    start=$(date +%s)
    # shellcheck disable=SC2086  # extra args are split on purpose
    python3 "benchmarks/benchmark_${name}.py" $extra --out "$out/${name}.json" 2>&1 | tee -a "$out/log.txt"
    rc=${PIPESTATUS[0]}
    echo "=== $name rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$out/log.txt"
    [[ $rc -eq 0 ]] || failures=$((failures + 1))
done
exit "$failures"
