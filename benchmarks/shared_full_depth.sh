#!/usr/bin/env bash
# The full-depth shared-device proof, one device call: the 50-block H3Config.full() model at
# TP2/TP4/TP8/CP2/CP4/TP2xCP2+SP/TP4xCP2(+SP), every rank on the one GPU (benchmark_distributed.py --share-device:
# counter-random weights, one copy per CP group, collectives through CUDA IPC slots), against rank 0's one-process
# reference at 512x512x22f and 864x480x56f, and a 20-pass TP4xCP2 (and +SP) trajectory digest at 512x512x22f.
# One torchrun launch per world size (2, 4, 8) and shape (every topology at 512x512x22f first, then 864x480x56f),
# each cut at what is left of DEADLINE_S seconds (a cut launch keeps the topologies it finished: the script
# rewrites its JSON after each), then the launches merged into
# $OUT/distributed_shared_device_full_depth.json. Run ON THE DEVICE MACHINE after `. benchmarks/gpu_env.sh`;
# ONLY="shared4 shared2_large" runs just the named launches (a second call for what a first one left).
# On CPU, `LAYERS=1 TINY=--tiny SMALL=tiny-64x64x22f LARGE=tiny-64x64x22f bash benchmarks/shared_full_depth.sh` is
# the dry run (tiny config, interpreter; hours on a small host).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:?OUT must name the folder whose files come back}"
deadline=$(( $(date +%s) + ${DEADLINE_S:-450} ))
common=(--share-device --runs 1 ${TINY:-} ${LAYERS:+--layers "$LAYERS"})
files=()
launch() {  # launch NAME RANKS ARGS...
    local name=$1 n=$2 left
    shift 2
    if [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]]; then return; fi  # ONLY="a b": just these launches
    left=$(( deadline - $(date +%s) ))
    if (( left < 20 )); then echo "=== $name skipped: deadline" | tee -a "$out/log.txt"; return; fi
    echo "=== $name: $n ranks, $left s left ($(date -u +%H:%M:%S))" | tee -a "$out/log.txt"
    timeout -k 15 "$left" python3 -m torch.distributed.run --standalone --nproc-per-node "$n" \
        benchmarks/benchmark_distributed.py "${common[@]}" --out "$out/$name.json" "$@" 2>&1 | grep -v "^W1" \
        | tee -a "$out/log.txt"
    echo "=== $name rc=${PIPESTATUS[0]} ($(date -u +%H:%M:%S))" | tee -a "$out/log.txt"
    [[ -f "$out/$name.json" ]] && files+=("$out/$name.json")
}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader 2>/dev/null | tee -a "$out/log.txt"
# first every topology at the first shape (and the trajectories), then what time leaves at the second
small=${SMALL:-512x512x22f} large=${LARGE:-864x480x56f}
# CP4 (one rank owning the whole 62 GiB model, mapped by three) has a launch of its own: in a launch with tp2xcp2+sp
# after it, the H200 ran out of memory building tp2xcp2+sp while the CP4 owner's weights were still held (one CUDA
# IPC handle opened by three ranks; fixed in mailbox.export, one handle per rank -- not yet re-run on the GPU).
launch shared2 2 --topologies tp2,cp2 --shapes "$small"
launch shared4 4 --topologies tp4,tp2xcp2+sp --shapes "$small"
launch shared4cp 4 --topologies cp4 --shapes "$small"
launch shared8 8 --topologies tp4xcp2,tp8,tp4xcp2+sp --shapes "$small" --trajectory-passes "${PASSES:-20}" \
    --trajectory-topologies tp4xcp2,tp4xcp2+sp
launch shared8_large 8 --topologies tp4xcp2,tp8,tp4xcp2+sp --shapes "$large"
launch shared4_large 4 --topologies tp4,tp2xcp2+sp --shapes "$large"
launch shared4cp_large 4 --topologies cp4 --shapes "$large"
launch shared2_large 2 --topologies tp2,cp2 --shapes "$large"
if (( ${#files[@]} )); then
    python3 benchmarks/benchmark_distributed.py --merge "${files[@]}" --out "$out/distributed_shared_device_full_depth.json"
fi
