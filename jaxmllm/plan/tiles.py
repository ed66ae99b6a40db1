"""Attention tiles of packed documents: how many a bucket needs (planning) and which (the kernel).

A packed row of T tokens is cut into blocks of `block` tokens; a tile is a (query block, key
block) pair. A document needs the tiles of the blocks it spans: its causal triangle (a decoder)
or its whole square (an encoder: an image, a clip). Documents lie one after another in a row,
so two neighbours share only the block where one ends and the next begins, and only its
diagonal tile: a row's tiles are its documents' own tiles minus one per document that starts
inside a block (not at a block boundary) right after another one. A device's tiles are the sum
over its rows; with block-sparse attention that count, not the row length squared, is what the
device computes, so it is a capacity of the bucket like tokens and patches.

Tile lists are laid out per device over its rows flattened (block `r * blocks_per_row + b` of
row r), sorted by query block then key block, padded with (-1, -1) to the capacity.

A layer with a sliding window of w tokens (Gemma's local layers) needs fewer: a query block
reaches back `reach = ceil((w - 1) / block)` key blocks beyond its own (`window_reach`), so a
document's windowed tiles are a band of its causal triangle. The band does not depend on where
in its first block the document starts: every query block after the first starts at a block
boundary, and the first one holds the document's first tokens, which see only their own block.
The windowed tiles of a row are therefore within `reach + 1` of the diagonal, and a subset of
its causal tiles: a bucket needs at most the fewer of its causal tile capacity and that band
(`window_capacity`), so the windowed list needs no capacity of its own to plan.

A bidirectional span (an image's tokens in Gemma 3: they see each other both ways) adds, to
a causal document's tiles, the tiles above the diagonal among the blocks it touches
(`span_tiles`); a span of t tokens touches at most `span_blocks(t)` blocks, wherever it starts,
so it adds at most `span_extra(t)` tiles, which is what the planner counts for it. A window
never narrows them: a key after its query is never outside the window.
"""

from __future__ import annotations

import numpy as np

PAD = -1  # a padding tile: both blocks -1


class TileOverflow(ValueError):
    """A bucket needs more tiles than its capacity."""

    def __init__(self, bucket: int, need: int, capacity: int):
        super().__init__(f"{need} attention tiles, more than the capacity {capacity}")
        self.bucket, self.need, self.capacity = bucket, need, capacity


def blocks_spanned(offsets: np.ndarray, sizes: np.ndarray, block: int) -> np.ndarray:
    """Blocks each document (at `offsets`, of `sizes` > 0 units) covers."""
    return (offsets + sizes - 1) // block - offsets // block + 1


