"""The vocabulary dimension sharded: embedding lookups and the loss's logits, vocab-parallel.

A 152k x 3584 table is 2.2 GB in fp32. Under FSDP, XLA's default gathers it whole on every
device for the lookup (and builds its whole gradient there) and gathers the whole output
projection for the logits. Here the table and the projection are split by vocabulary rows over
the model-parallel axes (`fsdp` x `tensor`, a reshard of their stored layout): each device
looks up the ids that fall in its rows (zeros elsewhere) for the tokens of its fsdp group, and
the sum over the group puts every row in place (one device holds each id's row, so the sum is
exact); the loss gathers a slice of hidden states over the group instead of the projection,
and the softmax's max, normaliser and target logit are reduced over the vocabulary shards
(Megatron's vocab-parallel cross entropy). A device then holds 1 / (fsdp x tensor) of the
table, of its gradient and of each slice's logits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sharding import DATA_AXES

MODEL_AXES = ("fsdp", "tensor")  # the vocabulary is split over these, in this order


def vocab_axes(vocab: int, batch: int) -> tuple[str, ...]:
    """The mesh axes the vocabulary splits over here (empty: no mesh, nothing to split, a
    vocabulary they do not divide, or a batch that is not one bucket per data position)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    axes = tuple(a for a in MODEL_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    data = math.prod(mesh.shape[a] for a in DATA_AXES if a in mesh.axis_names)
    if not axes or vocab % math.prod(mesh.shape[a] for a in axes) or batch % data:
        return ()
    return axes


def varying_zero(*inputs: jax.Array, also: tuple[str, ...] = ()) -> jax.Array:
    """A float32 zero that varies over the manual mesh axes its inputs vary over (and `also`):
    a scan's carry must start as varying as the sums its body adds to it, inside this module's
    shard_maps and inside the pipeline's over the stages."""
    axes = set(also)
    for x in inputs:
        axes |= set(jax.typeof(x).manual_axis_type.varying)
    zero = jnp.zeros((), jnp.float32)
    return jax.lax.pcast(zero, tuple(sorted(axes)), to="varying") if axes else zero


def _data_axes(mesh) -> tuple[str, ...]:
    return tuple(a for a in DATA_AXES if a in mesh.axis_names)


def _gather_fsdp(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """The fsdp group's leading rows (the tokens every vocabulary shard of the group serves)."""
    return jax.lax.all_gather(x, "fsdp", axis=0, tiled=True) if "fsdp" in axes else x


def lookup(table_vd: jax.Array, ids: jax.Array, axes: tuple[str, ...], dtype) -> jax.Array:
    """`table[ids]` [*ids.shape, width] with the table split by rows over `axes`; ids lead with
    the data-parallel bucket axis."""
    mesh = jax.sharding.get_abstract_mesh()
    data = _data_axes(mesh)
    table_vd = jax.lax.with_sharding_constraint(table_vd, P(axes, None))

    def body(table_l, ids_l):
        ids_g = _gather_fsdp(ids_l, axes)
        rows = table_l.shape[0]
        local = ids_g - jax.lax.axis_index(axes) * rows
        inside = (local >= 0) & (local < rows)
        found = jnp.take(table_l, jnp.clip(local, 0, rows - 1), axis=0)
        found = jnp.where(inside[..., None], found, 0).astype(dtype)
        if "tensor" in axes:
            found = jax.lax.psum(found, "tensor")
        if "fsdp" in axes:  # each device keeps its own tokens' rows, summed over the group
            found = jax.lax.psum_scatter(found, "fsdp", scatter_dimension=0, tiled=True)
        return found

    return jax.shard_map(body, mesh=mesh, in_specs=(P(axes, None), P(data)), out_specs=P(data))(
        table_vd, ids
    )


def losses(
    weight: jax.Array,
    rows_first: bool,
    divisor: float,
    slices: tuple[jax.Array, jax.Array, jax.Array],
    axes: tuple[str, ...],
) -> jax.Array:
    """Summed masked cross entropy over token slices, the projection split by vocabulary.

    Args:
      weight: the output projection: the tied table [vocab, width] (`rows_first`) or the head
        kernel [width, vocab].
      divisor: logits = h . weight / divisor.
      slices: (hidden [C, D, chunk, width], targets [C, D, chunk], loss mask [C, D, chunk]),
        C slices of every bucket's tokens; D leads the bucket axis, split over the data axes.
      axes: `vocab_axes(...)`.

    Returns:
      The float32 sum of loss * mask over every token, replicated.
    """
    mesh = jax.sharding.get_abstract_mesh()
    data = _data_axes(mesh)
    spec = P(axes, None) if rows_first else P(None, axes)
    weight = jax.lax.with_sharding_constraint(weight, spec)

    def body(w_l, h_l, t_l, m_l):
        cols = w_l.shape[0] if rows_first else w_l.shape[1]
        first = jax.lax.axis_index(axes) * cols
        mine = jax.lax.axis_index("fsdp") if "fsdp" in axes else 0

        @jax.checkpoint
        def one(total, xs):
            h_dcw, t_dc, m_dc = xs
            own = h_dcw.shape[0]
            h_g, t_g = _gather_fsdp(h_dcw, axes), _gather_fsdp(t_dc, axes)
            eq = "dcw,vw->dcv" if rows_first else "dcw,wv->dcv"
            logits = jnp.einsum(eq, h_g, w_l.astype(h_g.dtype),
                                preferred_element_type=jnp.float32) / divisor  # fmt: skip
            # (a constant for the gradient: the softmax does not depend on it; pmax has no JVP)
            top = jax.lax.pmax(jax.lax.stop_gradient(logits.max(-1)), axes)
            norm = jax.lax.psum(jnp.exp(logits - top[..., None]).sum(-1), axes)
            local = t_g - first
            inside = (local >= 0) & (local < cols)
            picked = jnp.take_along_axis(logits, jnp.clip(local, 0, cols - 1)[..., None], -1)
            target = jax.lax.psum(jnp.where(inside, picked[..., 0], 0.0), axes)
            loss = top + jnp.log(norm) - target  # [group rows, chunk]
            loss = jax.lax.dynamic_slice_in_dim(loss, mine * own, own, axis=0)
            return total + jnp.sum(loss * m_dc.astype(jnp.float32)), None

        zero = varying_zero(h_l, also=data)  # (as the sums: psummed over the vocab axes)
        total, _ = jax.lax.scan(one, zero, (h_l, t_l, m_l))
        return jax.lax.psum(total, data)

    batch = P(None, data)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, batch, batch, batch), out_specs=P())(
        weight, *slices
    )
