"""Context-parallel attention: a device's query blocks against its context group's keys.

With `mesh.context` = C > 1 an LLM row is split over a context group of C devices
(`jaxmllm.plan.context` deals its query blocks, `jaxmllm.batch.context` moves the tokens):
each device holds its blocks' tokens with their true positions and segment ids, and a tile list
of (its local query block, a key block of the group gathered: rank * blocks a rank + local
block). Every layer the keys, values, segment ids and positions are all-gathered over the
`context` mesh axis (`attend`); the gather's transpose in the backward pass is a
reduce-scatter, so the gradients are the unsplit ones. Encoder rows routed to a group are
gathered the same way (`gather_rows`), so each placeholder reads its row wherever in the group
it arrived.

The kernel (`attend_gathered`) scores the tile list a chunk of tiles at a time with an online
softmax (running maximum and sum per query), and its backward pass recomputes each chunk's
scores from the saved log-sum-exp (FlashAttention's), so memory follows a chunk, not the
device's tiles: one long document's tiles are about T^2 / (2 block^2). Within a tile the usual
mask applies (same non-padding segment; causal: key position <= query position, which within
a document is the order of the tokens). Without a mesh (or a `context` axis of 1) nothing is
gathered: `attend` is for the split rows only.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from sharding import CONTEXT_AXIS, DATA_AXES

CHUNK_SCORES = 1 << 22  # scores (f32) a chunk of tiles holds at once: 16 MiB
NEG = float(jnp.finfo(jnp.float32).min)


def context_size() -> int:
    """Devices of a context group under the current mesh (`jax.set_mesh`); 1 without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or CONTEXT_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[CONTEXT_AXIS]


def _batch_axes(mesh) -> tuple[str, ...]:
    return tuple(a for a in DATA_AXES if a in mesh.axis_names)


def gather_rows(x_dnw: jax.Array) -> jax.Array:
    """Each device's rows [D, N, W] -> its context group's rows [D, C * N, W] (rank order)."""
    if context_size() == 1:
        return x_dnw
    mesh = jax.sharding.get_abstract_mesh()
    spec = PartitionSpec(_batch_axes(mesh))
    body = lambda x: jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)
    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(x_dnw)


