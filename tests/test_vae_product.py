"""The VAE on the ranks as a product (gloo CPU ranks, tiny files): a checkpoint's VAE read with ComfyUI's key prefix,
the tile pool (VAE Decode/Encode (Tiled)'s tiles spread over the ranks, blended by the tiler as ComfyUI's own), the
count the planner prices a decode from (FLOPs, memory, the halo a split sends) against what the ranks send, and a rank
lost or out of memory during a decode said in one line."""
import importlib
import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import CheckpointError, EngineError
from engine.runtime.client import Engine
from engine.runtime.faults import Fault
from engine.vae import client, cost, tiles
from engine.vae.load import inspect_vae, kind, load_vae, write_tiny_vae

from conftest import FAST, PACK_NAME, load_pack
from tolerance import rel


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vae")
    out = {name: write_tiny_vae(name, str(folder)) for name in ("wan2.1", "wan2.2")}
    g = torch.Generator().manual_seed(0)
    ckpt = {f"vae.{k}": v for k, v in load_file(out["wan2.1"]).items()}
    ckpt["model.diffusion_model.patch_embedding.weight"] = torch.randn(8, 16, 1, 2, 2, generator=g)
    ckpt["text_encoders.umt5xxl.shared.weight"] = torch.randn(4, 8, generator=g)
    out["checkpoint"] = str(folder / "tiny-wan-all-in-one.safetensors")
    save_file(ckpt, out["checkpoint"])
    return out


