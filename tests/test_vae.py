"""The VAE across the engine's ranks (gloo CPU ranks, tiny files): each row-split layer on 1 to 4 ranks with uneven
bands equals the unsplit torch op, and the Wan 2.1 and 2.2, FLUX.1 / SD3 and FLUX.2 decode and encode on 2 and 4 ranks
equal one rank's.

The bound is derived from the network's own rounding (docs/vae.md): a split computes the same sums in another order,
so its float32 result is as far from the float64 result as the unsplit float32 result is, up to a factor: relative
L2 distance to float64 <= 4 x the unsplit float32's (both printed, with the max abs difference)."""
import pytest
import torch
import torch.nn.functional as F

from engine.errors import JobCancelled
from engine.vae import client
from engine.vae.load import inspect_vae, load_vae, write_tiny_vae
from tolerance import within



def bands(engine, spec, inputs):
    result = engine.submit("vae_layer", spec, inputs)
    return torch.cat([result.outputs[f"rows.{i}"] for i in range(len(result.outputs))], -2)


WORLDS = (1, 2, 3, 4)
ROWS7 = {1: [7], 2: [2, 5], 3: [3, 1, 3], 4: [1, 2, 3, 1]}     # uneven bands of 7 rows, one-row bands included
ROWS12 = {1: [12], 2: [4, 8], 3: [2, 6, 4], 4: [2, 2, 6, 2]}   # even bands (a stride-2 downsample's)


def tensors(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", ["zeros", "reflect", "replicate"])
def test_a_halo_conv_on_row_bands_equals_the_unsplit_conv(engines, world, mode):
    x, w, b = tensors((2, 3, 7, 5), (4, 3, 3, 3), (4,))
    ref = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="constant" if mode == "zeros" else mode), w, b)
    whole = torch.nn.Conv2d(3, 4, 3, padding=1, padding_mode=mode)
    whole.load_state_dict({"weight": w.float(), "bias": b.float()})
    out = bands(engines(world), {"layer": "conv2d", "rows": ROWS7[world], "padding": 1, "mode": mode},
                {"x": x.float(), "weight": w.float(), "bias": b.float()})
    assert within(f"conv2d {mode} on {ROWS7[world]}", out, whole(x.float()).detach(), ref)


@pytest.mark.parametrize("world", WORLDS)
def test_a_stride_2_downsample_takes_the_row_below_and_the_zero_row_on_the_last_rank(engines, world):
    x, w, b = tensors((2, 3, 12, 6), (4, 3, 3, 3), (4,))
    ref = F.conv2d(F.pad(x, (0, 1, 0, 1)), w, b, stride=2)
    whole = F.conv2d(F.pad(x.float(), (0, 1, 0, 1)), w.float(), b.float(), stride=2)
    out = bands(engines(world), {"layer": "down2d", "rows": ROWS12[world]},
                {"x": x.float(), "weight": w.float(), "bias": b.float()})
    assert out.shape == ref.shape and within(f"down2d on {ROWS12[world]}", out, whole, ref)


@pytest.mark.parametrize("world", WORLDS)
def test_a_causal_conv_over_chunks_with_haloed_caches_equals_the_whole_clip_conv(engines, world):
    """Chunks of 1, 2 and 2 frames, each cache cut from the haloed band (ComfyUI's Wan decode's pattern), against one
    conv over the whole clip padded causally."""
    x, w, b = tensors((1, 3, 5, 7, 4), (4, 3, 3, 3, 3), (4,))
    ref = F.conv3d(F.pad(x, (1, 1, 1, 1, 2, 0)), w, b)
    whole = F.conv3d(F.pad(x.float(), (1, 1, 1, 1, 2, 0)), w.float(), b.float())
    out = bands(engines(world), {"layer": "causal3d", "rows": ROWS7[world], "padding": 1, "chunks": [1, 2, 2]},
                {"x": x.float(), "weight": w.float(), "bias": b.float()})
    assert within(f"causal conv3d on {ROWS7[world]}", out, whole, ref)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("per_frame", [False, True])
