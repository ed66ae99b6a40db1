"""Absolute position tables of the HF encoders: SigLIP's and Qwen3-VL's learned grids,
Whisper's sinusoids.

A SigLIP checkpoint learned one table of G x G positions for square images of G x G patches;
native-resolution images of h x w patches read it resized to h x w, bicubically, as
`torch.nn.functional.interpolate(mode="bicubic", align_corners=False)` resizes it (what HF's
`interpolate_pos_encoding` does); Qwen3-VL's tower reads its table resized bilinearly with
align_corners=True (`model.vision.position_resize`). Each packed patch finds its image's grid
from the positions of its segment, so the batch contract needs nothing new, and the resize is
one matrix product of interpolation weights with the table: it trains like any parameter.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

CUBIC_A = -0.75  # torch's bicubic kernel coefficient (PIL and jax.image use -0.5)


def cubic_weights(t: jax.Array) -> jax.Array:
    """Weights of the 4 taps at offsets -1, 0, 1, 2 for a fractional position t in [0, 1)."""
    a = CUBIC_A
    near = lambda x: ((a + 2) * x - (a + 3)) * x * x + 1  # |x| <= 1
    far = lambda x: ((a * x - 5 * a) * x + 8 * a) * x - 4 * a  # 1 < |x| < 2
    return jnp.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], axis=-1)


def resize_weights(index: jax.Array, size: jax.Array, grid: int) -> jax.Array:
    """Interpolation weights [..., grid] of output `index` of `size` outputs from `grid` inputs.

    torch's source coordinate for align_corners=False: (index + 0.5) * grid / size - 0.5, not
    clamped for cubic; taps outside [0, grid) read the border (they are clamped).
    """
    scale = grid / jnp.maximum(size, 1).astype(jnp.float32)
    src = (index.astype(jnp.float32) + 0.5) * scale - 0.5
    base = jnp.floor(src)
    weights = cubic_weights(src - base)  # [..., 4]
    taps = jnp.clip(base.astype(jnp.int32)[..., None] + jnp.arange(-1, 3), 0, grid - 1)
    one_hot = jax.nn.one_hot(taps, grid, dtype=jnp.float32)  # [..., 4, grid]
    return (weights[..., None] * one_hot).sum(-2)  # (a sum of 4 rows, no matmul)


def bilinear_weights(index: jax.Array, size: jax.Array, grid: int) -> jax.Array:
    """Linear interpolation weights [..., grid] of output `index` of `size` outputs from `grid`
    inputs with align_corners=True: the source coordinate index x (grid - 1) / (size - 1) (0
    for a size of 1), its two neighbours weighted by their distance, clamped to the table."""
    src = index.astype(jnp.float32) * (grid - 1) / jnp.maximum(size - 1, 1).astype(jnp.float32)
    base = jnp.floor(src)
    frac = src - base
    weights = jnp.stack([1 - frac, frac], axis=-1)  # [..., 2]
    taps = jnp.clip(base.astype(jnp.int32)[..., None] + jnp.arange(2), 0, grid - 1)
    one_hot = jax.nn.one_hot(taps, grid, dtype=jnp.float32)  # [..., 2, grid]
    return (weights[..., None] * one_hot).sum(-2)


RESIZE = {"bicubic": resize_weights, "bilinear": bilinear_weights}  # config.model.RESIZES


def image_grids(segment_ids_bp: jax.Array, positions_bp2: jax.Array) -> jax.Array:
    """Each patch's image grid (rows, cols) [B, P, 2]: one more than its segment's largest
    row and column (every image's patches cover its whole grid)."""

    def one_row(seg_p, pos_p2):
        n = seg_p.shape[0] + 1
        top = jax.vmap(lambda c: jax.ops.segment_max(c, seg_p, n), in_axes=1, out_axes=1)(pos_p2)
        return top[seg_p] + 1

    return jax.vmap(one_row)(segment_ids_bp, positions_bp2)


def resized_table(
    table_gd: jax.Array,
    segment_ids_bp: jax.Array,
    positions_bp2: jax.Array,
    mode: str = "bicubic",
    dtype: jnp.dtype = jnp.float32,
) -> jax.Array:
    """The learned G*G-row table resized to each patch's image grid, read at its (row, col).

    Args:
      table_gd: [G * G, width] position table, row-major over a G x G grid.
      segment_ids_bp: image of each patch, 0 for padding [B, P].
      positions_bp2: (row, col) of each patch in its image [B, P, 2].
      mode: bicubic (align_corners false) | bilinear (align_corners true): `RESIZE`.
      dtype: the matmul's (the compute dtype: under bf16 compute a bf16 x bf16 dot, its
        backward's too; no fp32 x fp32 dot in the step).

    Returns:
      [B, P, width] position embeddings in `dtype` (padding patches get some row; unused).
    """
    grid = math.isqrt(table_gd.shape[0])
    sizes = image_grids(segment_ids_bp, positions_bp2)
    weights = RESIZE[mode]
    w_rows = weights(positions_bp2[..., 0], sizes[..., 0], grid)  # [B, P, G]
    w_cols = weights(positions_bp2[..., 1], sizes[..., 1], grid)
    w_bpgg = w_rows[..., :, None] * w_cols[..., None, :]
    w_bpn = w_bpgg.reshape(*w_bpgg.shape[:-2], grid * grid)
    return jnp.einsum(
        "bpn,nd->bpd", w_bpn.astype(dtype), table_gd.astype(dtype), preferred_element_type=dtype
    )


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> np.ndarray:
    """Whisper's fixed position table [length, channels]: sines then cosines of geometric
    timescales (the init of its `embed_positions`; checkpoints store the table itself)."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = np.exp(-increment * np.arange(channels // 2, dtype=np.float32))
    scaled = np.arange(length, dtype=np.float32)[:, None] * inv_timescales[None, :]
    return np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1).astype(np.float32)
