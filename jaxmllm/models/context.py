"""Context-parallel attention: a device's query blocks against its context group's keys.

With `mesh.context` = C > 1 an LLM row is split over a context group of C devices
(`jaxmllm.plan.context` deals its query blocks, `jaxmllm.batch.context` moves the tokens):
each device holds its blocks' tokens with their true positions and segment ids, and a tile list
of (its local query block, a key block of the group gathered: rank * blocks a rank + local
block). Every layer the keys, values, segment ids and positions are all-gathered over the
`context` mesh axis (`attend`); the gather's transpose in the backward pass is a
reduce-scatter, so the gradients are the unsplit ones. Encoder rows routed to a group are
gathered the same way (`gather_rows`), so each placeholder reads its row wherever in the group
it arrived (each row on one of the group's devices: `mllm.exchange_rows`, so the group gathers
its own rows and what it received, each once).

**Strategies** (`mesh.context_strategy`). `gather` (`attend`) is the above: each rank computes
the tiles of the query blocks dealt to it, for every head, against the group's keys and values,
all-gathered every layer (each rank receives (C - 1) / C of the group's K and V; the backward
pass reduce-scatters their gradients). `ulysses` (`ulysses_attend`, DeepSpeed-Ulysses) moves
heads instead of keys: an all-to-all over the context axis turns each rank's queries, keys and
values (its dealt tokens, every head) into the group's every token for heads / C of the heads,
each rank computes the group's whole tile list for its heads, and an all-to-all turns the
output back (four all-to-alls a layer, each moving (C - 1) / C of a rank's tensor; the backward
pass four more). The group's tile list is the union of the ranks' lists, all-gathered (a few
ints) with each rank's local query blocks renumbered into the gathered order (`group_tiles`):
every rank computes every tile for its heads, so the ranks' loads are equal by construction and
the deal's tile balance matters for the gather strategy alone (it still decides which tokens a
rank holds for everything outside attention). The sliding-window layers take the union of the
windowed lists the same way. Fewer key/value heads than the split needs (GQA, kv % C != 0) are
repeated first, each its lcm(kv, C) / kv times, so that every rank receives exactly the KV
heads its query heads read; heads that do not divide C are refused at config load. Heads split
over `tensor` first (where tensor divides them), then over `context`.

A Gated DeltaNet layer carries a state and a short convolution through each document's tokens
in order. Under ulysses (`ulysses_linear`) its inputs go through the same all-to-all (the
fused projection by key head: a key head's convolution channels, its query, key and values,
move whole; beta's and the decay's logits by value head, those of the rank's key heads), the
group's tokens are then permuted from the gathered (rank) order into the group's rows' order
(`group_order`, from the batch's `llm_blocks`: each device's blocks' places in its group's
rows), the layer runs unchanged on its key heads with its parameters' share over those rows,
and the outputs are permuted back and all-to-all'd home. Fewer key heads than the split needs
(k % C != 0, where C divides the value heads) are repeated first, each lcm(k, C) / k times,
every copy with its query and key channels and its r values dealt over the copies in order
(`_repeat_keys`): a rank's value heads with the key head they read; value heads that do not
divide C are refused at config load. The gather strategy cannot run these layers (config
load refuses it).

The kernel is block-sparse attention's (`jaxmllm.models.blocksparse.kernel`: a chunk of tiles
at a time with an online softmax, a flash-style backward), here with the keys of the whole
group: memory follows a chunk, not the device's tiles (one long document's tiles are about
T^2 / (2 block^2)). Within a tile the usual mask applies (same non-padding segment; causal: key
position <= query position, which within a document is the order of the tokens). Without a
mesh (or a `context` axis of 1) nothing is gathered: `attend` is for the split rows only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
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


# ----------------------------------------------------------------------------- ulysses


def _to_heads(x: jax.Array) -> jax.Array:
    """A rank's tokens of every local head [b, T, h, ...] -> the group's tokens (rank order)
    of its h / C heads [b, C T, h / C, ...] (an all-to-all over the context axis)."""
    return jax.lax.all_to_all(x, CONTEXT_AXIS, 2, 1, tiled=True)


def _to_tokens(x: jax.Array) -> jax.Array:
    """`_to_heads`' inverse: [b, C T, h / C, ...] -> [b, T, h, ...]."""
    return jax.lax.all_to_all(x, CONTEXT_AXIS, 1, 2, tiled=True)