def window_reach(window: int, block: int) -> int | None:
    """Key blocks a query block reaches back beyond its own under a sliding window of `window`
    tokens (a query sees itself and the window - 1 tokens before it); None: no window."""
    return -(-(window - 1) // block) if window > 0 else None


def own_tiles(m: np.ndarray, causal: bool, reach: int | None = None) -> np.ndarray:
    """Tiles of a document spanning `m` blocks: its causal triangle or its square; with a
    sliding window (`reach`, `window_reach`: causal only), its first query block's diagonal
    tile and, for each later one, its own and up to `reach` key blocks before it."""
    if reach is None or not causal:
        return m * (m + 1) // 2 if causal else m * m
    near = np.minimum(m - 1, reach)  # (query blocks 1 .. near see every block before them)
    return m + near * (near + 1) // 2 + (m - 1 - near) * reach


def tiles_alone(rows, block: int, causal: bool):
    """The tiles a document of `rows` attention rows (an int or an array) needs alone,
    wherever in a block it starts: it may span one block more than its size in blocks."""
    return own_tiles((rows - 1) // block + 2, causal)


def span_blocks(tokens: np.ndarray, block: int) -> np.ndarray:
    """The most blocks a run of `tokens` tokens can touch, wherever it starts."""
    t = np.asarray(tokens, np.int64)
    return np.where(t <= 1, 1, (t - 2) // block + 2)


def span_extra(tokens: np.ndarray, block: int) -> np.ndarray:
    """The most tiles above the diagonal a bidirectional span of `tokens` adds to its
    document's causal ones: each pair of the blocks it touches, the later one's keys seen from
    the earlier one's queries."""
    s = span_blocks(tokens, block)
    return s * (s - 1) // 2


def window_tile_capacity(
    causal_capacity: int,
    rows: int,
    row_len: int,
    block: int,
    window: int,
    longest_span: int = 0,
    context: int = 1,
) -> int:
    """The windowed layers' tile capacity of a bucket of `rows` rows of `row_len` tokens whose
    causal list holds `causal_capacity` (`window_capacity`), under a sliding window of `window`
    tokens (0: none, 0) where bidirectional spans are at most `longest_span` tokens (0: none;
    the largest item an encoder bucket holds bounds it). With context groups (`context` > 1)
    the bucket is a rank's share of its group's rows: its query blocks lie anywhere in them,
    so the band bounds each at `reach` + 1 tiles (`rank_window_capacity`)."""
    if not window:
        return 0
    upper = int(span_blocks(np.int64(longest_span), block)) - 1 if longest_span else 0
    reach = window_reach(window, block)
    if context > 1:
        return rank_window_capacity(causal_capacity, rows * row_len // block, reach, upper)
    return window_capacity(causal_capacity, rows, row_len // block, reach, upper)


def rank_window_capacity(causal_capacity: int, blocks: int, reach: int, upper: int = 0) -> int:
    """The most windowed tiles a context group's rank of `blocks` query blocks can need: no
    more than its causal tiles (a rank's windowed tiles are some of its causal ones: the same
    blocks, dealt once) and no more than `reach` + 1 key blocks a query block, `upper` more
    where bidirectional spans touch up to `upper` + 1 blocks. (A rank's blocks are dealt from
    anywhere in its group's rows, so the first blocks of a row, which reach fewer, cannot be
    counted on: `window_capacity` is a whole row's.)"""
    return min(int(causal_capacity), blocks * (reach + 1 + upper))


def window_capacity(
    causal_capacity: int, rows: int, row_blocks: int, reach: int, upper: int = 0
) -> int:
    """The most windowed tiles a bucket of `rows` rows of `row_blocks` blocks can need: no more
    than its causal tiles (each document's windowed tiles are some of its causal ones, or of
    its spans', which the causal capacity counts too) and no more than the band of `reach` + 1
    tiles a query block (`own_tiles` of a whole row), widened by `upper` key blocks after it
    where bidirectional spans touch up to `upper` + 1 blocks (`span_blocks`)."""
    band = int(own_tiles(np.int64(row_blocks), True, reach)) + band_above(row_blocks, upper)
    return min(int(causal_capacity), rows * band)


def band_above(row_blocks: int, upper: int) -> int:
    """The tiles of a row of `row_blocks` blocks up to `upper` key blocks after their query
    block: the most that bidirectional spans touching up to `upper` + 1 blocks add to it."""
    return sum(row_blocks - d for d in range(1, min(upper, row_blocks - 1) + 1))


def item_tiles(
    offsets: np.ndarray,
    sizes: np.ndarray,
    block: int,
    causal: bool,
    prev_end: np.ndarray,
    reach: int | None = None,
) -> np.ndarray:
    """Tiles each document adds to its row at `offsets`: its own, minus the diagonal tile it
    shares with the document before it when it starts in the block that one ends in
    (`prev_end`: where the document before it ends, 0 for a row's first); `reach`: a sliding
    window's (`window_reach`)."""
    m = blocks_spanned(offsets, sizes, block)
    shared = (prev_end > 0) & (offsets // block == (prev_end - 1) // block)
    return own_tiles(m, causal, reach) - shared


def packed_tiles(
    offsets: np.ndarray, sizes: np.ndarray, block: int, causal: bool, reach: int | None = None
) -> np.ndarray:
    """`item_tiles` of documents each right after the one before it in its row (the one that
    ends at its offset; offset 0: a row's first), in fewer passes: a document shares a tile
    with the one before it when it starts inside a block."""
    first = offsets // block
    m = (offsets + sizes - 1) // block
    m -= first
    m += 1
    t = own_tiles(m, causal, reach)
    first *= block
    t -= first != offsets
    return t


def bin_tiles(
    bins: np.ndarray,
    offsets: np.ndarray,
    sizes: np.ndarray,
    nbins: int,
    block: int,
    causal: bool,
    reach: int | None = None,
) -> np.ndarray:
    """Tiles per bin (a row, or a device's encoder row) of documents placed at (bin, offset):
    any order, empty documents ignored; `reach`: a sliding window's (`window_reach`)."""
    keep = sizes > 0
    bins, offsets, sizes = bins[keep], offsets[keep], sizes[keep]
    order = np.lexsort((offsets, bins))
    b, o, s = bins[order], offsets[order], sizes[order]
    prev_end = np.zeros(len(b), np.int64)
    prev_end[1:] = np.where(b[1:] == b[:-1], (o + s)[:-1], 0)
    tiles = item_tiles(o, s, block, causal, prev_end, reach)
    return np.bincount(b, tiles, nbins).astype(np.int64)


def expected_tiles(
    sizes: np.ndarray, block: int, causal: bool, reach: int | None = None
) -> np.ndarray:
    """Tiles an item of `sizes` units adds on average over where in a block it starts (uniform),
    right after another one: what a planner equalises before it knows the offsets (float64)."""
    n = np.maximum(np.asarray(sizes, np.int64), 1)
    q, r = np.divmod(n - 1, block)  # it spans q + 1 blocks from a boundary, q + 2 from later
    near = own_tiles(q + 1, causal, reach).astype(np.float64)
    far = own_tiles(q + 2, causal, reach).astype(np.float64)
    shared = (block - 1) / block
    return ((block - r) * near + r * far) / block - shared


def packed_density(
    sizes: np.ndarray,
    row_len: int,
    block: int,
    causal: bool,
    most: int = 20000,
    seed: int = 0,
    reach: int | None = None,
) -> float:
    """Tiles per unit of documents of `sizes` laid one after another into rows of `row_len`
    units, as a packer lays them (up to `most` of them, in random order; a document that does
    not fit what is left of a row starts the next). Unlike `expected_tiles` this sees sizes
    that are multiples of the block staying aligned, and row boundaries (0.0 for no data)."""
    n = np.asarray(sizes, np.int64)
    n = n[n > 0]
    if not len(n) or not row_len:
        return 0.0
    n = np.minimum(np.random.default_rng(seed).permutation(n)[:most], row_len)
    rows, offsets, row, used = np.empty(len(n), np.int64), np.empty(len(n), np.int64), 0, 0
    for i, size in enumerate(n.tolist()):
        if used + size > row_len:
            row, used = row + 1, 0
        rows[i], offsets[i] = row, used
        used += size
    tiles = bin_tiles(rows, offsets, n, row + 1, block, causal, reach)
    return float(tiles.sum() / n.sum())


def tile_list(
    offsets: np.ndarray,
    sizes: np.ndarray,
    rows: np.ndarray,
    row_blocks: int,
    block: int,
    causal: bool,
    reach: int | None = None,
) -> np.ndarray:
    """The (query block, key block) tiles [K, 2] of one device's documents (row `rows`, at
    `offsets` within it, of `sizes`), blocks numbered over the device's rows flattened, sorted
    by query block then key block (documents come in order and each one's tiles in that order
    already), each tile once; with a sliding window (`reach`, causal), a query block's key
    blocks from `reach` before it on (`own_tiles`)."""
    keep = sizes > 0
    order = np.lexsort((offsets[keep], rows[keep]))
    o = offsets[keep][order]
    s = sizes[keep][order]
    base = rows[keep][order] * row_blocks
    a = base + o // block  # first and last block of each document
    m = blocks_spanned(o, s, block)
    doc = np.repeat(np.arange(len(a)), m)
    q = a[doc] + _ranks(m)
    n_k = (q - a[doc] + 1) if causal else m[doc]
    if causal and reach is not None:
        n_k = np.minimum(n_k, reach + 1)
    first = q - n_k + 1 if causal else a[doc]  # (each query block's first key block)
    t = np.repeat(np.arange(len(q)), n_k)
    k = first[t] + _ranks(n_k)
    q = q[t]
    # Neighbours share one diagonal tile, and it comes twice in a row: keep the first.
    dup = np.zeros(len(q), bool)
    dup[1:] = (q[1:] == q[:-1]) & (k[1:] == k[:-1])
    return np.stack([q[~dup], k[~dup]], 1)


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0, 1, ..., c - 1 for each count c, concatenated."""
    total = int(counts.sum())
    return np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)


def padded(tiles: np.ndarray, capacity: int) -> np.ndarray:
    """`tiles` [K, 2] padded with PAD to [capacity, 2] (raises if they do not fit)."""
    if len(tiles) > capacity:
        raise ValueError(f"{len(tiles)} tiles exceed the tile capacity {capacity}")
    out = np.full((capacity, 2), PAD, np.int32)
    out[: len(tiles)] = tiles
    return out


def document_starts(seg: np.ndarray) -> np.ndarray:
    """Where each document of packed rows [..., T] starts (a document is a run of one non-zero
    segment id): a boolean of the same shape."""
    new = seg > 0
    new[..., 1:] &= seg[..., 1:] != seg[..., :-1]
    return new


def span_tiles(segment_ids: np.ndarray, spans: np.ndarray, block: int) -> np.ndarray:
    """The tiles above the diagonal that bidirectional spans need in rows [R, T] (a span is a
    run of one id > 0 in `spans` within one document of one row; blocks numbered over the rows
    flattened): [K, 2], each span's (q, k) pairs of the blocks it touches with q < k."""
    t = segment_ids.shape[-1]
    seg, sp = segment_ids.reshape(-1), spans.reshape(-1)
    on = (sp > 0) & (seg > 0)
    start = on.copy()
    start[1:] &= ~on[:-1] | (sp[1:] != sp[:-1]) | (seg[1:] != seg[:-1])
    start[::t] = on[::t]  # (a row's first token starts its own)
    end = on.copy()
    end[:-1] &= start[1:] | ~on[1:]
    a, z = np.flatnonzero(start) // block, np.flatnonzero(end) // block
    m = z - a + 1  # (blocks a span touches; a row is whole blocks, so they are its row's)
    per_q = np.repeat(m, np.maximum(m - 1, 0))  # (each span's query blocks but its last)
    q = np.repeat(a, np.maximum(m - 1, 0)) + _ranks(np.maximum(m - 1, 0))
    n_k = per_q - (q - np.repeat(a, np.maximum(m - 1, 0))) - 1  # (key blocks after it)
    k = np.repeat(q, n_k) + 1 + _ranks(n_k)
    return np.stack([np.repeat(q, n_k), k], 1)


def segment_tiles(
    segment_ids: np.ndarray,
    block: int,
    causal: bool,
    reach: int | None = None,
    spans: np.ndarray | None = None,
):
    """The tiles of buckets of packed rows [buckets, rows, T] (a document is a run of one
    non-zero segment id; a bucket's rows are numbered one after another, block
    `r * T / block + b`): (tiles [K, 2] numbered within their bucket, their bucket [K]), by
    bucket, then query block, then key block; `reach`: a sliding window's (`window_reach`);
    `spans`: bidirectional spans of the same shape, whose tiles above the diagonal join
    (`span_tiles`)."""
    n, rows, t = segment_ids.shape
    seg = segment_ids.reshape(n * rows, t)
    line, start = np.nonzero(
        document_starts(seg)
    )  # (row of all buckets, first token) of each document
    end = np.ones_like(seg, bool)
    end[:, :-1] = seg[:, 1:] != seg[:, :-1]
    end &= seg > 0
    last = np.nonzero(end)[1]
    tiles = tile_list(start, last - start + 1, line, t // block, block, causal, reach)
    if spans is not None and (spans > 0).any():
        tiles = np.concatenate([tiles, span_tiles(seg, spans.reshape(n * rows, t), block)])
        tiles = tiles[np.lexsort((tiles[:, 1], tiles[:, 0]))]
    bucket = tiles[:, 0] // (rows * (t // block))
    return tiles - (bucket * rows * (t // block))[:, None], bucket


def from_segments(
    segment_ids: np.ndarray,
    block: int,
    causal: bool,
    capacity: int,
    reach: int | None = None,
    spans: np.ndarray | None = None,
) -> np.ndarray:
    """Padded tile lists [buckets, capacity, 2] of buckets of packed rows [buckets, rows, T]
    (`segment_tiles`; `reach`: a sliding window's; `spans`: bidirectional spans). Raises
    TileOverflow when a bucket needs more than `capacity` tiles."""
    n = segment_ids.shape[0]
    tiles, bucket = segment_tiles(segment_ids, block, causal, reach, spans)
    count = np.bincount(bucket, minlength=n)
    if (count > capacity).any():
        worst = int(np.argmax(count))
        raise TileOverflow(worst, int(count[worst]), capacity)
    out = np.full((n, capacity, 2), PAD, np.int32)
    rank = _ranks(count)
    out[bucket, rank] = tiles
    return out
