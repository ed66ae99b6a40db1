"""Logical-axis rules: each logical dimension name maps to one mesh placement.

Arrays name their dims with logical names (``("embed", "mlp")``); ``RULES`` says where each name
lives on the mesh: one axis, a tuple of axes, or None (replicated). One rule per name and no
fallbacks, so a spec can be read off the table. ``validate`` runs at start-up: a table that puts
two dims of one array on the same mesh axis fails there, before anything is compiled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from .mesh import AXES, ShardingError

Rule = str | tuple[str, ...] | None  # mesh axis, axes (major to minor), or None = replicated
Rules = Mapping[str, Rule]
Axes = tuple[str | None, ...]  # one logical name (or None) per array dim

RULES: dict[str, Rule] = {
    # data-parallel buckets (a context rank is one, an expert-parallel rank is one)
    "batch": ("data", "expert", "fsdp", "context"),
    # model width: FSDP shards weights and optimizer state along it, over the expert axis too
    # (its devices hold data-parallel buckets: for every weight but the experts' it is one more
    # data-parallel axis, ZeRO-3 over both, as MaxText shards `embed`)
    "embed": ("expert", "fsdp"),
    "expert_embed": "fsdp",  # a mixture of experts' width (its experts split over `expert`)
    "mlp": "tensor",  # gated-MLP inner width (column split in, row split out)
    "expert": "expert",  # a mixture-of-experts layer's stacked experts (expert parallelism)
    "heads": "tensor",  # query heads
    "kv_heads": "tensor",  # key/value heads (GQA)
    "head_dim": None,  # per-head width, small and used whole by attention
    "vocab": "tensor",  # embedding rows and output logits
    # The embedding table's and output projection's vocabulary when they are split by rows
    # over every model-parallel device (vocab-parallel lookups and loss): expert x fsdp x
    # tensor (the expert axis's devices hold buckets of their own, as fsdp's do)
    "vocab_split": ("expert", "fsdp", "tensor"),
    "patch": None,  # flattened patch pixels into the ViT
    "mel": None,  # mel bins into the audio encoder
    "positions": None,  # rows of an absolute position table (SigLIP, Whisper)
    "layers": None,  # stacked (scanned) layers
    "stage": "stage",  # pipelined layers [stage, layers per stage, ...]: a stage's slab each
}


def logical_to_spec(
    axes: Axes | None, shape: tuple[int, ...], mesh: Mesh, rules: Rules = RULES, path: str = ""
) -> PartitionSpec:
    """Returns the PartitionSpec of an array with these logical axes on this mesh.

    A dim whose size is not divisible by its mesh axes is left unsharded (see ``resolve``).

    Raises:
      ShardingError: Unknown logical name, wrong number of axes, or a mesh axis used twice.
    """
    return resolve(axes, shape, mesh, rules, path)[0]


def resolve(
    axes: Axes | None, shape: tuple[int, ...], mesh: Mesh, rules: Rules = RULES, path: str = ""
) -> tuple[PartitionSpec, tuple[str, ...]]:
    """Like ``logical_to_spec`` but also returns a note per dim left replicated for divisibility.

    A note reads ``"dim 0 (heads) replicated: 6 % 4 != 0 (tensor=4)"``.
    """
    axes = as_axes(axes, len(shape), path)
    entries, notes = [], []
    for dim, (name, size) in enumerate(zip(axes, shape, strict=True)):
        mesh_axes = mesh_axes_of(name, rules, path)
        _check_on_mesh(mesh_axes, mesh, name)
        mesh_axes = _live(mesh_axes, mesh)
        ways = math.prod(mesh.shape[axis] for axis in mesh_axes)
        if size % ways:
            notes.append(
                f"dim {dim} ({name}) replicated: {size} % {ways} != 0 "
                f"({'*'.join(mesh_axes)}={ways})"
            )
            mesh_axes = ()
        entries.append(_entry(mesh_axes))
    spec = PartitionSpec(*entries)
    check_no_duplicate_axes(path, spec, axes)
    return spec, tuple(notes)


def mesh_axes_of(name: str | None, rules: Rules = RULES, path: str = "") -> tuple[str, ...]:
    """Mesh axes a logical name maps to (empty = replicated).

    Raises:
      ShardingError: The name has no rule; the message lists the known names.
    """
    if name is None:
        return ()
    if name not in rules:
        where = f"{path}: " if path else ""
        raise ShardingError(
            f"{where}unknown logical axis {name!r}; known names: "
            f"{', '.join(sorted(rules))} (add a rule or rename the axis)"
        )
    return _as_tuple(rules[name])


def check_no_duplicate_axes(path: str, spec: PartitionSpec, axes: Axes | None = None) -> None:
    """Raises ShardingError when one mesh axis shards two dims of one array.

    Args:
      path: The parameter path, for the message.
      spec: The physical spec of the array.
      axes: The array's logical axes, so the message can name the rule to change.
    """
    seen: dict[str, int] = {}
    for dim, entry in enumerate(spec):
        for axis in _as_tuple(entry):
            if axis in seen:
                raise ShardingError(_duplicate_message(path, axis, seen[axis], dim, axes))
            seen[axis] = dim


def validate(axes_tree: Any, rules: Rules = RULES) -> None:
    """Checks a rules table against every array of an axes tree, without shapes or a mesh.

    Raises:
      ShardingError: A malformed rule, an unknown logical name, or an array with two dims on
        one mesh axis (naming the array path and the rule to change).
    """
    check_rules(rules)
    for path, axes in axes_leaves(axes_tree).items():
        names = as_axes(axes, None, path)
        spec = PartitionSpec(*(_entry(mesh_axes_of(name, rules, path)) for name in names))
        check_no_duplicate_axes(path, spec, names)


def check_rules(rules: Rules) -> None:
    """Raises ShardingError for a rule that is not None, a mesh axis, or distinct mesh axes."""
    for name, rule in rules.items():
        if not _is_rule(rule):
            raise ShardingError(
                f"rule {name!r}: {rule!r} must be None, one of {AXES}, or a tuple of distinct ones"
            )


def is_axes(node: Any) -> bool:
    """Whether a node of an axes tree is a leaf: a tuple of names/None, a PartitionSpec, None."""
    if node is None or isinstance(node, PartitionSpec):
        return True
    return isinstance(node, tuple) and all(isinstance(a, str | None) for a in node)


def as_axes(axes: Axes | PartitionSpec | None, ndim: int | None, path: str = "") -> Axes:
    """Normalises one leaf of an axes tree; None means every dim replicated.

    Raises:
      ShardingError: An entry is not a name/None, or (when ndim is given) the length differs.
    """
    if axes is None:
        return (None,) * (ndim or 0)
    axes = tuple(axes)
    if not all(isinstance(a, str | None) for a in axes):
        raise ShardingError(f"{path}: logical axes {axes!r} must be names or None, one per dim")
    if ndim is not None and len(axes) != ndim:
        raise ShardingError(
            f"{path}: {len(axes)} logical axes {axes!r} for an array of {ndim} dims"
        )
    return axes


def axes_leaves(axes_tree: Any) -> dict[str, Axes | None]:
    """The leaves of an axes tree keyed by path ("llm/layer_0/mlp/wi")."""
    return keyed_leaves(axes_tree, is_leaf=is_axes)


def keyed_leaves(tree: Any, is_leaf: Any = None) -> dict[str, Any]:
    """The leaves of a pytree keyed by their "/"-joined path, in flatten order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return {"/".join(key_parts(keypath)): leaf for keypath, leaf in flat}