def group_tiles(tiles_bk2: jax.Array, blocks: int) -> jax.Array:
    """Inside a shard_map over the context axis: each rank's tile list [b, K, 2] (its local
    query block, a key block of the gathered group) -> the group's [b, C K, 2], every rank's
    tiles with its query blocks renumbered into the gathered order (rank * `blocks` + local
    block; `blocks`: blocks a rank); padding (-1) stays padding."""
    every = jax.lax.all_gather(tiles_bk2, CONTEXT_AXIS, axis=1)  # [b, C, K, 2]
    rank = jnp.arange(every.shape[1], dtype=every.dtype)[None, :, None]
    q = every[..., 0]
    q = jnp.where(q >= 0, q + rank * blocks, q)
    return jnp.stack([q, every[..., 1]], -1).reshape(every.shape[0], -1, 2)


def _head_specs(mesh, heads: int, kv: int):
    """(the batch axes, the spec of [B, T, heads, e] with heads split over tensor where it
    divides heads and kv_heads, as `attend` splits them; and whether it does)."""
    axes = _batch_axes(mesh)
    tensor = mesh.shape.get("tensor", 1)
    split = tensor > 1 and heads % tensor == 0 and kv % tensor == 0
    return axes, PartitionSpec(axes, None, "tensor" if split else None, None), split


def ulysses_attend(
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
    """`attend`'s attention by the ulysses strategy (module docstring): the same arguments
    (each rank's tokens, tile list and positions), the same result [B, T, heads, head_dim];
    the heads a rank holds (those of its tensor rank) must divide over the context group."""
    mesh = jax.sharding.get_abstract_mesh()
    c = context_size()
    if c == 1:
        raise ValueError("context-parallel attention needs a mesh with a context axis > 1")
    axes, hspec, _ = _head_specs(mesh, q_bthe.shape[2], k_bske.shape[2])
    spec = PartitionSpec(axes)
    gather = lambda x: jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)

    def body(q, k, v, seg, pos, tiles):
        if q.shape[2] % c:  # (config load refuses it first, naming model.llm.heads)
            raise ValueError(f"{q.shape[2]} heads a rank do not split over {c} context ranks")
        kv = k.shape[2]
        if kv % c:  # (each KV head repeated to reach the ranks its query heads land on)
            times = math.lcm(kv, c) // kv
            k, v = jnp.repeat(k, times, axis=2), jnp.repeat(v, times, axis=2)
        q, k, v = _to_heads(q), _to_heads(k), _to_heads(v)
        seg, pos = gather(seg), gather(pos)
        every = group_tiles(tiles, seg.shape[1] // c // block)

        def row(q, k, v, seg, pos, tiles):
            return kernel(q, k, v, seg, seg, pos, pos, None, None, tiles, block, causal, window)

        return _to_tokens(jax.vmap(row)(q, k, v, seg, pos, every))

    # (check_vma off: the kernel's scans start from constants, the same on every device)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(hspec, hspec, hspec, spec, spec, spec),
        out_specs=hspec,
        check_vma=False,
    )(q_bthe, k_bske, v_bske, segment_ids_bt, positions_bt, tiles_bk2)


def group_order(blocks_bn: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """The permutation of a context group's gathered tokens (rank by rank, as `_to_heads`
    leaves them) into its rows' order, and its inverse, each [B, C T] (a device's: its
    group's), from each device's blocks' indices in its group's rows [B, blocks a device]
    (`llm_blocks`, `batch.context.Split.deal`): what a layer that reads tokens in order needs
    (`ulysses_linear`); computed once a step."""
    mesh = jax.sharding.get_abstract_mesh()
    spec = PartitionSpec(_batch_axes(mesh))
    tokens = lambda at: (at[..., None] * block + jnp.arange(block, dtype=at.dtype)).reshape(
        at.shape[0], -1
    )

    def body(blocks):
        where = jax.lax.all_gather(blocks, CONTEXT_AXIS, axis=1, tiled=True)  # gathered -> row
        back = jnp.argsort(where, axis=-1).astype(where.dtype)  # row -> gathered
        return tokens(back), tokens(where)

    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec, spec))(blocks_bn)