def latent(shape, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---- a checkpoint's VAE ------------------------------------------------------------------------------------------
def test_a_checkpoints_vae_is_read_with_its_key_prefix_and_decodes_as_the_vae_file(engines, files):
    info = inspect_vae(files["checkpoint"], "vae.")
    assert (info.kind.name, info.widths, info.prefix) == ("wan2.1", inspect_vae(files["wan2.1"]).widths, "vae.")
    z = latent((1, 16, 3, 5, 6))
    from_checkpoint = client.decode(engines(2), files["checkpoint"], z, prefix="vae.")
    from_file = client.decode(engines(2), files["wan2.1"], z)
    assert torch.equal(from_checkpoint, from_file)   # the same weights, the same bands, the same kernels


def test_a_checkpoint_read_without_its_prefix_is_refused_in_one_line_naming_the_file(files):
    with pytest.raises(CheckpointError) as e:
        inspect_vae(files["checkpoint"])
    assert "tiny-wan-all-in-one.safetensors is not a VAE the engine splits" in str(e.value)
    with pytest.raises(CheckpointError) as e:
        inspect_vae(files["checkpoint"], "first_stage_model.")
    assert "'s first_stage_model. tensors are not a VAE" in str(e.value) and "\n" not in str(e.value)


# ---- the tile pool -----------------------------------------------------------------------------------------------
def test_tiles_go_largest_first_each_to_the_rank_with_the_least_work():
    assert tiles.assign([4, 4, 4, 4, 2, 2], 2) == [0, 1, 0, 1, 0, 1]
    assert tiles.assign([1, 9, 1, 1], 2) == [1, 0, 1, 1]
    assert tiles.assign([5], 4) == [0] and tiles.rounds(tiles.assign([3, 3, 3], 2), 2) == 2


@pytest.fixture(scope="module")
def tile_set():
    """Tiles of a decode as ComfyUI's 3-D tiler cuts them: whole ones and the smaller ones at the edges."""
    z = latent((1, 16, 3, 5, 6), seed=2)
    return [z[:, :, :2, :4, :4], z[:, :, :2, :4, 3:], z[:, :, 1:, 2:, :4], z[:, :, 1:, 1:, 2:], z[:, :, :1, :2, :3]]


def test_tiles_spread_over_the_ranks_each_equal_the_unsplit_network_on_that_tile(engines, files, tile_set):
    """Each tile whole on one rank: the unsplit network's result, to float32 rounding (the bound: 4 x this process's
    own float32 distance to float64, as tests/test_vae.py derives it)."""
    spread, result = tiles.run(engines(2), "decode", files["wan2.1"], tile_set)
    print("tiles a rank:", [r["vae"]["tiles"] for r in result.ranks])
    assert sorted(i for r in result.ranks for i in r["vae"]["tiles"]) == list(range(len(tile_set)))
    model = load_vae(inspect_vae(files["wan2.1"]), "fp32", torch.device("cpu"))
    checked = (1, 4)   # a whole tile on rank 1 and an edge tile on rank 0
    with torch.inference_mode():
        alone = [model.decode(tile_set[i]) for i in checked]
        ref = [model.double().decode(tile_set[i].double()) for i in checked]
    for i, a, b, r in zip(checked, [spread[i] for i in checked], alone, ref):
        print(f"tile {i}: vs this process max abs {float((a - b).abs().max()):.2e}; vs float64 {rel(a, r):.2e} "
              f"(bound {4 * rel(b, r):.2e})")
        assert a.shape == b.shape and rel(a, r) <= 4 * rel(b, r)


def test_a_tile_of_other_channels_is_refused_before_any_rank_starts_naming_the_tile(files, tile_set):
    class NoRanks:
        world, device = 2, "cpu"

        def submit(self, *a, **k):
            raise AssertionError("a job was sent to the ranks")
    with pytest.raises(ValueError) as e:
        tiles.run(NoRanks(), "decode", files["wan2.1"], tile_set[:2] + [torch.zeros(1, 4, 1, 2, 2)])
    assert str(e.value).startswith("tile 2 of 3: latent: shape [1, 4, 1, 2, 2] has 4 channels")


def blend(samples, network, tile, overlap, scale):
    """A 2-D tiler in the manner of ComfyUI's tiled_scale_multidim (a test oracle only): tiles along H and W,
    feathered masks, sums divided by the masks' sums."""
    b, _, t, h, w = samples.shape
    out, div = None, torch.zeros(1, 1, 1, h * scale, w * scale)
    for y in range(0, max(1, h - overlap), tile - overlap):
        for x in range(0, max(1, w - overlap), tile - overlap):
            y0, x0 = max(0, min(h - overlap, y)), max(0, min(w - overlap, x))
            piece = network(samples[:, :, :, y0:y0 + tile, x0:x0 + tile])
            if out is None:
                out = torch.zeros(b, piece.shape[1], piece.shape[2], h * scale, w * scale)
            mask = torch.ones(1, 1, 1, *piece.shape[-2:])
            for i in range(overlap * scale):
                mask[..., i, :] *= (i + 1) / (overlap * scale)
                mask[..., -1 - i, :] *= (i + 1) / (overlap * scale)
                mask[..., :, i] *= (i + 1) / (overlap * scale)
                mask[..., :, -1 - i] *= (i + 1) / (overlap * scale)
            out[..., y0 * scale:y0 * scale + piece.shape[-2], x0 * scale:x0 * scale + piece.shape[-1]] += piece * mask
            div[..., y0 * scale:y0 * scale + piece.shape[-2], x0 * scale:x0 * scale + piece.shape[-1]] += mask
    return out / div


def test_the_tile_pool_gives_the_tilers_own_result_with_every_tile_computed_on_the_ranks_in_one_job(engines, files):
    load_pack()
    vae = importlib.import_module(PACK_NAME + ".xdit_nodes.vae")
    core = importlib.import_module(PACK_NAME + ".xdit_nodes.core")
    info = inspect_vae(files["wan2.1"])
    link = vae.EngineVAELink(core.EngineSettings(model_path="", gpus=(0, 1), device="cpu"), info, "fp32", "split")
    jobs = []

    def run_all(pieces):
        jobs.append(len(pieces))
        return tiles.run(engines(2), "decode", files["wan2.1"], pieces)[0]
    z = latent((1, 16, 2, 6, 8), seed=3)
    model = load_vae(info, "fp32", torch.device("cpu"))
    pool = vae.TilePool("decode", link, run_all, single=lambda t: client.decode(engines(2), files["wan2.1"], t))
    pooled = pool(lambda network: blend(z, network, 4, 2, 8))
    # the tiler as ComfyUI runs it, each tile decoded when it asks for it (one job a tile, on the same ranks)
    stock = blend(z, lambda t: tiles.run(engines(2), "decode", files["wan2.1"], [t])[0][0], 4, 2, 8)
    print(f"{len(pool.tiles)} tiles in {jobs} job(s)")
    assert jobs == [len(pool.tiles)] and len(pool.tiles) == 6
    assert torch.equal(pooled, stock)
    with torch.inference_mode():
        own = blend(z, model.decode, 4, 2, 8)
    assert float((pooled - own).abs().max() / own.abs().max()) < 1e-5


# ---- the count the planner prices from ---------------------------------------------------------------------------
def test_a_long_clips_count_extrapolated_from_two_short_ones_equals_its_own_count(files):
    info = inspect_vae(files["wan2.1"])
    long = cost.count(info.kind, info.widths, (1, 16, 9, 2, 3))
    whole = cost._run_once(info.kind, tuple(sorted(info.widths.items())), (1, 16, 9, 2, 3), "decode", "bf16")
    assert long.flops == pytest.approx(whole.flops, rel=1e-12) and long.halo_bytes == whole.halo_bytes
    assert long.exchanges == whole.exchanges and long.out_bytes == whole.out_bytes
    assert abs(long.peak_bytes - whole.peak_bytes) <= 0.05 * whole.peak_bytes


@pytest.mark.parametrize("name", ["wan2.1", "wan2.2"])
def test_the_counted_halo_and_gathers_are_what_a_split_of_two_sends(engines, files, name):
    info = inspect_vae(files[name])
    z = latent((1, info.latent_channels, 3, 6, 5), seed=4)
    _, result = client.run(engines(2), "decode", files[name], z)
    c = cost.count(info.kind, info.widths, tuple(z.shape), "decode", "fp32")
    sent = [r["vae"]["sent"] for r in result.ranks]
    print(f"{name}: counted halo {c.halo_bytes} B, gathers {c.gather_bytes} B; ranks sent {sent}")
    assert sent[0]["halo"] == sent[1]["halo"] == c.halo_bytes   # a decode's convs reach one row each way
    assert sent[0]["gather"] + sent[1]["gather"] == c.gather_bytes   # each rank's K and V to the other


def test_the_fitted_conv_share_is_what_its_published_row_gives():
    from engine.published import vae as published
    assert published.fitted_conv_share() == pytest.approx(cost.CONV_SHARE, rel=2e-3)
    assert published.h3_tiles(1344, 768, 107) == 588   # LightX2V's 768x1344x362: 28 tiles x 21 clips


def test_a_decode_is_priced_as_a_row_split_its_compute_divided_and_its_halo_added():
    from engine.parallel.devices import stated_hardware
    c = cost.count(kind("wan2.1"), {}, (1, 16, 21, 90, 160))
    hw = stated_hardware(4, "H100 SXM", "nvlink")
    one, four = cost.price(c, 1, hw), cost.price(c, 4, hw)
    print(one.describe(), four.describe(), sep="\n")
    assert four.compute_s == pytest.approx(one.compute_s * 23 / 90)   # the largest band: 23 of 90 latent rows
    assert one.halo_s == 0 and four.halo_s == pytest.approx(c.halo_bytes / (hw.link.bandwidth_gbs * 1e9))
    assert four.activations_gib < one.activations_gib / 3 and four.weights_gib == one.weights_gib


# ---- a rank lost or out of memory --------------------------------------------------------------------------------
def test_a_rank_killed_during_a_decode_is_named_in_one_line_and_the_next_decode_runs(fresh_engine, files):
    victim = fresh_engine.pids[1]
    z = latent((1, 16, 9, 6, 6), seed=5)

    def kill_at(step, total):
        if step == 2:
            os.kill(victim, signal.SIGKILL)
    with pytest.raises(EngineError) as e:
        client.decode(fresh_engine, files["wan2.1"], z, on_progress=kill_at)
    first = str(e.value).splitlines()[0]   # the engine's line; the rank's log follows it
    print(first)
    assert "rank 1 died during phase compute at step 2 (killed by SIGKILL)" in first
    again = client.decode(fresh_engine, files["wan2.1"], z)
    assert again.shape == (1, 3, 33, 48, 48) and victim not in fresh_engine.pids


def test_a_rank_out_of_memory_before_a_decode_stops_every_rank_says_what_would_fit_and_keeps_the_group(tmp_path,
                                                                                                         files):
    fault = Fault(rank=1, point="load", action="oom", marker=str(tmp_path / "fired"))
    z = latent((1, 16, 3, 6, 6), seed=6)
    with Engine(2, device="cpu", deadlines=FAST, env=fault.env()) as e:
        pids = e.pids
        with pytest.raises(EngineError) as info:
            client.decode(e, files["wan2.1"], z)
        message = str(info.value)
        print(message)
        assert info.value.oom and "rank 1 (cpu) ran out of memory in phase load" in message and "\n" not in message
        assert "the decode needs about" in message and "a rank on 2 rank(s)" in message
        assert e.pids == pids and not e.restarts   # the ranks agreed before any work: the group stays
        _, again = client.run(e, "decode", files["wan2.1"], z)
        assert [r["vae_source"] for r in again.ranks] == ["resident", "file"]


# ---- the plan ----------------------------------------------------------------------------------------------------
def test_plan_prices_the_decode_on_the_plans_gpus_and_the_whole_clip(capsys):
    from engine.cli import main
    assert main(["plan", "--model", "wan2.1-1.3b", "--gpus", "4", "--interconnect", "nvlink", "--width", "832",
                 "--height", "480", "--frames", "81", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    decode = data["decode"]
    print(decode)
    assert decode["vae"].startswith("Wan 2.1") and decode["on_plan"]["ranks"] == data["chosen"]["gpus"] == 4
    assert decode["on_plan"]["seconds"] < decode["one_gpu"]["seconds"] / 3
    assert decode["whole_s"] == pytest.approx(decode["denoise_s"] + decode["on_plan"]["seconds"])
    assert decode["denoise_s"] == pytest.approx(data["chosen"]["s_per_image"], abs=1e-4)   # (rounded there)
    assert decode["fits"] == "beside"
    assert main(["plan", "--model", "flux-dev", "--gpus", "2", "--interconnect", "nvlink"]) == 0
    out = capsys.readouterr().out   # an image VAE the engine splits: priced the same way, its image whole
    assert "decode (FLUX.1 / SD3 VAE, as the xDiT VAE Loader runs it): est. " in out and "whole image" in out


def test_plan_validate_prints_the_decode_rows_with_their_residuals(capsys):
    from engine.cli import main
    from engine.published import vae as published
    assert main(["plan", "--validate"]) == 0
    out = capsys.readouterr().out
    for r in published.rows():
        assert f"| {r.what} | {r.gpus} | {r.published_s:g} s | {r.predicted_s:.3g} s | {r.residual:+.0%} |" in out
    scaling = [r for r in published.rows() if r.gpus > 1 and r.key.startswith("h3-vllm")]
    assert all(abs(r.residual) <= 0.10 for r in scaling)   # the tile pool's scaling, on the run that states its tiles


def test_the_info_node_shows_the_last_vae_job_its_split_and_time(files):
    load_pack()
    vae = importlib.import_module(PACK_NAME + ".xdit_nodes.vae")
    core = importlib.import_module(PACK_NAME + ".xdit_nodes.core")
    registry = core.EngineRegistry()
    settings = core.EngineSettings(model_path=files["checkpoint"], gpus=(0, 1), device="cpu")
    link = vae.EngineVAELink(settings, inspect_vae(files["checkpoint"], "vae."), "fp32", "split", registry=registry)
    try:
        link.run("decode", latent((1, 16, 3, 5, 6)))
        line = next(x for x in core.describe(settings, registry).splitlines() if x.startswith("vae: "))
        print(line)
        assert line.startswith("vae: last decode of tiny-wan-all-in-one.safetensors (vae. tensors) (Wan 2.1")
        assert "on 2 rank(s), latent rows [3, 2] a rank, 2 chunk(s): " in line and line.endswith(" s")
        link.run_tiles("decode", [latent((1, 16, 1, 2, 3)), latent((1, 16, 1, 3, 3))])
        line = next(x for x in core.describe(settings, registry).splitlines() if x.startswith("vae: "))
        assert "2 tiles over 2 rank(s) ([1, 1] a rank, each tile whole on one rank)" in line
    finally:
        registry.unload()