def attend(
    q_bthe: jax.Array,
    k_bske: jax.Array,
    v_bske: jax.Array,
    segment_ids_bt: jax.Array,
    positions_bt: jax.Array,
    tiles_bk2: jax.Array,
    *,
    block: int,
    causal: bool,
) -> jax.Array:
    """Attention of each device's query blocks over its context group's keys and values.

    Args:
      q_bthe: queries [B, T, heads, head_dim], B = the devices' buckets (one row each).
      k_bske, v_bske: keys and values [B, T, kv_heads, head_dim] of the same tokens.
      segment_ids_bt, positions_bt: document and true position of each token [B, T].
      tiles_bk2: (local query block, gathered key block) tiles [B, K, 2], -1 for padding.
      block: tokens per block; causal: mask keys after the query.

    Returns:
      [B, T, heads, head_dim] in the queries' dtype.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if context_size() == 1:
        raise ValueError("context-parallel attention needs a mesh with a context axis > 1")
    axes = _batch_axes(mesh)
    tensor = mesh.shape.get("tensor", 1)
    heads, kv = q_bthe.shape[2], k_bske.shape[2]
    split_heads = tensor > 1 and heads % tensor == 0 and kv % tensor == 0
    hspec = PartitionSpec(axes, None, "tensor" if split_heads else None, None)
    spec = PartitionSpec(axes)
    gather = lambda x: jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)

    def body(q, k, v, seg, pos, tiles):
        fn = functools.partial(attend_gathered, block=block, causal=causal)
        return jax.vmap(fn)(q, gather(k), gather(v), seg, gather(seg), pos, gather(pos), tiles)

    # (check_vma off: the kernel's scans start from constants, the same on every device)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(hspec, hspec, hspec, spec, spec, spec),
        out_specs=hspec,
        check_vma=False,
    )(q_bthe, k_bske, v_bske, segment_ids_bt, positions_bt, tiles_bk2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def attend_gathered(q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k, tiles_k2, block, causal):
    """One device's attention: queries [T, heads, e] over keys and values [S, kv, e] (S: the
    gathered group's tokens), masked by segments and positions [T] / [S], over a tile list
    [K, 2] of (query block, key block), -1 for padding. A query no tile covers gets 0."""
    return _forward(q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k, tiles_k2, block, causal)[0]


def _chunks(tiles_k2: jax.Array, heads: int, block: int) -> jax.Array:
    """The tile list padded to whole chunks [n, chunk, 2] of at most CHUNK_SCORES scores, as
    few as that allows and as even (the padding, computed like any tile, under one a chunk)."""
    n_tiles = tiles_k2.shape[0]
    most = max(1, CHUNK_SCORES // (heads * block * block))
    n = -(-n_tiles // most)
    chunk = -(-n_tiles // n)
    padded = jnp.pad(tiles_k2, ((0, n * chunk - n_tiles), (0, 0)), constant_values=-1)
    return padded.reshape(n, chunk, 2)


def _tile_scores(q_b, k_b, seg_q, seg_k, pos_q, pos_k, tiles_c2, causal):
    """A chunk's scores [c, kv, g, q, s] (f32, masked to NEG), its mask, owner and key blocks."""
    nbq, block = seg_q.shape
    valid = tiles_c2[:, 0] >= 0
    qb = jnp.where(valid, tiles_c2[:, 0], 0)
    kb = jnp.where(valid, tiles_c2[:, 1], 0)
    owner = jnp.where(valid, qb, nbq)  # padding tiles reduce into a spare block, dropped
    sk = seg_k[kb][:, None, :]
    mask = (seg_q[qb][:, :, None] == sk) & (sk > 0) & valid[:, None, None]
    if causal:
        mask &= pos_k[kb][:, None, :] <= pos_q[qb][:, :, None]
    mask = mask[:, None, None]  # [c, 1, 1, q, s]
    e = q_b.shape[-1]
    scores = jnp.einsum(
        "cqhge,cshe->chgqs", q_b[qb], k_b[kb], preferred_element_type=jnp.float32
    ) / math.sqrt(e)
    return jnp.where(mask, scores, NEG), mask, owner, qb, kb


