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

The kernel is block-sparse attention's (`jaxmllm.models.blocksparse.kernel`: a chunk of tiles
at a time with an online softmax, a flash-style backward), here with the keys of the whole
group: memory follows a chunk, not the device's tiles (one long document's tiles are about
T^2 / (2 block^2)). Within a tile the usual mask applies (same non-padding segment; causal: key
position <= query position, which within a document is the order of the tokens). Without a
mesh (or a `context` axis of 1) nothing is gathered: `attend` is for the split rows only.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from jaxmllm.models.blocksparse import kernel
from sharding import CONTEXT_AXIS, DATA_AXES


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
    window: int = 0,
) -> jax.Array:
    """Attention of each device's query blocks over its context group's keys and values.

    Args:
      q_bthe: queries [B, T, heads, head_dim], B = the devices' buckets (one row each).
      k_bske, v_bske: keys and values [B, T, kv_heads, head_dim] of the same tokens.
      segment_ids_bt, positions_bt: document and true position of each token [B, T].
      tiles_bk2: (local query block, gathered key block) tiles [B, K, 2], -1 for padding.
      block: tokens per block; causal: mask keys after the query; window: a query sees only
        itself and the window - 1 tokens before it (0: no window; positions count within a
        document, so the window stays inside it).

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
        def row(q, k, v, seg_q, seg_k, pos_q, pos_k, tiles):
            args = (q, k, v, seg_q, seg_k, pos_q, pos_k, None, None, tiles)
            return kernel(*args, block, causal, window)

        return jax.vmap(row)(q, gather(k), gather(v), seg, gather(seg), pos, gather(pos), tiles)

    # (check_vma off: the kernel's scans start from constants, the same on every device)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(hspec, hspec, hspec, spec, spec, spec),
        out_specs=hspec,
        check_vma=False,
    )(q_bthe, k_bske, v_bske, segment_ids_bt, positions_bt, tiles_bk2)
