"""Shardings for parameters, optimizer state and step batches, and multi-host batch assembly.

Parameters: an axes tree mirrors the parameter tree; each leaf is a tuple of logical names, one
per dim (or None: replicated). ``rules.RULES`` turns names into mesh axes.

Batches: every step array has shape [M, D, ...]: M microbatches (unsharded), then D data-parallel
buckets split over ("data", "expert", "fsdp", "context") and replicated over "tensor".
Data-parallel position p (0 <= p < data * expert * fsdp * context, data-major, so a context
group's ranks are consecutive) holds D / (data * fsdp * context) consecutive rows of D.

Multi-process contract for ``make_global_batch``: each process passes only the rows of D that
belong to the data-parallel positions of its own devices, ``local_dp_indices(mesh)``, in that
ascending order, each position's rows contiguous. With one process that is the whole batch.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .mesh import DATA_AXES, ShardingError, data_parallel_size
from .rules import RULES, Rules, axes_leaves, key_parts, keyed_leaves, resolve, validate


def param_shardings(axes_tree: Any, abstract_params: Any, mesh: Mesh, rules: Rules = RULES) -> Any:
    """Returns a NamedSharding per parameter, in the structure of ``abstract_params``.

    Args:
      axes_tree: Same structure as the params; leaves are tuples of logical names (or None).
      abstract_params: Arrays or ``jax.ShapeDtypeStruct`` (e.g. from ``jax.eval_shape``).
      mesh: The device mesh.
      rules: Logical name -> mesh axes.

    Raises:
      ShardingError: The trees differ, or the rules fail ``rules.validate``.
    """
    validate(axes_tree, rules)
    shardings = [
        NamedSharding(mesh, resolve(axes, leaf.shape, mesh, rules, path)[0])
        for path, (axes, leaf) in _pair(axes_tree, abstract_params).items()
    ]
    return jax.tree_util.tree_structure(abstract_params).unflatten(shardings)


def opt_state_shardings(
    optimizer: optax.GradientTransformation,
    abstract_opt_state: Any,
    param_shardings: Any,
    mesh: Mesh,
) -> Any:
    """Shardings for an optimizer state: param-shaped parts follow the params, the rest replicated.

    A state leaf whose key path ends with a parameter's path (``.../mu/llm/embed``) is that
    parameter's copy (Adam's mu/nu, accumulated gradients) and gets its sharding, unless the
    sharding does not fit the leaf's shape (e.g. factored statistics). Everything else (counts,
    hyperparameters) is replicated; masked-out parts (``optax.MaskedNode``) stay as they are.
    Matching paths, rather than ``optax.tree_map_params``, means ``optimizer.init`` is not re-run
    on a placeholder, which fails for masks and ``multi_transform`` labels that look at params.

    Args:
      optimizer: The transformation that built the state; the paths carry all that is needed,
        so it is only named for the reader.
      abstract_opt_state: ``jax.eval_shape(optimizer.init, abstract_params)``.
      param_shardings: From ``param_shardings``.
      mesh: The device mesh.
    """
    del optimizer
    by_path = {
        key_parts(keypath): sharding
        for keypath, sharding in jax.tree_util.tree_flatten_with_path(param_shardings)[0]
    }
    fallback = replicated(mesh)

    def pick(keypath: tuple[Any, ...], leaf: Any) -> NamedSharding:
        """The sharding of the parameter whose path ends like this state leaf's (Adam's moments
        mirror their parameters), if it fits the leaf's shape; else replicated (counts, scalars,
        factored statistics of another shape)."""
        sharding = _longest_suffix(key_parts(keypath), by_path)
        return sharding if sharding is not None and _fits(sharding, leaf.shape) else fallback

    return jax.tree_util.tree_map_with_path(pick, abstract_opt_state)


def describe(axes_tree: Any, abstract_params: Any, mesh: Mesh, rules: Rules = RULES) -> str:
    """A start-up table: per parameter its logical -> physical sharding, plus totals.

    Columns: path, shape, dtype, logical axes, PartitionSpec, per-device shape, and a note for
    dims left replicated because their size does not divide the mesh axis.
    """
    rows = [("path", "shape", "dtype", "logical", "spec", "per device", "note")]
    n_params = n_bytes = n_device_bytes = 0
    for path, (axes, leaf) in _pair(axes_tree, abstract_params).items():
        spec, notes = resolve(axes, leaf.shape, mesh, rules, path)
        local = NamedSharding(mesh, spec).shard_shape(leaf.shape)
        rows.append(
            (
                path,
                _dims(leaf.shape),
                str(leaf.dtype),
                _names(axes),
                _spec(spec),
                _dims(local),
                "; ".join(notes),
            )
        )
        n_params += int(np.prod(leaf.shape))
        n_bytes += int(np.prod(leaf.shape)) * leaf.dtype.itemsize
        n_device_bytes += int(np.prod(local)) * leaf.dtype.itemsize
    mesh_text = " ".join(f"{axis}={size}" for axis, size in mesh.shape.items())
    total = (
        f"{len(rows) - 1} arrays, {n_params:,} parameters, {_mib(n_bytes)} in all, "
        f"{_mib(n_device_bytes)} per device (mesh {mesh_text})"
    )
    return "\n".join([*_table(rows), total])


def replicated(mesh: Mesh) -> NamedSharding:
    """The fully replicated sharding (scalars, step counters, RNG keys)."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int, device_axis: int = 1) -> NamedSharding:
    """Sharding of a step array [M, D, ...]: D over ("data", "expert", "fsdp", "context"), the
    rest unsharded."""
    if not 0 <= device_axis < ndim:
        raise ShardingError(f"a batch array of {ndim} dims has no device axis {device_axis}")
    entries: list[Any] = [None] * ndim
    entries[device_axis] = DATA_AXES
    return NamedSharding(mesh, PartitionSpec(*entries))


