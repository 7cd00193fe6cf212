"""`python -m engine plan`'s decode lines: the model's VAE decode priced on 1 and on the plan's GPUs (engine/vae/cost.py;
a row split across the ranks, as the xDiT VAE Loader runs it), its memory per GPU beside the transformer's weights,
and the whole clip (denoise + decode). Text encoding runs once in ComfyUI and is not priced."""
from __future__ import annotations

from ..vae import cost


def decode(info, latent_shape: tuple, hw, chosen, dtype: str = "bf16") -> dict:
    """The decode priced for the job: {"vae", "one_gpu", "on_plan", "whole_s", "fits", ...} or {"not_priced": why}."""
    if hw.device != "cuda":
        return {"not_priced": "CPU ranks are not priced (python -m engine bench vae measures them)"}
    ranks = chosen.ranks if chosen is not None else 1
    found, (one, *rest), why = _priced(info, latent_shape, hw, sorted({1, ranks}), dtype)
    if found is None or one is None:
        return {"not_priced": why}
    on_plan = rest[0] if rest else one
    # what the ranks hold while they decode: the transformer's weights and runtime (its activations are gone)
    beside = chosen.memory["total"] - chosen.memory["activations"] if chosen is not None else 0.0
    room = hw.memory_gib or 0.0
    out = {"vae": found.title, "one_gpu": _entry(one), "on_plan": _entry(on_plan), "ranks": on_plan.ranks,
           "beside_transformer_gib": beside, "device_gib": room}
    if chosen is not None:
        out["denoise_s"] = chosen.s_per_image
        out["whole_s"] = chosen.s_per_image + on_plan.seconds
    out["fits"] = ("beside" if not room or beside + on_plan.memory_gib <= room else
                   "alone" if on_plan.memory_gib <= room else "no")
    return out


def _priced(info, latent_shape, hw, ranks, dtype):
    found, estimates, why = cost.decode_estimates(info.family, info.variant, latent_shape, ranks, hw, dtype,
                                                  model_title=info.spec.title)
    return found, (estimates or [None]), why


def _entry(e: cost.Estimate) -> dict:
    return {"seconds": e.seconds, "compute_s": e.compute_s, "exchange_s": e.halo_s + e.gather_s + e.latency_s,
            "gib_per_gpu": e.memory_gib, "weights_gib": e.weights_gib, "activations_gib": e.activations_gib,
            "ranks": e.ranks}


def lines(d: dict, per: str) -> list[str]:
    """The plan's decode lines from decode()'s dict."""
    if "not_priced" in d:
        return [f"decode: {d['not_priced']}"]
    one, on = d["one_gpu"], d["on_plan"]
    out = [f"decode ({d['vae']} VAE, as the xDiT VAE Loader runs it): est. {on['seconds']:.2f} s on {on['ranks']} "
           f"GPU(s) (a band of every frame's rows each; halo and gathers {on['exchange_s']:.3f} s), "
           f"{on['gib_per_gpu']:.1f} GiB a GPU (weights {on['weights_gib']:.2f} + activations "
           f"{on['activations_gib']:.1f}); one GPU: est. {one['seconds']:.2f} s, {one['gib_per_gpu']:.1f} GiB"]
    if d["fits"] == "alone":
        out.append(f"decode memory: {on['gib_per_gpu']:.1f} GiB does not fit beside the transformer's "
                   f"{d['beside_transformer_gib']:.1f} GiB on a {d['device_gib']:.4g} GiB GPU: the ranks move the "
                   f"transformer to host memory for the decode (it comes back for the next job)")
    elif d["fits"] == "no":
        out.append(f"decode memory: {on['gib_per_gpu']:.1f} GiB a GPU does not fit a {d['device_gib']:.4g} GiB GPU "
                   f"even alone: use more GPUs, or VAE Decode (Tiled) (its tiles spread over the ranks)")
    if "whole_s" in d:
        out.append(f"whole {per} (text encoding aside): denoise {d['denoise_s']:.2f} s + decode {on['seconds']:.2f} s "
                   f"= est. {d['whole_s']:.2f} s")
    return out
