#!/usr/bin/env bash
# Run ON THE DEVICE MACHINE (one H200), in the carried checkout, after `bash benchmarks/gpu_prepare.sh` here (carry
# [".whl", ".git_rev"]): trains h3-shapes with scripts/train_shapes.py in up to three configurations AT ONCE on the
# one GPU (the tiny model's steps are launch-bound, so the runs share the GPU's idle time; each run's seal records
# the steps it actually ran), one process each, the same seed and caps, differing only in their own flags:
#   $OUT/<name>.tar  the sealed snapshot      $OUT/<name>.log  its log
#   $OUT/<name>_eval.json  with EVAL=1: scripts/eval_shapes.py on the device's CPU (held-out 12 x seeds 42 43,
#                          12 training triples, 4 FL2VA anchors), the runs' evals side by side
# Usage: bash scripts/train_shapes_h200.sh [CONFIG ...]   CONFIG = NAME=FLAGS (FLAGS space-separated, passed to
#   train_shapes.py after the common caps) or an integer K (= pK=--partial-variants K). Default: 0 3 6.
#   DIT_SECONDS (default 300) caps the transformer phase.
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh || { echo "gpu_env.sh failed"; exit 99; }
out="${OUT:?OUT must name the folder whose files come back}"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
configs=("$@")
[[ ${#configs[@]} -gt 0 ]] || configs=(0 3 6)
names=()
pids=()
for spec in "${configs[@]}"; do
    if [[ "$spec" =~ ^[0-9]+$ ]]; then name="p$spec"; flags="--partial-variants $spec"
    else name="${spec%%=*}"; flags="${spec#*=}"; fi
    [[ "$name" =~ ^[A-Za-z0-9_-]+$ ]] || { echo "config name $name: letters, digits, - and _ only"; exit 98; }
    # shellcheck disable=SC2086  # FLAGS are split into words on purpose
    OMP_NUM_THREADS=4 python3 scripts/train_shapes.py --out "/tmp/run_$name" --device cuda --workers 5 \
        --vae-steps 1550 --vae-seconds 60 --audio-steps 1300 --audio-batch 32 --audio-seconds 100 \
        --dit-steps 20000 --batch 256 --dit-seconds "${DIT_SECONDS:-300}" --ref-steps 800 --ref-seconds 30 \
        $flags > "$out/$name.log" 2>&1 &
    names+=("$name")
    pids+=($!)
done
failures=0
trained=()
for i in "${!pids[@]}"; do
    name=${names[$i]}
    if wait "${pids[$i]}"; then cp "/tmp/run_$name/h3-shapes.tar" "$out/$name.tar"; trained+=("$name")
    else failures=$((failures + 1)); fi
    tail -3 "$out/$name.log"
done
if [[ "${EVAL:-0}" == 1 ]]; then
    epids=()
    for name in "${trained[@]}"; do
        OMP_NUM_THREADS=4 python3 scripts/eval_shapes.py --snapshot "/tmp/run_$name/h3-shapes" --seeds 42 43 \
            --training 12 --fl2va 4 --device cpu --strip "" --out "$out/${name}_eval.json" > "$out/${name}_eval.log" 2>&1 &
        epids+=($!)
    done
    for i in "${!epids[@]}"; do
        wait "${epids[$i]}" || failures=$((failures + 1))
        tail -4 "$out/${trained[$i]}_eval.log"
    done
fi
exit "$failures"
