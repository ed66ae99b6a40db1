"""The vocabulary dimension sharded: embedding lookups vocab-parallel (the loss's are in
`jaxmllm.models.loss`).

A 152k x 3584 table is 2.2 GB in fp32. Under FSDP, XLA's default gathers it whole on every
device for the lookup (and builds its whole gradient there) and gathers the whole output
projection for the logits. Here the table and the projection are split by vocabulary rows over
the model-parallel axes (`expert` x `fsdp` x `tensor`, a reshard of their stored layout): each
device looks up the ids that fall in its rows (zeros elsewhere) for the tokens of its group (the
devices of `expert` and `fsdp`, which hold data-parallel buckets of their own), and the sum over
the group puts every row in place (one device holds each id's row, so the sum is
exact); the loss (`jaxmllm.models.loss`) gathers a slice of hidden states over the group
instead of the projection, and reduces the softmax's max, normaliser and target logit over the
vocabulary shards (Megatron's vocab-parallel cross entropy). A device then holds
1 / (expert x fsdp x tensor) of the table, of its gradient and of each slice's logits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sharding import DATA_AXES

MODEL_AXES = ("expert", "fsdp", "tensor")  # the vocabulary is split over these, in this order
# The model axes whose devices hold buckets of their own (a lookup's and the loss's tokens are
# gathered over them, their results scattered back); `tensor`'s devices share their buckets.
GROUP_AXES = ("expert", "fsdp")


def group_axes(axes: tuple[str, ...]) -> tuple[str, ...]:
    """The axes of `axes` (the vocabulary's) over which tokens are gathered: GROUP_AXES'."""
    return tuple(a for a in axes if a in GROUP_AXES)


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


def _data_axes(mesh) -> tuple[str, ...]:
    return tuple(a for a in DATA_AXES if a in mesh.axis_names)


def gather_group(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """The group's leading rows (the tokens every vocabulary shard of the group serves)."""
    group = group_axes(axes)
    return jax.lax.all_gather(x, group, axis=0, tiled=True) if group else x


def scatter_group(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Per-token sums over the group's vocabulary shards, each device keeping its own tokens'."""
    group = group_axes(axes)
    return jax.lax.psum_scatter(x, group, scatter_dimension=0, tiled=True) if group else x


def lookup(table_vd: jax.Array, ids: jax.Array, axes: tuple[str, ...], dtype) -> jax.Array:
    """`table[ids]` [*ids.shape, width] with the table split by rows over `axes`; ids lead with
    the data-parallel bucket axis."""
    mesh = jax.sharding.get_abstract_mesh()
    data = _data_axes(mesh)
    table_vd = jax.lax.with_sharding_constraint(table_vd, P(axes, None))

    def body(table_l, ids_l):
        ids_g = gather_group(ids_l, axes)
        rows = table_l.shape[0]
        local = ids_g - jax.lax.axis_index(axes) * rows
        inside = (local >= 0) & (local < rows)
        # Ids outside this shard look up zeros, and their gradient is dropped rather than
        # added onto one clipped row.
        local = jnp.where(inside, local, rows)
        found = jnp.take(table_l, local, axis=0, mode="fill", fill_value=0).astype(dtype)
        if "tensor" in axes:
            found = jax.lax.psum(found, "tensor")
        return scatter_group(found, axes)  # each device its own tokens' rows, summed

    return jax.shard_map(body, mesh=mesh, in_specs=(P(axes, None), P(data)), out_specs=P(data))(
        table_vd, ids
    )