def test_group_norm_takes_its_statistics_over_the_whole_frame(engines, world, per_frame):
    x, w, b = tensors((2, 8, 3, 7, 5), (8,), (8,), seed=1)
    x = x * 3 + 1.5   # a mean and scale of its own: the statistics matter

    def norm(t, wt, bt):
        if not per_frame:
            return F.group_norm(t, 4, wt, bt, 1e-6)
        n, c, f = t.shape[:3]
        y = F.group_norm(t.transpose(1, 2).reshape(n * f, c, *t.shape[3:]), 4, wt, bt, 1e-6)
        return y.reshape(n, f, c, *t.shape[3:]).transpose(1, 2)
    out = bands(engines(world), {"layer": "groupnorm", "rows": ROWS7[world], "groups": 4, "eps": 1e-6,
                                 "per_frame": per_frame}, {"x": x.float(), "weight": w.float(), "bias": b.float()})
    assert within(f"group norm (per frame {per_frame}) on {ROWS7[world]}", out, norm(x.float(), w.float(), b.float()),
                  norm(x, w, b))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kernel", ["split", "sdpa"])
def test_attention_of_a_bands_queries_over_the_gathered_keys_equals_whole_frame_attention(engines, world, kernel):
    q, k, v = tensors((3, 8, 7, 5), (3, 8, 7, 5), (3, 8, 7, 5), seed=2)

    def attend(q, k, v):
        n, c = q.shape[:2]
        p = torch.softmax(q.reshape(n, c, -1).transpose(1, 2) @ k.reshape(n, c, -1) / c ** 0.5, -1)
        return (v.reshape(n, c, -1) @ p.transpose(1, 2)).reshape(q.shape)
    out = bands(engines(world), {"layer": "attention", "rows": ROWS7[world], "kernel": kernel},
                {"x": q.float(), "q": q.float(), "k": k.float(), "v": v.float()})
    assert within(f"attention ({kernel}) on {ROWS7[world]}", out, attend(q.float(), k.float(), v.float()),
                  attend(q, k, v))


# ---- the Wan VAEs ------------------------------------------------------------------------------------------------
CASES = {   # kind: (latent to decode, frames to encode); 5 latent rows: bands (3, 2) and (2, 1, 1, 1)
    "wan2.1": ((1, 16, 4, 5, 6), 13),   # 4 latent frames: a last chunk of one; 13 frames: every deferral path
    "wan2.2": ((1, 48, 3, 5, 6), 9),
}


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """Per kind: the tiny file, its inputs, and one rank's decode and encode in float32 and float64 (in process)."""
    folder = tmp_path_factory.mktemp("vae")
    out = {}
    for name, (latent_shape, frames) in CASES.items():
        path = write_tiny_vae(name, str(folder))
        info = inspect_vae(path)
        model = load_vae(info, "fp32", torch.device("cpu"))
        g = torch.Generator().manual_seed(3)
        latent = torch.randn(latent_shape, generator=g)
        s = info.kind.spatial
        pixels = torch.rand(1, 3, frames, latent_shape[3] * s, latent_shape[4] * s, generator=g) * 2 - 1
        with torch.inference_mode():
            whole = {"decode": model.decode(latent), "encode": model.encode(pixels)}
            model = model.double()
            ref = {"decode": model.decode(latent.double()), "encode": model.encode(pixels.double())}
        out[name] = {"path": path, "decode": latent, "encode": pixels, "whole": whole, "ref": ref}
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("op", ["decode", "encode"])
@pytest.mark.parametrize("name", list(CASES))
def test_wan_on_row_bands_of_several_ranks_equals_one_rank(engines, wan, world, op, name):
    case = wan[name]
    got, result = client.run(engines(world), op, case["path"], case[op])
    vae = result.ranks[0]["vae"]
    print(f"{name} {op} on {world} rank(s): bands {vae['rows']} latent rows, {vae['chunks']} chunks, rank 0 sent "
          f"{vae['sent']} bytes")
    assert got.shape == case["whole"][op].shape
    assert within(f"{name} {op} on {world} rank(s)", got, case["whole"][op], case["ref"][op])


