"""Correctness on several CUDA GPUs (NCCL between ranks), what CPU ranks over gloo cannot show: the LTX-2.3 guides'
bias through the ring's merge and the CUDA kernels, the audio-video exchanges, and MiniMax-H3 with divided weights
across CFG groups, on tiny files in fp32 on the GPUs against one CPU rank (the bound each CPU test derives).
Prints one line a check; exit 1 if any is off. Run by tests/gpu_checks_multi.sh.

    python tests/gpu_multi_checks.py 0,1
"""
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from engine.generate.model_call import ModelSession  # noqa: E402
from engine.generate.request import GenerateRequest  # noqa: E402
from engine.models.flow import FlowModel  # noqa: E402
from engine.models.load import load_model  # noqa: E402
from engine.models.tiny import write_tiny  # noqa: E402
from engine.parallel.plan import ParallelPlan  # noqa: E402
from engine.runtime.client import Engine  # noqa: E402


def on_gpus(path, c, plan, latent, neg=None):
    return GenerateRequest(model=path, cond=c["context"], latent_raw=torch.zeros(()).expand(*latent), dtype="fp32",
                           cfg=2.0 if neg is not None else 1.0, neg_cond=neg, plan=plan).validate(plan.world_size)


def main(gpus: list[int]) -> int:
    import test_ltx23 as ltx
    import test_minimax_h3 as h3
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    failed = 0
    d = tempfile.mkdtemp()
    ltx_path, h3_path = write_tiny("ltx23", d), write_tiny("minimax-h3", d)
    ltx_local = FlowModel(load_model(ltx_path, dtype="fp32"))
    h3_local = FlowModel(load_model(h3_path, dtype="fp32"))
    with Engine(len(gpus), device="cuda", gpus=gpus) as engine:
        for plan in (ParallelPlan(ring=2), ParallelPlan(ulysses=2), ParallelPlan(ring=2, shard=2)):
            for name, kw in (("guided", {}), ("IC-LoRA reference", {"h": 2, "w": 4, "dilated": True}),
                             ("pixel mask", {"pixel_mask": torch.linspace(0, 1, 64 * 96).reshape(1, 1, 1, 64, 96)})):
                x, t, c = ltx.guided_call(seed=4, **kw)
                want = ltx.reference(ltx_local, x, t, c)
                frames, h, w = (int(v) for v in c["av_shape"][0, 1:4].tolist())
                with ModelSession(engine, on_gpus(ltx_path, c, plan, (1, 128, frames, h, w))) as s:
                    got = s.call(x, t, c).float()
                diff, bound = float((got - want).abs().max()), float(ltx.bound(want))
                failed += diff > bound
                print(f"LTX-2.3 {name}, {plan.describe()} on CUDA (NCCL): max abs diff {diff:.3g} (bound {bound:.3g})",
                      flush=True)
        calls = [h3.h3_call(seed=s) for s in (1, 2, 3)]
        pos = (torch.cat([calls[0][0], calls[1][0]]), torch.cat([calls[0][1], calls[1][1]]),
               {k: torch.cat([calls[0][2][k], calls[1][2][k]]) for k in calls[0][2]})
        want = [torch.cat([h3.reference(h3_local, *calls[0]), h3.reference(h3_local, *calls[1])]),
                h3.reference(h3_local, *calls[2])]
        request = on_gpus(h3_path, calls[0][2], ParallelPlan(cfg=2, shard=2), (1, 24, 3, 4, 6),
                          neg=calls[2][2]["context"])
        with ModelSession(engine, request) as s:
            got = s.call_group([pos, calls[2]])
        for name, g, w in zip(("positive (2 rows)", "negative (1 row)"), got, want):
            diff, bound = float((g.float() - w).abs().max()), float(h3.bound(w))
            failed += diff > bound
            print(f"MiniMax-H3 cfg2 x shard2 {name} on CUDA (NCCL): max abs diff {diff:.3g} (bound {bound:.3g})",
                  flush=True)
    print(f"{failed} check(s) off")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main([int(g) for g in (sys.argv[1] if len(sys.argv) > 1 else "0,1").split(",")]))
