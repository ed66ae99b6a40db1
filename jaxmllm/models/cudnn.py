"""cuDNN's fused attention over packed documents (`model.attention: cudnn`, GPU only).

Each row's documents become cuDNN's packed segments (offsets and lengths, read off the segment
ids once per step by `segments`, outside the layers' scan), so the fused kernel attends within
each document and skips the rest itself. What the packed layout asks, measured on an H100 with
jax 0.11.2:
- the number of segments per row is a static bound (`batch.*_documents`, sized from the data),
  and the backward pass's workspace grows linearly with it (at 2048 tokens, 8 heads of 64:
  134 MiB for 16, 2 GiB for 256, 8 GiB for 1024; time 0.4 ms to 1.8 ms), so rows of many
  small documents (encoder rows of tiny images) are cheaper with block_sparse;
- the backward pass leaves the gradients of padding positions unwritten (garbage, NaN): the
  inputs are masked with `where`, whose gradient is zero there;
- jax 0.10 computed the key offsets with the query head count (grouped-query K/V heads are
  repeated there; see GQA_OFFSETS_USE_QUERY_HEADS).

jax's public `jax.nn.dot_product_attention(..., implementation="cudnn")` takes per-row
sequence lengths but no packed segments (query / key offsets) up to jax 0.10.2, the newest on
PyPI as of 2026-11: the packed layout is reachable only through jax's cuDNN module
(`jax._src.cudnn.fused_attention_stablehlo`), imported in one place (`_fused_attention`) with
an error that says what to set if a jax release moves it.

The kernel's own residuals (its output and softmax statistics, beside q, k and v) are saved
tagged `attention` (`jaxmllm.config.remat`): a remat policy that keeps them does not run the
fused forward again in the backward pass.

cuDNN's fused attention takes half-precision operands only: float32 q/k/v are cast to bfloat16
for the kernel and the output cast back (so `compute_dtype: float32` with cudnn attention is
bfloat16 attention). `tests/test_attention.py` holds it to the dense reference on a GPU (skipped
elsewhere), and `jaxmllm.train` refuses this setting on a backend other than GPU.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxmllm.config.remat import ATTENTION

# jax < 0.11 computed the packed layout's key offsets with the query head count (grouped-query
# K/V heads then read the wrong keys, so they are repeated to the query heads); 0.11 uses the
# key head count (measured on an H100: the same outputs without the repeat).
GQA_OFFSETS_USE_QUERY_HEADS = tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11)


def attend(
    q_bthe: jax.Array,
    k_bske: jax.Array,
    v_bske: jax.Array,
    segment_ids_bt: jax.Array,
    offsets_bn: jax.Array,
    lengths_bn: jax.Array,
    *,
    causal: bool,
) -> jax.Array:
    """[B, T, heads, head_dim]: each query over the keys of its own document (segment).

    `offsets_bn`, `lengths_bn`: the rows' packed segments (`segments`)."""
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
    scale = 1.0 / math.sqrt(head_dim)
    call = functools.partial(_fused_attention, causal=causal, scale=scale)
    out = keeping_residuals(call)(q_bthe, k_bske, v_bske, offsets_bn, lengths_bn)
    # Padding queries belong to no segment: what cuDNN leaves there is not defined, and one NaN
    # in a padding row would reach every weight gradient (0 * NaN) through the next matmul.
    return jnp.where(real, out, 0).astype(out_dtype)


def _fused_attention(q, k, v, offsets, lengths, *, causal: bool, scale: float) -> jax.Array:
    """cuDNN's fused attention in the packed layout (jax's own cuDNN module: see the docs)."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
    except ImportError as e:
        raise RuntimeError(
            f"model.attention: cudnn needs jax's cuDNN fused-attention module, which jax "
            f"{jax.__version__} does not have where jaxmllm looks for it ({e}); set "
            f"model.attention: block_sparse (or auto) instead"
        ) from e
    return dot_product_attention(
        q,
        k,
        v,
        q_seqlen=lengths,
        kv_seqlen=lengths,
        q_offsets=offsets,
        kv_offsets=offsets,
        scale=scale,
        mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK,
    )


def keeping_residuals(fn: Callable) -> Callable:
    """`fn(q, k, v, *rest)` whose backward pass runs from its own VJP's residuals, its output
    and those residuals that are not its inputs tagged `attention`: under a remat policy that
    keeps them (and q, k, v) the forward pass is not run again (jax.checkpoint otherwise
    reruns a fused kernel's forward, whose residuals it cannot name). `rest`: no gradient."""

    @jax.custom_vjp
    def run(q, k, v, rest):
        return fn(q, k, v, *rest)

    def forward(q, k, v, rest):
        out, back = jax.vjp(lambda q, k, v: fn(q, k, v, *rest), q, k, v)
        leaves, tree = jax.tree.flatten(back)
        inputs = (q, k, v, *rest)
        tag = lambda x: x if any(x is y for y in inputs) else checkpoint_name(x, ATTENTION)
        # (the output too: the layer after the kernel reads it in its own backward)
        return tag(out), jax.tree.unflatten(tree, [tag(x) for x in leaves])

    def backward(back, d_out):
        return (*back(d_out), None)

    run.defvjp(forward, backward)
    return lambda q, k, v, *rest: run(q, k, v, rest)


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
