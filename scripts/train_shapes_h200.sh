#!/usr/bin/env bash
# Run ON THE DEVICE MACHINE (one H200), in the carried checkout, after `bash benchmarks/gpu_prepare.sh` here (carry
# [".whl", ".git_rev"]): trains h3-shapes with scripts/train_shapes.py in up to three configurations AT ONCE on the
# one GPU (the tiny model's steps are launch-bound, so the runs share the GPU's idle time; each run's seal records
# the steps it actually ran), one process each, the same seed and caps, differing only in `--partial-variants`:
#   $OUT/p<K>.tar  the sealed snapshot of `--partial-variants K`      $OUT/p<K>.log  its log
# Usage: bash scripts/train_shapes_h200.sh [K ...]   (default: 0 3 6)
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh || { echo "gpu_env.sh failed"; exit 99; }
out="${OUT:?OUT must name the folder whose files come back}"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
variants=("$@")
[[ ${#variants[@]} -gt 0 ]] || variants=(0 3 6)
pids=()
for k in "${variants[@]}"; do
    OMP_NUM_THREADS=4 python3 scripts/train_shapes.py --out "/tmp/run_p$k" --device cuda --workers 5 \
        --vae-steps 1550 --vae-seconds 60 --audio-steps 1300 --audio-batch 32 --audio-seconds 100 \
        --dit-steps 20000 --batch 256 --dit-seconds 300 --ref-steps 800 --ref-seconds 30 \
        --partial-variants "$k" > "$out/p$k.log" 2>&1 &
    pids+=($!)
done
failures=0
for i in "${!pids[@]}"; do
    k=${variants[$i]}
    if wait "${pids[$i]}"; then cp "/tmp/run_p$k/h3-shapes.tar" "$out/p$k.tar"; else failures=$((failures + 1)); fi
    tail -3 "$out/p$k.log"
done
exit "$failures"