def _repeat_keys(x: jax.Array, times: int, key_dim: int) -> jax.Array:
    """A Gated DeltaNet's fused channels by key head [..., k, 2 key_dim + r value_dim] ->
    [..., k times, 2 key_dim + r / times value_dim]: each key head `times` times, every copy
    with its query and key, its r values dealt over the copies in order (value heads keep
    their order: the gates' logits and parameters by value head need no change)."""
    if times == 1:
        return x
    qk, v = x[..., : 2 * key_dim], x[..., 2 * key_dim :]
    qk = jnp.repeat(qk[..., None, :], times, axis=-2)  # [..., k, times, 2 key_dim]
    v = v.reshape(*v.shape[:-1], times, -1)  # [..., k, times, r / times value_dim]
    return jnp.concatenate([qk, v], -1).reshape(*x.shape[:-2], -1, qk.shape[-1] + v.shape[-1])


def ulysses_linear(
    mix: Callable[..., jax.Array],
    projected_btkc: jax.Array,
    b_logits_bth: jax.Array,
    a_logits_bth: jax.Array,
    params: tuple[jax.Array, jax.Array, jax.Array],
    segment_ids_bt: jax.Array,
    order: tuple[jax.Array, jax.Array],
    row: int,
    key_dim: int,
) -> jax.Array:
    """A Gated DeltaNet layer's token mixing by the ulysses strategy (module docstring).

    Args:
      mix: (projected, segment ids, b logits, a logits, conv, dt_bias, a_log, key heads, row)
        -> the delta rule's outputs [b, T', k, r, v] over rows of `row` tokens end to end (T'
        tokens, k of the key heads; `deltanet.GatedDeltaNet.mix`).
      projected_btkc: the fused projection's outputs [B, T, key heads, group], each rank's
        dealt tokens.
      b_logits_bth, a_logits_bth: beta's and the decay's logits [B, T, value heads].
      params: the convolution [K, key heads, group], dt_bias and a_log [value heads].
      segment_ids_bt: each token's document [B, T].
      order: `group_order`'s (permutation, inverse) [B, C T].
      row: tokens of a group's row (its rows lie end to end: each restarts the layer's state).
      key_dim: a key head's query (and key) channels, the first two of its group.

    Returns:
      The delta rule's outputs [B, T, key heads, r, value_dim] of each rank's tokens.
    """
    mesh = jax.sharding.get_abstract_mesh()
    keys, c = projected_btkc.shape[2], context_size()
    axes, _, split = _head_specs(mesh, keys, keys)  # (a key head's channels stay whole)
    local = keys // mesh.shape["tensor"] if split else keys  # (a tensor rank's key heads)
    if b_logits_bth.shape[2] // keys * local % c:  # (config load refuses it first)
        raise ValueError(f"a tensor rank's value heads do not split over {c} context ranks")
    times = math.lcm(local, c) // local  # (divides r where c divides the value heads)
    head = "tensor" if split else None
    mine = ("tensor", CONTEXT_AXIS) if split else CONTEXT_AXIS  # (a rank's heads' parameters)
    tokens = PartitionSpec(axes, None, head)
    gather = lambda x: jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)
    in_order = lambda x, at: jnp.take_along_axis(x, at.reshape(at.shape + (1,) * (x.ndim - 2)), 1)

    def body(projected, b, a, conv, dt_bias, a_log, seg, forward, back):
        projected = _repeat_keys(projected, times, key_dim)
        projected, b, a = _to_heads(projected), _to_heads(b), _to_heads(a)
        projected, b, a, seg = (in_order(x, forward) for x in (projected, b, a, gather(seg)))
        out = mix(projected, seg, b, a, conv, dt_bias, a_log, projected.shape[2], row=row)
        out = _to_tokens(in_order(out, back))  # [b, T, local key heads * times, r / times, v]
        return out.reshape(*out.shape[:2], local, -1, out.shape[-1])

    conv, dt_bias, a_log = params
    params = (_repeat_keys(conv, times, key_dim), dt_bias, a_log)

    spec = PartitionSpec(axes)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(
            PartitionSpec(axes, None, head, None),
            tokens,
            tokens,
            PartitionSpec(None, mine, None),
            PartitionSpec(mine),
            PartitionSpec(mine),
            spec,
            spec,
            spec,
        ),
        out_specs=PartitionSpec(axes, None, head, None, None),
        check_vma=False,  # (the delta rule's scans start from zeros, the same everywhere)
    )(projected_btkc, b_logits_bth, a_logits_bth, *params, segment_ids_bt, *order)
