#!/usr/bin/env bash
# The measurements that need one CUDA GPU, most wanted first, each under its own time limit, each benchmark's log and
# JSON rows written to OUT_DIR as it goes (what a short lease of a GPU machine should run; CI has no GPU and never
# runs this). Needs the pack's requirements in this Python and a CUDA torch.
#
#     bash tests/gpu_checks.sh OUT_DIR   # limits in seconds: AV_EAGER, GUIDER, AV_COMPILED, AV_GUIDED, WAN,
#                                        # VAE, CUDA_TESTS, FSDP (below)
#
# 1. MiniMax-H3 and LTX-2.3 at full size (random weights), bf16, through the engine's MODEL: s per call eager, with
#    the host syncs a call makes counted (two are the call's own upload and download);
# 2. FLUX.1-dev 1024x1024 on the MODEL route vs the engine's own loop: what a round trip adds;
# 3. the two audio-video families compiled;
# 4. LTX-2.3 with LTXVAddGuide's first and last frames at 0.7 (the guides' attention weights: the masked kernels);
# 5. Wan 2.1 14B at 832x480, 33 frames, on both routes;
# 6. the Wan 2.1 and 2.2 VAEs at their released widths (random weights), bf16, decode and encode of 832x480 (2.2:
#    1280x704), 33 frames, and the FLUX.1 / SD3 and FLUX.2 VAEs at 1024x1024, on one GPU (with more GPUs: --ranks
#    1,2,4 --gpus 0,1,2,3);
# 7. the CUDA tests of what only CUDA kernels show: the guides' bias through the efficient kernel with the ring merge
#    (a ring block of removed guide keys included), the fp8 weight option on every family (tests/test_cuda.py);
# 8. what FSDP2 holds whole while a block runs, two ranks of a shard group on the one GPU (tests/gpu_fsdp_memory.py),
#    against the planner's memory.IN_FLIGHT_BLOCKS.
# Several GPUs (NCCL, divided weights with prefetch, Ring with guides): tests/gpu_checks_multi.sh.
set -uo pipefail
out=${1:?give the folder the logs go to}
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
run av_eager "${AV_EAGER:-150}" av --rows eager --width 1280 --height 704 --calls 4
run guider_flux "${GUIDER:-70}" guider --gpus 0 --model synthetic:flux-dev --width 1024 --height 1024 --steps 6 \
    --repeats 2
run av_compiled "${AV_COMPILED:-170}" av --rows compiled --no-syncs --width 1280 --height 704 --calls 4
run av_guided "${AV_GUIDED:-80}" av --models ltx-2.3 --rows guided --width 1280 --height 704 --calls 3
run guider_wan "${WAN:-90}" guider --gpus 0 --model synthetic:wan2.1-14b --width 832 --height 480 --frames 33 \
    --steps 3 --repeats 1
run vae_wan21 "${VAE:-150}" vae --widths full --kind wan2.1 --gpus 0 --ranks 1 --width 832 --height 480 --frames 33
run vae_wan22 "${VAE:-150}" vae --widths full --kind wan2.2 --gpus 0 --ranks 1 --width 1280 --height 704 --frames 33
run vae_flux "${VAE:-150}" vae --widths full --kind flux --gpus 0 --ranks 1 --width 1024 --height 1024
run vae_flux2 "${VAE:-150}" vae --widths full --kind flux2 --gpus 0 --ranks 1 --width 1024 --height 1024
echo "=== cuda tests (at most ${CUDA_TESTS:-120} s) $(date +%T)"
timeout "${CUDA_TESTS:-120}" python -m pytest tests/test_cuda.py -q -s -k "guides_bias or fp8_weight_option or wan_animate2" \
    > "$out/cuda_tests.log" 2>&1
echo "=== cuda tests exit $? $(date +%T)"; grep -E "relative|passed|failed" "$out/cuda_tests.log" | tail -n 12
echo "=== fsdp memory (at most ${FSDP:-90} s) $(date +%T)"
timeout "${FSDP:-90}" python tests/gpu_fsdp_memory.py 256 8 > "$out/fsdp_memory.log" 2>&1
echo "=== fsdp memory exit $? $(date +%T)"; tail -n 4 "$out/fsdp_memory.log"
echo "done $(date +%T)"
