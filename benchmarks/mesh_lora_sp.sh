#!/usr/bin/env bash
# The GPU proof of SP training, one device call: the mesh LoRA step with sequence parallelism at
# H3Config.full() widths (2 blocks + the refiner, released dtypes, rank-16 LoRA on every projection, fl2va 512 rows),
# 4 shared-device ranks on ONE GPU over gloo, host-staged (bytes only): tp2+sp (two data-parallel replicas),
# tp2xcp2+sp and tp4+sp, each rank's loss and gradient against rank 0's one-process step
# (benchmarks/benchmark_mesh_lora.py) -> $OUT/mesh_lora_step_sp.json.
# Run ON THE DEVICE MACHINE in the carried checkout after `. benchmarks/gpu_env.sh`:
#   . benchmarks/gpu_env.sh && bash benchmarks/mesh_lora_sp.sh
# Cut at DEADLINE_S seconds (default 230): the benchmark rewrites its JSON after each topology, so a cut run keeps the
# topologies it finished. TOPOLOGIES overrides the list. CPU dry run (tiny config, 2 ranks, interpreter):
#   TRITON_INTERPRET=1 NPROC=2 TOPOLOGIES=tp2+sp TINY=--tiny OUT=/tmp bash benchmarks/mesh_lora_sp.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:?OUT must name the folder whose files come back}"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader 2>/dev/null | tee -a "$out/log.txt"
echo "=== mesh_lora_step_sp ($(date -u +%H:%M:%S))" | tee -a "$out/log.txt"
timeout -k 15 "${DEADLINE_S:-230}" python3 -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-4}" \
    benchmarks/benchmark_mesh_lora.py ${TINY:-} --topologies "${TOPOLOGIES:-tp2+sp,tp2xcp2+sp,tp4+sp}" \
    --out "$out/mesh_lora_step_sp.json" 2>&1 | grep -v "^W1" | tee -a "$out/log.txt"
rc=${PIPESTATUS[0]}
echo "=== mesh_lora_step_sp rc=$rc ($(date -u +%H:%M:%S))" | tee -a "$out/log.txt"
exit "$rc"
