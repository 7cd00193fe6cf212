"""`python -m engine bench av`: the audio-video families (MiniMax-H3, LTX-2.3) at full size with random weights on one
rank, driven one model call at a time through the engine's MODEL (ComfyUI's sampler on the xDiT Engine: the packed
audio + video latent, the call's family tensors as ComfyUI's model passes them), eager and compiled: seconds per call
as the caller waits and as rank 0's device measured it, peak memory, the host synchronisations a call makes on the
rank (counted by the instrument in engine/syncs.py, in a separate session: counting slows the call), beside the
planner's estimate for one step of the same job. With cfg 1 (the turbo LoRAs, LTX-2.3's distilled pass) a call is a
step."""
from __future__ import annotations

import math
import statistics

import torch

from ..runtime.client import Engine
from . import args as types
from .args import UsageError
from .tables import markdown

MODELS = {"minimax-h3": "synthetic:minimax-h3", "ltx-2.3": "synthetic:ltx-2.3"}
ROWS = {"eager": {}, "compiled": {"compile": True}, "guided": {}}   # guided: LTX-2.3 with LTXVAddGuide's two frames
SYNCS = ("read", "upload", "wait")


def register(bench, emit) -> None:
    p = bench.add_parser("av", help="MiniMax-H3 and LTX-2.3 at full size on one rank through the engine's MODEL: "
                                    "s per call eager and compiled, host syncs per call, the planner beside",
                         description=__doc__.split(": ", 1)[1].replace("\n", " "))
    p.add_argument("--models", type=_models, default=",".join(MODELS),
                   help="comma-separated: " + ", ".join(MODELS) + " (or synthetic:<variant>[:tiny] sources)")
    p.add_argument("--rows", type=types.name_list(list(ROWS)), default="eager,compiled",
                   help="comma-separated: " + ", ".join(ROWS) + " (guided: LTX-2.3 calls with LTXVAddGuide's first "
                        "and last frames at 0.7, eager)")
    p.add_argument("--width", type=types.pixels, default=512, help="video width in pixels")
    p.add_argument("--height", type=types.pixels, default=288, help="video height in pixels")
    p.add_argument("--frames", type=types.positive_int, default=None,
                   help="pixel frames (default: the model's frame grid nearest 2 s at 24 fps)")
    p.add_argument("--text-tokens", type=types.positive_int, default=256, help="text tokens of the call")
    p.add_argument("--calls", type=types.positive_int, default=4, help="timed calls per row after two warm-up calls")
    p.add_argument("--gpus", type=types.gpu_list, default=None,
                   help="the CUDA GPU index to run on (default: 0; without CUDA: one CPU rank, for tiny sources)")
    p.add_argument("--no-syncs", action="store_true", help="skip the session that counts host synchronisations")
    p.set_defaults(run=lambda a: emit(a, "av", bench_av(
        [MODELS.get(m, m) for m in a.models], a.rows, a.width, a.height, a.frames, a.text_tokens, a.calls,
        a.gpus, syncs=not a.no_syncs)), parser=p)


def _models(text: str) -> list[str]:
    """Comma-separated: minimax-h3, ltx-2.3 (by any of their names: h3, ltx23), or synthetic:<variant>[:tiny|:small]
    sources of those families."""
    from argparse import ArgumentTypeError
    from .. import families

    def canonical(name: str) -> str:
        try:
            return families.variant(name)
        except ValueError:
            return name
    names = [n.strip() if n.strip().startswith("synthetic:") else canonical(n) for n in text.split(",")]
    bad = [n for n in names if n not in MODELS and not n.startswith("synthetic:")]
    if bad:
        raise ArgumentTypeError(f"{', '.join(map(repr, bad))} is not one of {', '.join(MODELS)} or a synthetic:<variant>"
                                f"[:tiny] source: e.g. minimax-h3,ltx-2.3")
    return names


def audio_shape(info, latent_frames: int) -> tuple:
    """The audio stream ComfyUI's empty audio-video latent holds beside a video of `latent_frames` latent frames."""
    fmt = info.latent
    pixel_frames = fmt.pixel_frames(latent_frames)
    if info.family == "minimax-h3":
        from ..families.minimax_h3 import audio_frames
        return (1, 32, 2, audio_frames(pixel_frames))
    if info.family == "ltx23":
        from ..families.ltx23 import AUDIO_BINS, AUDIO_CHANNELS, audio_frames
        return (1, AUDIO_CHANNELS, audio_frames(pixel_frames), AUDIO_BINS)
    raise UsageError(f"model {info.variant!r} is not an audio-video family: bench av runs minimax-h3 and ltx-2.3")


