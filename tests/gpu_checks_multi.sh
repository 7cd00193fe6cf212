#!/usr/bin/env bash
# The checks that need several CUDA GPUs of one machine (NCCL between ranks), most wanted first, each under its own
# limit, logs and JSON rows in OUT_DIR as it goes (CI has no GPU; a lease of one GPU runs tests/gpu_checks.sh). Needs
# the pack's requirements and a CUDA torch; GPUS lists the GPUs (default 0,1).
#
#     GPUS=0,1 bash tests/gpu_checks_multi.sh OUT_DIR   # limits in seconds: CHECKS, FLUX, SHARD (below)
#
# 1. correctness on NCCL: LTX-2.3 with LTXVAddGuide's guides (first and last frames, an IC-LoRA reference, a pixel
#    mask) under ring2, ulysses2 and ring2 x shard2, and MiniMax-H3 under cfg2 x shard2 with unequal rows, tiny files in
#    fp32 on the GPUs against one CPU rank (tests/gpu_multi_checks.py);
# 2. FLUX.1-dev at full size (random weights) on the MODEL route and the engine's loop, ulysses2 and ring2: s/step;
# 3. divided weights with FSDP2's prefetch: Wan 2.1 14B at 832x480x33 under ulysses2 x shard2: s/step and the GPU
#    memory against the planner's (gathers, IN_FLIGHT_BLOCKS).
set -uo pipefail
out=${1:?give the folder the logs go to}
gpus=${GPUS:-0,1}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
run() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name (at most ${limit} s) $(date +%T)"
    timeout "$limit" python -m engine bench --json "$out/$name.json" "$@" > "$out/$name.log" 2>&1
    echo "=== $name exit $? $(date +%T)"
    tail -n 20 "$out/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
nvidia-smi topo -m > "$out/topo.txt" 2>&1
echo "=== correctness on NCCL (at most ${CHECKS:-600} s) $(date +%T)"
timeout "${CHECKS:-600}" python tests/gpu_multi_checks.py "$gpus" > "$out/nccl_checks.log" 2>&1
echo "=== correctness exit $? $(date +%T)"; tail -n 14 "$out/nccl_checks.log"
for plan in ulysses2 ring2; do
    run "flux_$plan" "${FLUX:-150}" guider --gpus "$gpus" --plan "$plan" --model synthetic:flux-dev --width 1024 \
        --height 1024 --steps 6 --repeats 2
done
run wan_shard "${SHARD:-300}" guider --gpus "$gpus" --plan ulysses2,shard2 --model synthetic:wan2.1-14b --width 832 \
    --height 480 --frames 33 --steps 3 --repeats 1
echo "done $(date +%T)"
