#!/usr/bin/env bash
# The measurements that need one CUDA GPU, most wanted first, each under its own time limit, each benchmark's log and
# JSON rows written to OUT_DIR as it goes (what a short lease of a GPU machine should run; CI has no GPU and never
# runs this). Needs the pack's requirements in this Python and a CUDA torch.
#
#     bash tests/gpu_checks.sh OUT_DIR   # limits in seconds: AV_EAGER, GUIDER, AV_COMPILED, AV_GUIDED, WAN, VAE (below)
#
# 1. MiniMax-H3 and LTX-2.3 at full size (random weights), bf16, through the engine's MODEL: s per call eager, with
#    the host syncs a call makes counted (two are the call's own upload and download);
# 2. FLUX.1-dev 1024x1024 on the MODEL route vs the engine's own loop: what a round trip adds;
# 3. the two audio-video families compiled;
# 4. LTX-2.3 with LTXVAddGuide's first and last frames at 0.7 (the guides' attention weights: the masked kernels);
# 5. Wan 2.1 14B at 832x480, 33 frames, on both routes;
# 6. the Wan 2.1 and 2.2 VAEs at their released widths (random weights), bf16, decode and encode of 832x480 (2.2:
#    1280x704), 33 frames, on one GPU (with more GPUs: --ranks 1,2,4 --gpus 0,1,2,3).
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
echo "done $(date +%T)"
