"""cuDNN's fused attention over packed documents (`model.attention: cudnn`, GPU only).

Each row's documents become cuDNN's packed segments (offsets and lengths, read off the segment
ids), so the fused kernel attends within each document and skips the rest itself. What the
packed layout asks, measured on an H100 with jax 0.11.2:
- the number of segments per row is a static bound (`batch.*_documents`, sized from the data),
  and the backward pass's workspace grows linearly with it (at 2048 tokens, 8 heads of 64:
  134 MiB for 16, 2 GiB for 256, 8 GiB for 1024; time 0.4 ms to 1.8 ms), so rows of many
  small documents (encoder rows of tiny images) are cheaper with block_sparse;
- the backward pass leaves the gradients of padding positions unwritten (garbage, NaN): the
  inputs are masked with `where`, whose gradient is zero there;
- jax 0.10 computed the key offsets with the query head count (grouped-query K/V heads are
  repeated there; see GQA_OFFSETS_USE_QUERY_HEADS).

cuDNN's fused attention takes half-precision operands only: float32 q/k/v are cast to bfloat16
for the kernel and the output cast back (so `compute_dtype: float32` with cudnn attention is
bfloat16 attention). `tests/test_attention.py` holds it to the dense reference on a GPU (skipped
elsewhere), and `jaxmllm.train` refuses this setting on a backend other than GPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# jax < 0.11 computed the packed layout's key offsets with the query head count (grouped-query
# K/V heads then read the wrong keys, so they are repeated to the query heads); 0.11 uses the
# key head count (measured on an H100: the same outputs without the repeat).
GQA_OFFSETS_USE_QUERY_HEADS = tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11)


def attend(
    q_bthe: jax.Array,
    k_bske: jax.Array,
    v_bske: jax.Array,
    segment_ids_bt: jax.Array,
    *,
    causal: bool,
    documents: int = 0,
) -> jax.Array:
    """[B, T, heads, head_dim]: each query over the keys of its own document (segment).

    `documents`: the most documents a row holds (`batch.*_documents`; 0: the row length)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    heads, head_dim = q_bthe.shape[2], q_bthe.shape[3]
    out_dtype = q_bthe.dtype
    # Padding positions get zero inputs, and through `where` no gradient: cuDNN's backward in
    # the packed layout leaves the gradients of positions outside every segment unwritten.
    real = (segment_ids_bt > 0)[:, :, None, None]
    half = out_dtype if out_dtype in (jnp.bfloat16, jnp.float16) else jnp.bfloat16
    q_bthe, k_bske, v_bske = (jnp.where(real, x, 0).astype(half) for x in (q_bthe, k_bske, v_bske))
    if GQA_OFFSETS_USE_QUERY_HEADS:
        repeat = heads // k_bske.shape[2]
        k_bske = jnp.repeat(k_bske, repeat, axis=2)
        v_bske = jnp.repeat(v_bske, repeat, axis=2)
    offsets, lengths = segments(segment_ids_bt, documents or segment_ids_bt.shape[1])
    out = dot_product_attention(
        q_bthe,
        k_bske,
        v_bske,
        q_seqlen=lengths,
        kv_seqlen=lengths,
        q_offsets=offsets,
        kv_offsets=offsets,
        scale=1.0 / math.sqrt(head_dim),
        mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK,
    )
    # Padding queries belong to no segment: what cuDNN leaves there is not defined, and one NaN
    # in a padding row would reach every weight gradient (0 * NaN) through the next matmul.
    return jnp.where(real, out, 0).astype(out_dtype)


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