def _blocked(q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k, block):
    t, heads, e = q_the.shape
    kv = k_ske.shape[1]
    q_b = q_the.reshape(t // block, block, kv, heads // kv, e)
    k_b = k_ske.reshape(-1, block, kv, e)
    v_b = v_ske.reshape(-1, block, kv, e)
    blocks = lambda x: jnp.asarray(x).reshape(-1, block)
    return q_b, k_b, v_b, blocks(seg_q), blocks(seg_k), blocks(pos_q), blocks(pos_k)


def _forward(q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k, tiles_k2, block, causal):
    t, heads, e = q_the.shape
    q_b, k_b, v_b, sq, sk, pq, pk = _blocked(q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k,
                                             block)  # fmt: skip
    nbq, kv, g = t // block, q_b.shape[2], q_b.shape[3]

    def chunk(carry, tiles_c2):
        top, total, acc = carry  # per query: running max, sum of weights, weighted values
        scores, mask, owner, _, kb = _tile_scores(q_b, k_b, sq, sk, pq, pk, tiles_c2, causal)
        new_top = jnp.maximum(top, jax.ops.segment_max(scores.max(-1), owner, nbq + 1))
        weights = jnp.where(mask, jnp.exp(scores - new_top[owner][..., None]), 0.0)
        scale = jnp.exp(top - new_top)  # [nbq + 1, kv, g, q]
        total = total * scale + jax.ops.segment_sum(weights.sum(-1), owner, nbq + 1)
        out = jnp.einsum(
            "chgqs,cshe->cqhge", weights.astype(v_b.dtype), v_b[kb],
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        acc = acc * jnp.moveaxis(scale, -1, 1)[..., None]
        return (new_top, total, acc + jax.ops.segment_sum(out, owner, nbq + 1)), None

    init = (
        jnp.full((nbq + 1, kv, g, block), NEG, jnp.float32),
        jnp.zeros((nbq + 1, kv, g, block), jnp.float32),
        jnp.zeros((nbq + 1, block, kv, g, e), jnp.float32),
    )
    (top, total, acc), _ = jax.lax.scan(chunk, init, _chunks(tiles_k2, heads, block))
    total = jnp.moveaxis(total[:nbq], -1, 1)[..., None]  # [nbq, q, kv, g, 1]
    out = acc[:nbq] / jnp.maximum(total, 1e-30)
    lse = jnp.moveaxis(top[:nbq], -1, 1) + jnp.log(jnp.maximum(total[..., 0], 1e-30))
    return out.reshape(t, heads, e).astype(q_the.dtype), (out, lse)


def _fwd(q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k, tiles_k2, block, causal):
    out, (out_f32, lse) = _forward(q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k, tiles_k2,
                                   block, causal)  # fmt: skip
    return out, (q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k, tiles_k2, out_f32, lse)


def _bwd(block, causal, res, d_out):
    """FlashAttention's backward over the same chunks: each chunk's weights again from the
    saved log-sum-exp, then the gradients of q, k and v summed into their blocks."""
    q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k, tiles_k2, out, lse = res
    t, heads, e = q_the.shape
    q_b, k_b, v_b, sq, sk, pq, pk = _blocked(q_the, k_ske, v_ske, seg_q, seg_k, pos_q, pos_k,
                                             block)  # fmt: skip
    nbq, nbk = t // block, k_b.shape[0]
    do = d_out.astype(jnp.float32).reshape(out.shape)  # [nbq, q, kv, g, e]
    delta = (do * out).sum(-1)  # [nbq, q, kv, g]
    lse_p = jnp.concatenate([lse, jnp.zeros_like(lse[:1])])  # (padding tiles: the spare block)
    do_p = jnp.concatenate([do, jnp.zeros_like(do[:1])])
    delta_p = jnp.concatenate([delta, jnp.zeros_like(delta[:1])])
    scale = 1.0 / math.sqrt(e)

    def chunk(carry, tiles_c2):
        dq, dk, dv = carry
        scores, mask, owner, _, kb = _tile_scores(q_b, k_b, sq, sk, pq, pk, tiles_c2, causal)
        lse_c = jnp.moveaxis(lse_p[owner], 1, -1)[..., None]  # [c, kv, g, q, 1]
        p = jnp.where(mask, jnp.exp(scores - lse_c), 0.0)  # [c, kv, g, q, s]
        do_c = do_p[owner]  # [c, q, kv, g, e]
        dv_c = jnp.einsum("chgqs,cqhge->cshe", p, do_c)
        dp = jnp.einsum("cqhge,cshe->chgqs", do_c, v_b[kb].astype(jnp.float32))
        ds = p * (dp - jnp.moveaxis(delta_p[owner], 1, -1)[..., None]) * scale
        dq_c = jnp.einsum("chgqs,cshe->cqhge", ds, k_b[kb].astype(jnp.float32))
        dk_c = jnp.einsum("chgqs,cqhge->cshe", ds, q_b[owner % nbq].astype(jnp.float32))
        key = jnp.where(owner < nbq, kb, nbk)  # (padding tiles: a spare key block)
        dq = dq + jax.ops.segment_sum(dq_c, owner, nbq + 1)
        dk = dk + jax.ops.segment_sum(dk_c, key, nbk + 1)
        dv = dv + jax.ops.segment_sum(dv_c, key, nbk + 1)
        return (dq, dk, dv), None

    zeros = lambda shape: jnp.zeros(shape, jnp.float32)
    init = (zeros((nbq + 1,) + q_b.shape[1:]), zeros((nbk + 1,) + k_b.shape[1:]),
            zeros((nbk + 1,) + v_b.shape[1:]))  # fmt: skip
    (dq, dk, dv), _ = jax.lax.scan(chunk, init, _chunks(tiles_k2, heads, block))
    return (
        dq[:nbq].reshape(q_the.shape).astype(q_the.dtype),
        dk[:nbk].reshape(k_ske.shape).astype(k_ske.dtype),
        dv[:nbk].reshape(v_ske.shape).astype(v_ske.dtype),
        None, None, None, None, None,
    )  # fmt: skip


attend_gathered.defvjp(_fwd, _bwd)
