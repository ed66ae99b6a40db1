"""Block-sparse attention: only the (query block, key block) tiles of a list, flash-style.

A device's rows are one sequence of blocks of `block` tokens; the planner's tile list
(`jaxmllm.plan.tiles`) names the tiles its documents need, padded with (-1, -1) to a fixed
capacity. Within a tile the usual mask applies (same non-padding segment, and key position <=
query position when causal, or both in one bidirectional span, an image's tokens in Gemma 3;
with a sliding window, key position > query position - window).
One kernel (`kernel`) serves the packed rows (`attend`: keys are the queries' own tokens) and
context parallelism (`jaxmllm.models.context`: keys gathered over a context group).

The kernel scores the tile list a chunk of tiles at a time with an online softmax (a running
maximum and sum per query), so memory follows a chunk (at most CHUNK_SCORES scores), never
every tile's scores at once; its backward pass recomputes each chunk's scores from the saved
log-sum-exp and output (FlashAttention's), so the forward keeps only those. Every matmul takes
the compute dtype's operands (bf16 under bf16 compute) with fp32 accumulation; the softmax's
statistics and the gradients' sums over tiles stay in fp32. FLOPs grow with the tiles, never
with the row length squared.

The kernel's output and log-sum-exp are tagged `attention` for the remat policies
(`jaxmllm.config.remat`): a policy that keeps them (with q, k and v) never reruns the forward
pass in the backward. A query that no tile covers (padding) gets 0; the dense reference gives
padding queries themselves, which nothing reads.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxmllm.config.remat import ATTENTION
from sharding import varying_as

CHUNK_SCORES = 1 << 22  # scores (f32) a chunk of tiles holds at once: 16 MiB
NEG = float(jnp.finfo(jnp.float32).min)


def attend(
    q_bthe: jax.Array,
    k_bske: jax.Array,
    v_bske: jax.Array,
    segment_ids_bt: jax.Array,
    tiles_bk2: jax.Array,
    *,
    block: int,
    causal: bool,
    window: int = 0,
    spans_bt: jax.Array | None = None,
) -> jax.Array:
    """Attention restricted to a tile list, per row of the batch.

    Args:
      q_bthe: queries [B, T, heads, head_dim]; T a multiple of `block`.
      k_bske, v_bske: keys and values [B, T, kv_heads, head_dim] (grouped-query heads share
        them: heads is a multiple of kv_heads).
      segment_ids_bt: document of each token, 0 for padding [B, T].
      tiles_bk2: (query block, key block) tiles [B, K, 2], -1 for padding tiles.
      block: tokens per block.
      causal: keys after the query are masked too.
      window: a query sees only itself and the window - 1 tokens before it (0: no window);
        the tiles wholly outside it are scored and masked, unless the list leaves them out
        (`jaxmllm.plan.tiles.window_reach`: the windowed layers' own list).
      spans_bt: bidirectional spans [B, T] (causal only): the tokens of one span (one id > 0)
        see each other both ways within their document (the list has the tiles above the
        diagonal they need, `jaxmllm.plan.tiles.span_tiles`); None: none.

    Returns:
      [B, T, heads, head_dim] in the queries' dtype.
    """
    positions = jnp.arange(q_bthe.shape[1])  # a document's tokens lie in order in its row

    def row(q, k, v, seg, span, tiles):
        return kernel(
            q, k, v, seg, seg, positions, positions, span, span, tiles, block, causal, window
        )

    return jax.vmap(row)(q_bthe, k_bske, v_bske, segment_ids_bt, spans_bt, tiles_bk2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11, 12))
def kernel(
    q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k, span_q, span_k, tiles_k2, block, causal, window
):
    """One device's attention: queries [T, heads, e] over keys and values [S, kv, e], masked by
    segments and positions [T] / [S] (`window` > 0: key position > query position - window;
    a key after the query where both are of one bidirectional span, `span_q` / `span_k` > 0
    equal, or None: none), over a tile list [K, 2] of (query block, key block), -1 for
    padding. A query no tile covers gets 0."""
    args = (q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k, span_q, span_k, tiles_k2)
    return _forward(*args, block, causal, window)[0]


def _chunks(tiles_k2: jax.Array, heads: int, block: int) -> jax.Array:
    """The tile list padded to whole chunks [n, chunk, 2] of at most CHUNK_SCORES scores, as
    few as that allows and as even (the padding, computed like any tile, under one a chunk)."""
    n_tiles = tiles_k2.shape[0]
    most = max(1, CHUNK_SCORES // (heads * block * block))
    n = -(-n_tiles // most)
    chunk = -(-n_tiles // n)
    padded = jnp.pad(tiles_k2, ((0, n * chunk - n_tiles), (0, 0)), constant_values=-1)
    return padded.reshape(n, chunk, 2)


def _tile_scores(q_b, k_b, seg_q, seg_k, pos_q, pos_k, span_q, span_k, tiles_c2, causal, window):
    """A chunk's scores [c, kv, g, q, s] (f32, masked to NEG), its mask, owner and key blocks."""
    nbq = seg_q.shape[0]
    valid = tiles_c2[:, 0] >= 0
    qb = jnp.where(valid, tiles_c2[:, 0], 0)
    kb = jnp.where(valid, tiles_c2[:, 1], 0)
    owner = jnp.where(valid, qb, nbq)  # padding tiles reduce into a spare block, dropped
    sk = seg_k[kb][:, None, :]
    mask = (seg_q[qb][:, :, None] == sk) & (sk > 0) & valid[:, None, None]
    if causal:
        before = pos_k[kb][:, None, :] <= pos_q[qb][:, :, None]
        if span_q is not None:  # (or both of one bidirectional span: either way)
            span = span_q[qb][:, :, None]
            before |= (span == span_k[kb][:, None, :]) & (span > 0)
        mask &= before
    if window:  # (positions count within a document: the window stays inside it)
        mask &= pos_k[kb][:, None, :] > pos_q[qb][:, :, None] - window
    mask = mask[:, None, None]  # [c, 1, 1, q, s]
    e = q_b.shape[-1]
    scores = jnp.einsum("cqhge,cshe->chgqs", q_b[qb], k_b[kb], preferred_element_type=jnp.float32)
    return jnp.where(mask, scores / math.sqrt(e), NEG), mask, owner, kb


def _blocked(q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k, span_q, span_k, block):
    """q [nbq, block, kv, g, e], k and v [nbk, block, kv, e], and the segments, positions and
    spans (None: none) of both [blocks, block]."""
    t, heads, e = q_the.shape
    kv = k_ske.shape[1]
    q_b = q_the.reshape(t // block, block, kv, heads // kv, e)
    k_b = k_ske.reshape(-1, block, kv, e)
    v_b = v_ske.reshape(-1, block, kv, e)
    blocks = lambda x: None if x is None else jnp.asarray(x).reshape(-1, block)
    return q_b, k_b, v_b, *map(blocks, (seg_q, seg_k, pos_q, pos_k, span_q, span_k))


# A checkpoint that saves nothing, never differentiated (the kernel's own backward is `_bwd`):
# it keeps the forward pass whole under partial evaluation. A scan over layers, differentiated,
# hoists whatever depends only on its loop-invariant inputs ahead of the layers; the masks,
# owners and key blocks depend on the segments, positions and tiles alone, the same in every
# layer, so without it they were computed ahead, every chunk's stacked: the mask broadcast
# over the heads for every tile at once (8 GiB a device at 64k tokens a context group).
@functools.partial(
    jax.checkpoint,
    policy=jax.checkpoint_policies.nothing_saveable,
    prevent_cse=False,
    static_argnums=(10, 11, 12),
)
def _forward(
    q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k, span_q, span_k, tiles_k2, block, causal, window
):
    """(output [T, heads, e] in q's dtype, log-sum-exp [nbq, q, kv, g] in f32)."""
    t, heads, e = q_the.shape
    blocked = _blocked(q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k, span_q, span_k, block)
    q_b, k_b, v_b, sq, sk, pq, pk, nq, nk = blocked
    nbq, kv, g = t // block, q_b.shape[2], q_b.shape[3]

    def chunk(carry, tiles_c2):
        top, total, acc = carry  # per query: running max, sum of weights, weighted values
        scores, mask, owner, kb = _tile_scores(
            q_b, k_b, sq, sk, pq, pk, nq, nk, tiles_c2, causal, window
        )
        new_top = jnp.maximum(top, jax.ops.segment_max(scores.max(-1), owner, nbq + 1))
        weights = jnp.where(mask, jnp.exp(scores - new_top[owner][..., None]), 0.0)
        scale = jnp.exp(top - new_top)  # [nbq + 1, kv, g, q]
        total = total * scale + jax.ops.segment_sum(weights.sum(-1), owner, nbq + 1)
        out = jnp.einsum(
            "chgqs,cshe->cqhge",
            weights.astype(v_b.dtype),
            v_b[kb],
            preferred_element_type=jnp.float32,
        )
        acc = acc * jnp.moveaxis(scale, -1, 1)[..., None]
        return (new_top, total, acc + jax.ops.segment_sum(out, owner, nbq + 1)), None

    init = (
        jnp.full((nbq + 1, kv, g, block), NEG, jnp.float32),
        jnp.zeros((nbq + 1, kv, g, block), jnp.float32),
        jnp.zeros((nbq + 1, block, kv, g, e), jnp.float32),
    )
    init = varying_as(init, q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k, tiles_k2)
    (top, total, acc), _ = jax.lax.scan(chunk, init, _chunks(tiles_k2, heads, block))
    total = jnp.moveaxis(total[:nbq], -1, 1)[..., None]  # [nbq, q, kv, g, 1]
    out = acc[:nbq] / jnp.maximum(total, 1e-30)
    lse = jnp.moveaxis(top[:nbq], -1, 1) + jnp.log(jnp.maximum(total[..., 0], 1e-30))
    return out.reshape(t, heads, e).astype(q_the.dtype), lse


def _fwd(
    q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k, span_q, span_k, tiles_k2, block, causal, window
):
    """The forward pass, and what the backward recomputes from (q, k, v, the masks' inputs, the
    output and its log-sum-exp)."""
    args = (q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k, span_q, span_k, tiles_k2)
    out, lse = _forward(*args, block, causal, window)
    out, lse = checkpoint_name(out, ATTENTION), checkpoint_name(lse, ATTENTION)
    return out, (*args, out, lse)


def _bwd(block, causal, window, res, d_out):
    """FlashAttention's backward over the same chunks: each chunk's weights again from the
    saved log-sum-exp, then the gradients of q, k and v summed into their blocks. The matmuls
    take q's dtype (bf16 under bf16 compute) with fp32 accumulation."""
    q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k, span_q, span_k, tiles_k2, out, lse = res
    t, heads, e = q_the.shape
    dtype = q_the.dtype
    blocked = _blocked(q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k, span_q, span_k, block)
    q_b, k_b, v_b, sq, sk, pq, pk, nq, nk = blocked
    nbq, nbk = t // block, k_b.shape[0]
    shape = (nbq, block, *q_b.shape[2:])  # [nbq, q, kv, g, e]
    do = d_out.astype(dtype).reshape(shape)
    delta = (do.astype(jnp.float32) * out.astype(jnp.float32).reshape(shape)).sum(-1)
    spare = lambda x: jnp.concatenate([x, jnp.zeros_like(x[:1])])  # padding tiles' block
    lse_p, do_p, delta_p = spare(lse), spare(do), spare(delta)
    scale = 1.0 / math.sqrt(e)
    mm = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)

    def chunk(carry, tiles_c2):
        dq, dk, dv = carry
        scores, mask, owner, kb = _tile_scores(
            q_b, k_b, sq, sk, pq, pk, nq, nk, tiles_c2, causal, window
        )
        lse_c = jnp.moveaxis(lse_p[owner], 1, -1)[..., None]  # [c, kv, g, q, 1]
        p = jnp.where(mask, jnp.exp(scores - lse_c), 0.0)  # [c, kv, g, q, s] f32
        do_c = do_p[owner]  # [c, q, kv, g, e]
        dv_c = mm("chgqs,cqhge->cshe", p.astype(dtype), do_c)
        dp = mm("cqhge,cshe->chgqs", do_c, v_b[kb])
        ds = (p * (dp - jnp.moveaxis(delta_p[owner], 1, -1)[..., None]) * scale).astype(dtype)
        dq_c = mm("chgqs,cshe->cqhge", ds, k_b[kb])
        dk_c = mm("chgqs,cqhge->cshe", ds, q_b[owner % nbq])
        key = jnp.where(owner < nbq, kb, nbk)  # (padding tiles: a spare key block)
        dq = dq + jax.ops.segment_sum(dq_c, owner, nbq + 1)
        dk = dk + jax.ops.segment_sum(dk_c, key, nbk + 1)
        dv = dv + jax.ops.segment_sum(dv_c, key, nbk + 1)
        return (dq, dk, dv), None

    zeros = lambda blocks, b: jnp.zeros((blocks + 1, *b.shape[1:]), jnp.float32)
    init = (zeros(nbq, q_b), zeros(nbk, k_b), zeros(nbk, v_b))
    init = varying_as(init, *res, d_out)
    (dq, dk, dv), _ = jax.lax.scan(chunk, init, _chunks(tiles_k2, heads, block))
    grads = (
        dq[:nbq].reshape(q_the.shape).astype(q_the.dtype),
        dk[:nbk].reshape(k_ske.shape).astype(k_ske.dtype),
        dv[:nbk].reshape(v_ske.shape).astype(v_ske.dtype),
    )
    return (*grads, None, None, None, None, None, None, None)


kernel.defvjp(_fwd, _bwd)