def make_call(info, request, sigma: float, seed: int = 0, guided: bool = False):
    """(x, timestep, conditioning) of one model call as ComfyUI's model makes it for this request's latent: random
    packed streams, the request's text, and the family tensors its call_extras builds. guided (LTX-2.3): the video
    latent two frames longer, LTXVAddGuide's first image at frame 0 and last at the clip's end, each at strength 0.7
    (their noise mask 0.3, their positions, the attention weight between them and the generated tokens)."""
    video_shape = tuple(request.latent_raw.shape)
    frames = video_shape[2]
    if guided:
        video_shape = video_shape[:2] + (frames + 2,) + video_shape[3:]
    shapes = [video_shape, audio_shape(info, frames)]
    g = torch.Generator().manual_seed(seed)
    streams = [torch.randn(s, generator=g) for s in shapes]
    x = torch.cat([s.reshape(1, 1, -1) for s in streams], dim=-1)
    t = torch.tensor([sigma * request.sampling(info).timesteps_per_sigma], dtype=torch.float32)
    kwargs, timestep = {}, t
    if guided:
        kwargs = _guides(video_shape, frames, info.latent.pixel_frames(frames) - 1)
        mask = kwargs["denoise_mask"]
        timestep = (mask.reshape(1, -1, 1) * t, t.reshape(1, 1, 1).expand(1, shapes[1][2], 1))
    extras, timestep = info.spec.call_extras(shapes, kwargs, {}, timestep, None)
    return x, timestep, {"context": request.cond, **extras}


def _guides(video_shape: tuple, frames: int, last: int) -> dict:
    """What two LTXVAddGuide nodes (one-image guides at pixel frame 0 and `last`, strength 0.7) leave for ComfyUI's
    LTX model: the noise mask (1, then 0.3 on the two appended frames), each guide token's pixel coordinates (a
    one-frame latent's corners x (8, 32, 32), its time (0, 1) after the causal fix, plus the frame), their entries."""
    _, _, total, h, w = video_shape
    mask = torch.ones(1, 1, total, h, w)
    mask[:, :, frames:] = 0.3
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ys, xs = ys.reshape(-1).float(), xs.reshape(-1).float()
    coords = torch.cat([torch.stack([torch.tensor([0.0, 1.0]).expand(h * w, 2) + at,
                                     torch.stack([ys * 32, ys * 32 + 32], -1), torch.stack([xs * 32, xs * 32 + 32], -1)])
                        for at in (0, last)], dim=1)[None]
    entry = {"pre_filter_count": h * w, "strength": 0.7, "pixel_mask": None, "latent_shape": [1, h, w]}
    return {"denoise_mask": mask, "keyframe_idxs": coords, "guide_attention_entries": [entry, dict(entry)]}


def _request(source: str, width: int, height: int, frames: int | None, text_tokens: int, options: dict, device):
    from ..generate.request import GenerateRequest
    from ..models.load import inspect_model
    from ..parallel.devices import cpu_hardware
    info = inspect_model(source)
    if info.spec.call_extras is None or not info.spec.packed_streams:
        raise UsageError(f"model {source!r} is not an audio-video family: bench av runs minimax-h3 and ltx-2.3")
    from ..generate.inputs import check_frames
    fmt = info.latent
    frames = frames or fmt.pixel_frames(fmt.latent_frames(49))
    check_frames(info, frames)   # a count ComfyUI's video nodes make, or one line naming the nearest
    dtype = "bf16" if device == "cuda" else "fp32"
    request = GenerateRequest.random_conditioning(source, width, height, text_tokens=text_tokens, frames=frames,
                                                  steps=1, cfg=1.0, dtype=dtype, **options)
    return info, request.validate(1, None if device == "cuda" else cpu_hardware(1))


def _planned_s(info, request, gpus) -> float | None:
    """The cost model's seconds for one step of this job (cfg 1: one call) on one GPU of the kind it runs on."""
    if gpus is None:
        return None
    from ..parallel import cost
    from ..parallel.devices import detect_hardware
    from ..parallel.plan import ParallelPlan
    return cost.estimate(ParallelPlan(), request.workload(info), detect_hardware(tuple(gpus))).s_per_image


def _engine(gpus, count: bool) -> Engine:
    env = {"XDIT_HOST_SYNCS": "count"} if count else {}
    if gpus is None:
        return Engine(1, device="cpu", env=env)
    return Engine(1, device="cuda", gpus=gpus, env=env)


def _session(engine, info, request, calls: int, guided: bool = False):
    """Two warm-up calls (the conditioning sent, compiled graphs built), then `calls` timed calls at falling sigmas:
    (the session, caller's seconds per timed call, rank 0's model seconds per timed call)."""
    from ..generate.model_call import ModelSession
    with ModelSession(engine, request) as session:
        for k in range(calls + 2):
            x, t, c = make_call(info, request, sigma=0.95 - 0.9 * k / (calls + 2), seed=k, guided=guided)
            session.call(x, t, c)
    return session, session.call_s[2:], session.model_s[2:]