def key_parts(keypath: tuple[Any, ...]) -> tuple[str, ...]:
    """A jax key path as plain strings: dict keys, attribute names, sequence indices."""
    return tuple(_key_name(key) for key in keypath)


def _key_name(key: Any) -> str:
    """One key path entry as the plain name a path string shows ('blocks', '0'), whatever jax key
    type holds it."""
    for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _duplicate_message(path: str, axis: str, first: int, second: int, axes: Axes | None) -> str:
    """Why one mesh axis cannot shard two dims of the array at `path`, and the rule to change:
    another logical name when the two dims share one, else the rule of either name."""
    where = f"{path}: " if path else ""
    message = f"{where}mesh axis {axis!r} would shard both dim {first} and dim {second}"
    if axes is None:
        return message + "; each mesh axis may shard at most one dim of an array"
    a, b = axes[first], axes[second]
    if a == b:
        return (
            message + f" (both logical {a!r}); give one of these dims another logical name "
            "with its own rule"
        )
    return (
        message + f" (logical {a!r} and {b!r}); change the rule for {b!r} (or {a!r}) so the "
        "two map to different mesh axes"
    )


def _check_on_mesh(mesh_axes: tuple[str, ...], mesh: Mesh, name: str | None) -> None:
    """Raises ShardingError when the rule for `name` uses a mesh axis this mesh lacks (a mesh
    built with other axis names than AXES)."""
    missing = [axis for axis in mesh_axes if axis not in mesh.shape]
    if missing:
        raise ShardingError(
            f"rule {name!r} uses mesh axes {missing} not in the mesh {tuple(mesh.axis_names)}"
        )


def _live(mesh_axes: tuple[str, ...], mesh: Mesh) -> tuple[str, ...]:
    """A rule of several mesh axes less those of size 1 (they split nothing): `embed`'s
    (expert, fsdp) reads `fsdp` on a mesh without expert parallelism; all of size 1: the last."""
    if len(mesh_axes) < 2:
        return mesh_axes
    live = tuple(a for a in mesh_axes if mesh.shape[a] > 1)
    return live or mesh_axes[-1:]


def _is_rule(rule: Any) -> bool:
    """Whether `rule` is a valid rule: None (replicated), one of AXES, or a tuple of distinct
    ones."""
    if not isinstance(rule, str | tuple | None):
        return False
    mesh_axes = _as_tuple(rule)
    return len(set(mesh_axes)) == len(mesh_axes) and all(axis in AXES for axis in mesh_axes)


def _as_tuple(rule: Rule) -> tuple[str, ...]:
    """A rule as its mesh axes, major to minor: () for None, (axis,) for one."""
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else tuple(rule)


def _entry(mesh_axes: tuple[str, ...]) -> Rule:
    """A PartitionSpec entry: None, one axis name, or a tuple of them."""
    if not mesh_axes:
        return None
    return mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes
