"""MiniMax-H3's tiles, by definition (ComfyUI 0.33's comfy/ldm/minimax/vae.py): the (clip, tile) pieces a decode
or an encode is made of, laid out from the input's shape alone (`plan`: the ranks and the caller agree on it without
talking), and ComfyUI's blending of the raw pieces in ComfyUI's order, in their dtype (`assemble`, a port of
vae.py:448-540 and 544-669), finished as ComfyUI finishes (the decode's pixels mapped to [0, 1] in float32,
vae.py:398-401; the encode's means normalized, vae.py:685-689). minimax.py computes the pieces."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
RATIO, RATIO_T = 16, 4                    # space_down (2, 2, 2, 2, 1, 1), time_down (1, 2, 2, 1, 1, 1)
SPACE_DOWN, TIME_DOWN, CH_MULT = (2, 2, 2, 2, 1, 1), (1, 2, 2, 1, 1, 1), (1, 2, 2, 4, 4, 8)
CLIP, TOKEN_DROP = 17, 3                  # clip_length, token_drop (vae.py:336-337)
PRE_PAD = (-CLIP) % RATIO_T               # 3 frames: frame_pre_padding
CHUNK = math.ceil(CLIP / RATIO_T)         # 5 tokens: tokens_chunk_size
OVERLAP = (-TOKEN_DROP) % CHUNK           # 2 tokens: token_overlap
FRAME_OVERLAP = max(OVERLAP * RATIO_T - PRE_PAD, 0)   # 5 frames
TILE, TILE_OVERLAP = 256, 64


# ---- the pieces ---------------------------------------------------------------------------------------------------
def split_tiles(size: int) -> tuple[list[int], list[int], list[int]]:
    """ComfyUI's split_tiles (vae.py:424-446): starts, lengths and overlaps of 256 px tiles covering `size` pixels with
    overlaps of 64 px at least, the spare spread in 16 px steps."""
    if TILE >= size:
        return [0], [size], []
    n = math.ceil(size / TILE)
    while TILE * n - TILE_OVERLAP * (n - 1) - size < 0:
        n += 1
    overlaps = [TILE_OVERLAP] * (n - 1)
    for i in range((TILE * n - sum(overlaps) - size) // RATIO):
        overlaps[i % (n - 1)] += RATIO
    starts = [0]
    for i in range(n - 1):
        starts.append(starts[-1] + TILE - overlaps[i])
    return starts, [TILE] * n, overlaps


def decode_chunks(tokens: int) -> tuple[int, int]:
    """(pad tokens, clips) of a latent of `tokens` frames (_decode_temporal_chunks, vae.py:597-607)."""
    total = tokens + TOKEN_DROP
    pad = (-total) % CHUNK
    clips = (total + pad) // CHUNK - int(TOKEN_DROP > 0)
    if clips < 1:
        pad, clips = pad + CHUNK, clips + 1
    return pad, clips


def decoded_frames(tokens: int) -> int:
    """The decode's frame count (decode_output_shape with _decode_temporal_frame_plan, vae.py:403-410, 559-595)."""
    if tokens == 1:
        return 1
    pad, clips = decode_chunks(tokens)
    z_len, total, last_overlap = tokens + pad, 0, 0
    for i in range(clips):
        clip_frames = max(0, min(i * CHUNK + CHUNK + OVERLAP, z_len) - min(i * CHUNK, z_len)) * RATIO_T
        for j in range(int(TOKEN_DROP > 0) + 1):
            frames = max(0, min(j * CHUNK * RATIO_T + CHUNK * RATIO_T, clip_frames) - j * CHUNK * RATIO_T - PRE_PAD)
            total, last_overlap = (total + frames, last_overlap) if j == 0 else (total, frames)
    tail = CLIP % RATIO_T
    padded = sum(tail if tail and (tokens + k) % CHUNK == 0 else RATIO_T for k in range(pad)) if tail else pad * RATIO_T
    return total + last_overlap - padded


def encoded_frames(frames: int) -> int:
    """Latent frames of an encode (vae.py:544-557, 679-681): one for an image, else 5 a 17-frame clip less 3."""
    return 1 if frames == 1 else math.ceil(frames / CLIP) * CHUNK - TOKEN_DROP


@dataclass(frozen=True)
class Piece:
    """One (clip, tile): its clip and tile indices, the input's frame range (of the latent padded by its last token,
    or of the clip padded by its last frame) and rows and columns, and the raw output's shape."""
    clip: int
    row: int
    col: int
    frames: tuple[int, int]
    rows: tuple[int, int]
    cols: tuple[int, int]
    out_shape: tuple[int, ...]

    @property
    def cost(self) -> int:
        return math.prod(self.out_shape)


@dataclass(frozen=True)
class Plan:
    op: str
    shape: tuple[int, ...]
    clips: int
    tiles: tuple        # (split_tiles of the height, of the width), in pixels
    pieces: tuple


def plan(op: str, shape: tuple) -> Plan:
    """The pieces of a decode of latent `shape` [B, 24, T, H, W] or an encode of pixels [B, 3, T, H, W], clip by clip,
    tiles in ComfyUI's raster order (vae.py:514-521, 478-484)."""
    b, _, t, h, w = shape
    if op == "decode":   # clips of 5 + 2 tokens every 5, of 17 frames every 17
        clips, pixels, step, length = (1 if t == 1 else decode_chunks(t)[1]), (h * RATIO, w * RATIO), CHUNK, \
            CHUNK + OVERLAP
    else:
        clips, pixels, step, length = (1 if t == 1 else math.ceil(t / CLIP)), (h, w), CLIP, CLIP
    tiles = (split_tiles(pixels[0]), split_tiles(pixels[1]))
    pieces = []
    for i in range(clips):
        f0, f1 = (0, 1) if t == 1 else (i * step, i * step + length)
        for r, (y, ly) in enumerate(zip(*tiles[0][:2])):
            for c, (x, lx) in enumerate(zip(*tiles[1][:2])):
                if op == "decode":
                    rows, cols = (y // RATIO, (y + ly) // RATIO), (x // RATIO, (x + lx) // RATIO)
                    out = (b, 3, (f1 - f0) * RATIO_T, ly, lx)
                else:
                    rows, cols = (y, y + ly), (x, x + lx)
                    out = (b, 48, 1 if t == 1 else CHUNK, -(-ly // RATIO), -(-lx // RATIO))
                pieces.append(Piece(i, r, c, (f0, f1), rows, cols, out))
    return Plan(op, tuple(shape), clips, tiles, tuple(pieces))


# ---- ComfyUI's blending, on the raw pieces (run in the caller's process) -------------------------------------------
def blend(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    """ComfyUI's blend (vae.py:448-471): a's tail faded linearly into b's head over `extent`, in b's dtype."""
    extent = min(a.shape[dim], b.shape[dim], extent)
    positions = torch.arange(extent, device=b.device, dtype=b.dtype)
    shape = [1] * a.ndim
    shape[dim] = extent
    weight_a, weight_b = (1 - positions / extent).view(shape), (positions / extent).view(shape)
    tail, head = [slice(None)] * a.ndim, [slice(None)] * b.ndim
    tail[dim], head[dim] = slice(-extent, None), slice(0, extent)
    blended = a[tuple(tail)] * weight_a + b[tuple(head)] * weight_b
    if extent < b.shape[dim]:
        rest = [slice(None)] * b.ndim
        rest[dim] = slice(extent, None)
        return torch.cat([blended, b[tuple(rest)]], dim=dim)
    return blended


def _canvas(pl: Plan, tiles: list) -> torch.Tensor:
    """One clip's tiled_decode (vae.py:505-540) on its raw tiles (raster order): each tile blended with the raw tails
    of the tile above and to the left, cut, written into the canvas."""
    (y_idx, _, y_overlap), (x_idx, _, x_overlap) = pl.tiles
    height, width = pl.shape[3] * RATIO, pl.shape[4] * RATIO
    canvas, row_tails, out_y = None, [], 0
    for i in range(len(y_idx)):
        new_tails, left_tail, out_x = [], None, 0
        for j in range(len(x_idx)):
            tile = tiles[i * len(x_idx) + j]
            if i < len(y_idx) - 1:
                new_tails.append(tile[..., -y_overlap[i]:, :].clone())
            next_left = tile[..., :, -x_overlap[j]:].clone() if j < len(x_idx) - 1 else None
            if i > 0:
                tile = blend(row_tails[j], tile, y_overlap[i - 1], dim=-2)
            if j > 0:
                tile = blend(left_tail, tile, x_overlap[j - 1], dim=-1)
            left_tail = next_left
            if i < len(y_idx) - 1:
                tile = tile[..., :-y_overlap[i], :]
            if j < len(x_idx) - 1:
                tile = tile[..., :, :-x_overlap[j]]
            if canvas is None:
                canvas = torch.empty(*tile.shape[:-2], height, width, dtype=tile.dtype, device=tile.device)
            canvas[..., out_y:out_y + tile.shape[-2], out_x:out_x + tile.shape[-1]].copy_(tile)
            out_x += tile.shape[-1]
        row_tails = new_tails
        out_y += tile.shape[-2]
    return canvas


def _stitch(pl: Plan, tiles: list) -> torch.Tensor:
    """One clip's tiled_encode blending (vae.py:486-503) of its raw latent tiles (raster order)."""
    (y_idx, _, y_overlap), (x_idx, _, x_overlap) = pl.tiles
    rows = [tiles[i * len(x_idx):(i + 1) * len(x_idx)] for i in range(len(y_idx))]
    ly, lx = [o // RATIO for o in y_overlap], [o // RATIO for o in x_overlap]
    out = []
    for i, row in enumerate(rows):
        cut = []
        for j, tile in enumerate(row):
            if i > 0:
                tile = blend(rows[i - 1][j], tile, ly[i - 1], dim=-2)
            if j > 0:
                tile = blend(row[j - 1], tile, lx[j - 1], dim=-1)
            if i < len(rows) - 1:
                tile = tile[..., :-ly[i], :]
            if j < len(row) - 1:
                tile = tile[..., :, :-lx[j]]
            cut.append(tile)
        out.append(torch.cat(cut, dim=-1))
    return torch.cat(out, dim=-2)


def finalize(part: torch.Tensor) -> torch.Tensor:
    """_finalize_pixels (vae.py:398-401): the raw output to float32 pixels in [0, 1], ImageNet's mean and std as the
    VAE holds them (in its dtype)."""
    mean, std = (torch.tensor(v).view(1, 3, 1, 1, 1).to(part.dtype).to(part.device, torch.float32)
                 for v in (IMAGENET_MEAN, IMAGENET_STD))
    return (part * std).add_(mean).clamp_(0.0, 1.0)


def assemble(pl: Plan, pieces: list, stats: tuple | None = None, raw: bool = False) -> torch.Tensor:
    """The whole result from the raw pieces (plan order), blended in ComfyUI's order in their dtype: a decode's float32
    frames in [0, 1], an encode's normalized latent means (stats: the VAE's latents_mean and latents_std in its
    dtype); raw: the blended decoder output, or the moments, before that."""
    per_clip = len(pl.pieces) // pl.clips
    clips = [pieces[i * per_clip:(i + 1) * per_clip] for i in range(pl.clips)]
    done = (lambda part: part) if raw else finalize
    if pl.op == "encode":
        moments = torch.cat([_stitch(pl, c) for c in clips], dim=2)
        moments = moments[:, :, -1:] if pl.shape[2] == 1 else moments[:, :, :-TOKEN_DROP]
        if raw:
            return moments
        mean = torch.chunk(moments.float(), 2, dim=1)[0]
        return (mean - stats[0].view(1, -1, 1, 1, 1).to(mean)) / stats[1].view(1, -1, 1, 1, 1).to(mean)
    if pl.shape[2] == 1:
        return done(_canvas(pl, clips[0])[:, :, -1:])
    out, at, overlap = None, 0, None
    for i, clip in enumerate(clips):   # decode_temporal (vae.py:609-669)
        dec = _canvas(pl, clip)
        if out is None:
            out = torch.empty(dec.shape[:2] + (decoded_frames(pl.shape[2]),) + dec.shape[3:],
                              dtype=dec.dtype if raw else torch.float32)
        parts = []
        for j in range(int(TOKEN_DROP > 0) + 1):
            chunk = dec[:, :, j * CHUNK * RATIO_T:min(j * CHUNK * RATIO_T + CHUNK * RATIO_T, dec.shape[2])]
            chunk = chunk[:, :, PRE_PAD:]
            if j == 0:
                if overlap is not None:
                    chunk, overlap = blend(overlap, chunk, FRAME_OVERLAP, dim=-3), None
                parts.append(chunk)
            else:
                overlap = chunk.contiguous()
        if i == len(clips) - 1 and overlap is not None:
            parts.append(overlap)
        for part in parts:
            n = min(part.shape[2], max(0, out.shape[2] - at))
            if n > 0:
                out[:, :, at:at + n].copy_(done(part[:, :, :n]) if not raw else part[:, :, :n])
                at += n
    return out