def bench_av(sources, rows, width, height, frames, text_tokens, calls, gpus, *, syncs=True) -> list[dict]:
    if gpus is None and torch.cuda.is_available():
        gpus = [0]
    if gpus is not None and len(gpus) != 1:
        raise UsageError(f"argument --gpus: bench av runs one rank, give one index (got {len(gpus)})")
    device = "cuda" if gpus is not None else "cpu"
    requests = {}
    for source in sources:   # every input checked before any rank starts
        for row in rows:
            if row == "guided" and not _is_ltx(source):
                raise UsageError(f"argument --rows: guided runs LTX-2.3 with LTXVAddGuide's frames; {source!r} is not "
                                 f"an LTX-2.3 source: give --models ltx-2.3 for it")
            try:
                requests[source, row] = _request(source, width, height, frames, text_tokens, ROWS[row], device)
            except ValueError as e:
                raise UsageError(str(e)) from None
    where = torch.cuda.get_device_name(gpus[0]) if gpus is not None else "CPU"
    print(f"one rank on {where}, torch {torch.__version__}, {'bf16' if device == 'cuda' else 'fp32'}, {width}x{height}, "
          f"cfg 1 (a call is a step); per row 2 warm-up calls + {calls} timed, median", flush=True)
    results = []
    with _engine(gpus, False) as engine:
        for (source, row), (info, request) in requests.items():
            audio = info.spec.extra_tokens(info.config, request.latent_raw.shape[2])
            video = request.workload(info).image_tokens - audio   # the planner's sequence counts the audio rows too
            if row == "guided":   # the two guide frames' tokens end the video's
                video += 2 * math.prod(request.latent_raw.shape[3:])
            print(f"measuring {source} {row}: latent {list(request.latent_raw.shape)}, {video} video + {audio} audio "
                  f"tokens ...", flush=True)
            session, waits, model = _session(engine, info, request, calls, guided=row == "guided")
            rank = session.result.ranks[0]
            result = {"model": source, "row": row, "device": where, "latent": list(request.latent_raw.shape),
                      "frames": info.latent.pixel_frames(request.latent_raw.shape[2]),
                      "video_tokens": video, "audio_tokens": audio,
                      "text_tokens": text_tokens, "call_s": statistics.median(waits),
                      "model_s": statistics.median(model), "warmup_call_s": session.call_s[0],
                      "peak_gib": rank.get("memory", {}).get("peak_gib"),
                      "planned_step_s": _planned_s(info, request, gpus)}
            results.append(result)
            print(f"  {row}: {result['call_s']:.3f} s per call (model {result['model_s']:.3f} s; planner "
                  f"{_fmt(result['planned_step_s'])} s), first call {result['warmup_call_s']:.1f} s", flush=True)
    if syncs:   # once per model (its eager and compiled calls are the same calls), and for the guided calls
        counted = [(source, row) for source in sources for row in dict.fromkeys([rows[0]] + [
            r for r in rows if r == "guided"])]
        with _engine(gpus, True) as engine:
            for source, row in counted:
                info, request = requests[source, row]
                session, _, _ = _session(engine, info, request, 2, guided=row == "guided")
                counts = session.result.ranks[0]["host_syncs"]
                per_call = [sum(b[k] for k in SYNCS) for b in counts["per_step"][1:-1]]
                for r in results:
                    if r["model"] == source and (r["row"] == "guided") == (row == "guided"):
                        r["syncs_per_call"] = max(per_call)
                        r["sync_sites"] = {k: v for k, v in counts["where"].items() if k in SYNCS}
                print(f"{source}{' guided' if row == 'guided' else ''}: host syncs per call after the first "
                      f"{per_call}; where (over {len(counts['per_step']) - 1} calls): {counts['where']}", flush=True)
    _table(results)
    return results


def _is_ltx(source: str) -> bool:
    from ..models.load import inspect_model
    try:
        return inspect_model(source).family == "ltx23"
    except (ValueError, OSError):
        return False


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _table(results: list[dict]) -> None:
    header = ("model", "row", "latent (video)", "tokens video + audio + text", "s / call", "model s / call",
              "planner s / step", "peak GiB", "host syncs / call", "first call s")
    rows = [(r["model"], r["row"], "x".join(str(v) for v in r["latent"][2:]) + f" ({r['frames']} frames)"
             + (" + 2 guide frames" if r["row"] == "guided" else ""),
             f"{r['video_tokens']} + {r['audio_tokens']} + {r['text_tokens']}", f"{r['call_s']:.3f}",
             f"{r['model_s']:.3f}", _fmt(r["planned_step_s"]),
             "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}", str(r.get("syncs_per_call", "-")),
             f"{r['warmup_call_s']:.1f}") for r in results]
    print("\n" + markdown(header, rows))
    print("\nA call: ComfyUI's packed latent in, the velocity out, through the bridge (the caller's wait); model: rank "
          "0's device time from the inputs on the device to the output written back. Random weights (full size unless "
          "the source says tiny). "
          "The first call includes sending the text and, compiled, building the graphs. Host syncs: reads of device "
          "values, blocking uploads and waits on rank 0 per call after the first; two of them are the call's own "
          "(its one upload, its output's one download).")
