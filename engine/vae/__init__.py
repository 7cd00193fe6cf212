"""VAE decode and encode across the engine's ranks, each rank a band of rows of every frame, equal to ComfyUI's own
decode of the same file (docs/vae.md): `layers.py` the row-split layers, `wan.py` / `wan22.py` the Wan VAEs,
`load.py` the files (detection, widths, weights, tiny files), `job.py` the ranks' jobs, `client.py` the caller's API,
`tiles.py` the tile pool (whole tiles spread over the ranks), `cost.py` the decode's count and price, `room.py` memory
on the ranks' GPUs and what would fit."""
