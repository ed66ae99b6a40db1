"""cuDNN's fused attention over packed documents (`model.attention: cudnn`, GPU only).

Each row's documents become cuDNN's packed segments (offsets and lengths, read off the segment
ids), so the fused kernel attends within each document and skips the rest itself. Two things
about jax 0.10's packed layout: the number of segments per row is a static bound (here: one per
two positions, the most a row of documents of two or more tokens can hold), and it computes the
key offsets with the query head count, so grouped-query K/V heads are repeated to the query
heads first (else the kernel reads the wrong keys).

Untested here: the project's CPU machines have no cuDNN; the tests hold block-sparse and dense
to each other, and `jaxmllm.train` refuses this setting on a backend other than GPU.
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
    *,
    causal: bool,
) -> jax.Array:
    """[B, T, heads, head_dim]: each query over the keys of its own document (segment)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    heads, head_dim = q_bthe.shape[2], q_bthe.shape[3]
    repeat = heads // k_bske.shape[2]
    k_bshe = jnp.repeat(k_bske, repeat, axis=2)
    v_bshe = jnp.repeat(v_bske, repeat, axis=2)
    offsets, lengths = segments(segment_ids_bt, max(1, segment_ids_bt.shape[1] // 2))
    return dot_product_attention(
        q_bthe,
        k_bshe,
        v_bshe,
        q_seqlen=lengths,
        kv_seqlen=lengths,
        q_offsets=offsets,
        kv_offsets=offsets,
        scale=1.0 / math.sqrt(head_dim),
        mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK,
    )


def segments(segment_ids_bt: jax.Array, most: int) -> tuple[jax.Array, jax.Array]:
    """cuDNN's packed layout of rows of documents: (offsets [B, most + 1], lengths [B, most]),
    -1 past a row's last document. A document is a run of one non-zero segment id."""

    def row(seg_t):
        t = seg_t.shape[0]
        prev = jnp.concatenate([jnp.zeros(1, seg_t.dtype), seg_t[:-1]])
        nxt = jnp.concatenate([seg_t[1:], jnp.zeros(1, seg_t.dtype)])
        real = seg_t > 0
        (start,) = jnp.nonzero(real & (seg_t != prev), size=most, fill_value=t)
        (end,) = jnp.nonzero(real & (seg_t != nxt), size=most, fill_value=t - 1)
        found = start < t
        lengths = jnp.where(found, end - start + 1, -1)
        offsets = jnp.concatenate([jnp.where(found, start, -1), jnp.full(1, -1, start.dtype)])
        return offsets.astype(jnp.int32), lengths.astype(jnp.int32)

    return jax.vmap(row)(segment_ids_bt)