def local_dp_indices(mesh: Mesh, process_index: int | None = None) -> np.ndarray:
    """Data-parallel positions (indices into D's buckets) that this process's devices hold.

    Args:
      mesh: The device mesh.
      process_index: Which process; default ``jax.process_index()``.

    Returns:
      Ascending int array; every position once even if several local devices share it (tensor).
    """
    process = jax.process_index() if process_index is None else process_index
    names = list(mesh.axis_names)
    order = [names.index(axis) for axis in DATA_AXES if axis in names]
    order += [i for i, name in enumerate(names) if name not in DATA_AXES]
    grid = np.transpose(mesh.devices, order).reshape(data_parallel_size(mesh), -1)
    mine = [p for p, row in enumerate(grid) if any(d.process_index == process for d in row)]
    return np.asarray(mine, dtype=np.int64)


def make_global_batch(
    host_batch: dict[str, np.ndarray], mesh: Mesh, device_axis: int = 1
) -> dict[str, jax.Array]:
    """Assembles global step arrays from this process's rows (see the module docstring).

    Args:
      host_batch: name -> [M, D_local, ...] with D_local = k * len(local_dp_indices(mesh)).
      mesh: The device mesh.
      device_axis: The D axis.

    Returns:
      name -> global array [M, k * data * expert * fsdp * context, ...] sharded by
      ``batch_sharding``.
    """
    n_local = len(local_dp_indices(mesh))
    out = {}
    for name, local in host_batch.items():
        sharding = batch_sharding(mesh, local.ndim, device_axis)
        shape = _global_shape(name, local.shape, device_axis, n_local, data_parallel_size(mesh))
        out[name] = jax.make_array_from_process_local_data(sharding, local, shape)
    return out


def _global_shape(
    name: str, local_shape: tuple[int, ...], device_axis: int, n_local: int, dp: int
) -> tuple[int, ...]:
    """The global shape of one batch array from this process's local one: its device axis holds
    `n_local` of the `dp` data-parallel positions, so it grows to `dp` of them. Raises
    ShardingError when that axis does not split evenly over the local positions."""
    if len(local_shape) <= device_axis or local_shape[device_axis] % n_local:
        raise ShardingError(
            f"batch[{name!r}] of shape {local_shape}: axis {device_axis} must "
            f"hold a multiple of this process's {n_local} data-parallel positions"
        )
    shape = list(local_shape)
    shape[device_axis] = local_shape[device_axis] // n_local * dp
    return tuple(shape)


def _pair(axes_tree: Any, abstract_params: Any) -> dict[str, tuple[Any, Any]]:
    """path -> (logical axes, abstract array); the two trees must have the same paths."""
    axes = axes_leaves(axes_tree)
    params = keyed_leaves(abstract_params)
    if axes.keys() != params.keys():
        raise ShardingError(
            "the axes tree does not match the params: params without axes "
            f"{sorted(params.keys() - axes.keys())}, axes without a param "
            f"{sorted(axes.keys() - params.keys())}"
        )
    return {path: (axes[path], leaf) for path, leaf in params.items()}


def _longest_suffix(parts: tuple[str, ...], by_path: dict[tuple[str, ...], Any]) -> Any:
    """The value whose path is the longest suffix of ``parts``, or None."""
    for start in range(len(parts)):
        if parts[start:] in by_path:
            return by_path[parts[start:]]
    return None


def _fits(sharding: NamedSharding, shape: tuple[int, ...]) -> bool:
    """Whether the sharding's spec applies to an array of this shape."""
    spec = sharding.spec
    if len(spec) > len(shape):
        return False
    mesh_shape = sharding.mesh.shape
    for size, entry in zip(shape, spec, strict=False):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        if size % int(np.prod([mesh_shape[a] for a in axes])):
            return False
    return True


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows of cells as text lines, each column padded to its widest cell (two spaces apart)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _dims(shape: tuple[int, ...]) -> str:
    """A shape as `describe` prints it: '(2, 128, 64)'."""
    return str(tuple(shape))


def _names(axes: Any) -> str:
    """Logical axes as `describe` prints them: '(layers, embed)', '-' for none (replicated)."""
    return "-" if axes is None else "(" + ", ".join(str(a) for a in axes) + ")"


def _spec(spec: PartitionSpec) -> str:
    """A PartitionSpec as `describe` prints it: 'P(None, fsdp+expert)', axes of one dim joined by
    '+'."""
    show = lambda e: "None" if e is None else e if isinstance(e, str) else "+".join(e)
    return "P(" + ", ".join(show(e) for e in spec) + ")"


def _mib(n_bytes: int) -> str:
    """Bytes in MiB with two decimals, for `describe`'s totals."""
    return f"{n_bytes / 2**20:.2f} MiB"
