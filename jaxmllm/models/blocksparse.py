"""Block-sparse attention over packed rows: only the (query block, key block) tiles in a list.

A device's rows are one sequence of blocks of `block` tokens; the planner's tile list
(`jaxmllm.plan.tiles`) names the tiles its documents need, padded with (-1, -1) to a fixed
capacity. Per tile, the scores of its block x block (query, key) pairs for every head come from
one batched product; within a tile the usual mask applies (same non-padding segment, and key
<= query when causal). A query block's tiles are then combined with the softmax over all of
them: the running maximum per query (a segment max over the tiles of each query block), the
exponentials, and segment sums of the weights and of the weighted values. So FLOPs and memory
grow with the tiles, never with the row length squared; the maximum is held constant for the
gradient (softmax does not depend on it), everything else is plain differentiable JAX, and it
rematerialises like any other op.

A query that no tile covers (padding) gets 0; the dense reference gives padding queries
themselves, which nothing reads.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def attend(
    q_bthe: jax.Array,
    k_bske: jax.Array,
    v_bske: jax.Array,
    segment_ids_bt: jax.Array,
    tiles_bk2: jax.Array,
    *,
    block: int,
    causal: bool,
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

    Returns:
      [B, T, heads, head_dim] in the queries' dtype.
    """
    fn = lambda q, k, v, s, t: _attend_row(q, k, v, s, t, block=block, causal=causal)
    return jax.vmap(fn)(q_bthe, k_bske, v_bske, segment_ids_bt, tiles_bk2)


def _attend_row(q_the, k_ske, v_ske, seg_t, tiles_k2, *, block: int, causal: bool):
    t, heads, e = q_the.shape
    kv = k_ske.shape[1]
    nb = t // block
    valid = tiles_k2[:, 0] >= 0
    qb = jnp.where(valid, tiles_k2[:, 0], 0)
    kb = jnp.where(valid, tiles_k2[:, 1], 0)
    owner = jnp.where(valid, qb, nb)  # padding tiles reduce into a spare block, dropped
    q_kbhge = q_the.reshape(nb, block, kv, heads // kv, e)[qb]
    k_kbhe = k_ske.reshape(nb, block, kv, e)[kb]
    v_kbhe = v_ske.reshape(nb, block, kv, e)[kb]
    seg = seg_t.reshape(nb, block)
    seg_q, seg_k = seg[qb], seg[kb]  # [K, block]
    mask = (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_k[:, None, :] > 0)
    mask &= valid[:, None, None]
    if causal:
        pos_q = qb[:, None] * block + jnp.arange(block)
        pos_k = kb[:, None] * block + jnp.arange(block)
        mask &= pos_k[:, None, :] <= pos_q[:, :, None]
    mask = mask[:, None, None]  # [K, 1, 1, q, k]
    scores = jnp.einsum(
        "kqhge,kshe->khgqs", q_kbhge, k_kbhe, preferred_element_type=jnp.float32
    ) / math.sqrt(e)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    top = jax.ops.segment_max(scores.max(-1), owner, nb + 1)  # [nb + 1, kv, g, q]
    top = jax.lax.stop_gradient(top)
    weights = jnp.where(mask, jnp.exp(scores - top[owner][..., None]), 0.0)
    total = jax.ops.segment_sum(weights.sum(-1), owner, nb + 1)[:nb]  # [nb, kv, g, q]
    out = jnp.einsum(
        "khgqs,kshe->kqhge", weights.astype(v_ske.dtype), v_kbhe,
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    out = jax.ops.segment_sum(out, owner, nb + 1)[:nb]  # [nb, q, kv, g, e]
    out = out / jnp.maximum(jnp.moveaxis(total, -1, 1)[..., None], 1e-30)
    return out.reshape(t, heads, e).astype(q_the.dtype)