def test_progress_comes_per_temporal_chunk_and_the_weights_stay_loaded(engines, wan):
    case, seen = wan["wan2.1"], []
    first = client.run(engines(2), "decode", case["path"], case["decode"])[1]
    again = client.run(engines(2), "decode", case["path"], case["decode"],
                       on_progress=lambda s, t: seen.append((s, t)))[1]
    assert seen == [(1, 3), (2, 3), (3, 3)]   # 4 latent frames: the first alone, then two a chunk
    assert {r["vae_source"] for r in again.ranks} == {"resident"}
    assert {r["vae_source"] for r in first.ranks} <= {"file", "resident"}


def test_a_cancel_stops_every_rank_between_chunks_and_the_next_decode_runs(engines, wan):
    case, seen = wan["wan2.1"], []
    latent = torch.randn(1, 16, 17, 12, 12, generator=torch.Generator().manual_seed(4))   # 9 chunks
    with pytest.raises(JobCancelled) as stopped:   # asked from the start: the ranks agree on it within two chunks
        client.decode(engines(2), case["path"], latent, on_progress=lambda s, t: seen.append(s),
                      should_cancel=lambda: True)
    print(f"cancel asked from the start; the ranks stopped together at chunk {stopped.value.step} of 9 (progress "
          f"seen: {seen})")
    assert stopped.value.step < 9 and len(seen) < 9
    after = client.decode(engines(2), case["path"], case["decode"])
    assert within("the decode after the cancel", after, case["whole"]["decode"], case["ref"]["decode"])


# ---- the FLUX VAEs (images) ----------------------------------------------------------------------------------------
IMAGES = {   # kind: the latent to decode (the image to encode is its size); 5 latent rows: bands (3, 2), (2, 1, 1, 1)
    "flux": (2, 16, 5, 3),   # two images: each its own GroupNorm statistics
    "flux2": (1, 128, 5, 2),
}


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """Per kind: the tiny file, its inputs, and one rank's decode and encode in float32 and float64 (in process)."""
    folder = tmp_path_factory.mktemp("vae")
    out = {}
    for name, latent_shape in IMAGES.items():
        path = write_tiny_vae(name, str(folder))
        model = load_vae(inspect_vae(path), "fp32", torch.device("cpu"))
        g = torch.Generator().manual_seed(6)
        latent = torch.randn(latent_shape, generator=g)
        s = model.spatial
        pixels = torch.rand(latent_shape[0], 3, latent_shape[2] * s, latent_shape[3] * s, generator=g) * 2 - 1
        with torch.inference_mode():
            whole = {"decode": model.decode(latent), "encode": model.encode(pixels)}
            model = model.double()
            ref = {"decode": model.decode(latent.double()), "encode": model.encode(pixels.double())}
        out[name] = {"path": path, "decode": latent, "encode": pixels, "whole": whole, "ref": ref}
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("op", ["decode", "encode"])
@pytest.mark.parametrize("name", list(IMAGES))
def test_flux_on_row_bands_of_several_ranks_equals_one_rank(engines, flux, world, op, name):
    """Every GroupNorm's statistics all-reduced, the middle attention's K and V gathered, a halo row a conv."""
    case = flux[name]
    got, result = client.run(engines(world), op, case["path"], case[op])
    vae = result.ranks[0]["vae"]
    print(f"{name} {op} on {world} rank(s): bands {vae['rows']} latent rows, rank 0 sent {vae['sent']} bytes")
    assert got.shape == case["whole"][op].shape and len(vae["rows"]) == world
    assert within(f"{name} {op} on {world} rank(s)", got, case["whole"][op], case["ref"][op])
