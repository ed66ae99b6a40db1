"""A packed vision row as a tower's blocks see it: class-token rows after the patches (CLIP)
and patches in window order (Qwen2.5-VL), with the packings that go with them.

- Class tokens: one row per image of the row, after the row's patches, in the image's document
  (its segment id), so it attends with the image's patches and they with it in every block. A
  static number of rows holds them (`class_slots`); block-sparse attention gets the tiles
  between every block of patches and the class rows' blocks beside the planner's own.
- Windows: the blocks outside a tower's full-attention blocks attend within windows of
  `window` x `window` patches of each image. Each image's patches are put in window order (the
  windows of its grid row by row, each window's patches in their order), so a window is a run
  of the row: a document of its own (`window_order`), which block-sparse attention reads with
  a band of tiles along the diagonal (`band_tiles`); the image keeps its span, so the whole
  image's tiles are the planner's. Attention does not depend on the order within a window, so
  the outputs are Qwen2.5-VL's once put back (`Rows.finish`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxmllm.models.attention import Packing
from jaxmllm.models.positions import image_grids


@dataclasses.dataclass(frozen=True)
class Rows:
    """What a tower's blocks take, and how to read their output back as the row's patches."""

    x: jax.Array  # [B, T, width]: the patches (in window order) and class rows
    pack: Packing  # whole images (and their class rows)
    positions: jax.Array  # [B, T, 2]
    local: Packing | None  # windows, for the blocks outside the full-attention ones
    order: jax.Array | None  # [B, P]: the patch each window-order row holds
    patches: int  # P: the row's patches (the class rows follow)

    def finish(self, x_btd: jax.Array) -> jax.Array:
        """The blocks' output as the row's patches, in their order [B, P, width]."""
        x_btd = x_btd[:, : self.patches]
        if self.order is None:
            return x_btd
        back = jnp.argsort(self.order, axis=-1)
        return jnp.take_along_axis(x_btd, back[..., None], axis=1)


def class_slots(patches: int, documents: int, merge: int, block: int) -> int:
    """Rows for the class tokens of a row of `patches`: `documents` (batch.vision_documents,
    resolved from the data), else the most images a row can hold (one merge block each);
    rounded up to whole blocks for block-sparse attention (`block` > 0)."""
    n = documents if documents > 0 else max(patches // merge**2, 1)
    return -(-n // block) * block if block else n


def row_documents(segment_ids_bp: jax.Array, slots: int) -> jax.Array:
    """The segment id of each of a row's first `slots` documents (runs of one non-zero id), in
    order, 0 past its last [B, slots]."""

    def one(seg_p):
        prev = jnp.concatenate([jnp.zeros(1, seg_p.dtype), seg_p[:-1]])
        starts = (seg_p != prev) & (seg_p > 0)
        rank = jnp.where(starts, jnp.cumsum(starts) - 1, slots)
        return jnp.zeros(slots, seg_p.dtype).at[rank].set(seg_p, mode="drop")

    return jax.vmap(one)(segment_ids_bp)


def class_tiles(tiles_bk2: jax.Array, patch_blocks: int, class_blocks: int) -> jax.Array:
    """The planner's tiles and those of the class rows: every patch block with every class
    block both ways, and the class blocks among themselves [B, K + extra, 2]."""
    p, c = np.arange(patch_blocks), patch_blocks + np.arange(class_blocks)
    pairs = [
        np.stack(np.meshgrid(a, b, indexing="ij"), -1).reshape(-1, 2)
        for a, b in ((p, c), (c, p), (c, c))
    ]
    extra = jnp.asarray(np.concatenate(pairs), tiles_bk2.dtype)
    extra = jnp.broadcast_to(extra, (tiles_bk2.shape[0], *extra.shape))
    return jnp.concatenate([tiles_bk2, extra], axis=1)


def window_order(
    segment_ids_bp: jax.Array, positions_bp2: jax.Array, window: int
) -> tuple[jax.Array, jax.Array]:
    """Window order of a packed row (see the module docstring).

    Returns:
      (order [B, P]: the row's index of each window-order row, window ids [B, P]: a distinct
      id per window in window order, 0 for padding).
    """
    cols = -(-image_grids(segment_ids_bp, positions_bp2)[..., 1] // window)  # windows a row

    def one(seg_p, pos_p2, cols_p):
        prev = jnp.concatenate([jnp.full(1, -1, seg_p.dtype), seg_p[:-1]])
        run = jnp.cumsum(seg_p != prev)  # each document's span (and each padding run)
        win = jnp.where(seg_p > 0, pos_p2[:, 0] // window * cols_p + pos_p2[:, 1] // window, 0)
        order = jnp.lexsort((jnp.arange(seg_p.shape[0]), win, run))
        run, win, seg = run[order], win[order], seg_p[order]
        new = jnp.concatenate([jnp.ones(1, bool), (run[1:] != run[:-1]) | (win[1:] != win[:-1])])
        return order, jnp.where(seg > 0, jnp.cumsum(new), 0)

    return jax.vmap(one)(segment_ids_bp, positions_bp2, cols)


def band_tiles(batch: int, length: int, block: int, window_patches: int) -> jax.Array:
    """Tiles of runs of at most `window_patches` rows anywhere in a row of `length`: every
    (query block, key block) within the blocks such a run can span [B, K, 2]."""
    blocks, reach = length // block, (window_patches + block - 2) // block
    q = np.repeat(np.arange(blocks), 2 * reach + 1)
    k = q + np.tile(np.arange(-reach, reach + 1), blocks)
    keep = (k >= 0) & (k < blocks)
    tiles = np.stack([q[keep], k[keep]], -1).astype(np.int32)
    return jnp.broadcast_to(jnp.asarray(tiles), (batch, *tiles.shape))
