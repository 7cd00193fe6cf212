"""VAE decode and encode across the engine's ranks, each rank a band of rows of every frame, equal to ComfyUI's own
decode of the same file (docs/vae.md): `layers.py` the row-split layers, `wan.py` / `wan22.py` the Wan VAEs, `flux.py`
the FLUX.1 / SD3 and FLUX.2 VAEs, `ltx.py` / `ltx_blocks.py` LTX-2.x's, `minimax.py` / `minimax_tiles.py` MiniMax-H3's
(tiled by definition: whole tiles a rank, `pool.py`), `load.py` the files (detection, widths, weights, tiny files),
`job.py` the ranks' jobs, `client.py` the caller's API, `tiles.py` the tile pool of ComfyUI's tiled nodes (whole tiles
spread over the ranks), `cost.py` the decode's count and price, `room.py` memory on the ranks' GPUs and what would
fit."""
