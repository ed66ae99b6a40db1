"""Where a pipelined stack's layers live: `[depth, ...]` (checkpoints, the unpipelined model) and
`[stage, slots, ...]` (the pipelined train state, the stage dim split over the `stage` axis).

Stage s holds its segment's layers first_s .. first_s + n_s - 1 in slots 0 .. n_s - 1; its other
slots (up to the largest stage's count) are padding: zeros that no layer reads, so their
gradients, Adam moments and weight decay stay zero, and a stage of another segment holds only
padding of this one. Any leaf of any tree (parameters, optimizer state) whose path passes
through a pipelined stack (`llm/transformer/blocks/...`, also under `opt_state/.../mu/`) is
converted; everything else is left as it is. Checkpoints hold the `[depth, ...]` form, so they
do not depend on the stage count: a run resumes under another one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmllm.pipeline.partition import Plan
from sharding.rules import is_axes, key_parts

STACK = ("transformer", "blocks")  # under a segment's module: its stacked (scanned) layers


@dataclasses.dataclass(frozen=True)
class Layout:
    """Per pipelined segment, per stage: (first layer, layers) — (0, 0) off the segment."""

    stages: int
    spans: dict[str, tuple[tuple[int, int], ...]]

    @classmethod
    def of(cls, plan: Plan) -> Layout:
        """The layout of a pipeline partition: for each segment, each stage's first layer and
        count ((0, 0) on the stages holding another segment)."""
        spans: dict[str, list[tuple[int, int]]] = {}
        for s, stage in enumerate(plan.stages):
            spans.setdefault(stage.segment, [(0, 0)] * len(plan.stages))[s] = (
                stage.first,
                stage.layers,
            )
        return cls(len(plan.stages), {k: tuple(v) for k, v in spans.items()})

    def slots(self, segment: str) -> int:
        """The layer slots every stage holds for `segment`: its largest stage's layers (smaller
        stages padded)."""
        return max(n for _, n in self.spans[segment])

    def counts(self, segment: str) -> np.ndarray:
        """Layers per stage [S] (0 where the stage holds another segment)."""
        return np.array([n for _, n in self.spans[segment]], np.int32)

    def depth(self, segment: str) -> int:
        """The segment's layers over all stages: its stack's depth."""
        return int(self.counts(segment).sum())

    def gather_index(self, segment: str) -> tuple[np.ndarray, np.ndarray]:
        """For [S, slots]: the depth index each slot holds, and whether it holds one."""
        slots = self.slots(segment)
        idx = np.zeros((self.stages, slots), np.int32)
        used = np.zeros((self.stages, slots), bool)
        for s, (first, n) in enumerate(self.spans[segment]):
            idx[s, :n] = np.arange(first, first + n)
            used[s, :n] = True
        return idx, used

    def segment_of(self, path: tuple[str, ...]) -> str | None:
        """The pipelined segment a leaf's path passes through (its stacked layers), if any."""
        for i in range(len(path) - len(STACK)):
            if path[i] in self.spans and path[i + 1 : i + 1 + len(STACK)] == STACK:
                return path[i]
        return None

    # ---------------------------------------------------------------- conversions (traceable)

    def to_stages(self, tree: Any) -> Any:
        """[depth, ...] -> [stage, slots, ...] for every leaf under a pipelined stack."""

        def convert(leaf, idx, used):
            """A [depth, ...] leaf as [stage, slots, ...]: each slot's layer gathered, the
            padding slots zero."""
            taken = jnp.take(leaf, jnp.asarray(idx), axis=0)
            mask = jnp.asarray(used).reshape(used.shape + (1,) * (leaf.ndim - 1))
            return jnp.where(mask, taken, jnp.zeros((), leaf.dtype))

        return self._per_segment(tree, convert)

    def to_depth(self, tree: Any) -> Any:
        """[stage, slots, ...] -> [depth, ...]: the inverse of `to_stages` (padding dropped)."""

        def convert(leaf, idx, used):
            """A [stage, slots, ...] leaf as [depth, ...]: the used slots' rows, in depth order."""
            flat = np.flatnonzero(used.reshape(-1))[np.argsort(idx.reshape(-1)[used.reshape(-1)])]
            rows = leaf.reshape((-1,) + leaf.shape[2:])
            return jnp.take(rows, jnp.asarray(flat), axis=0)

        return self._per_segment(tree, convert)

    def _per_segment(self, tree: Any, convert) -> Any:
        """`convert(leaf, gather index, used)` on every leaf under a pipelined stack."""

        def at(keypath, leaf):
            """The leaf converted when its path runs through a pipelined stack, else as it is."""
            seg = self.segment_of(key_parts(keypath))
            return leaf if seg is None else convert(leaf, *self.gather_index(seg))

        return jax.tree_util.tree_map_with_path(at, tree)

    def axes(self, axes_tree: Any) -> Any:
        """Logical axes of the [stage, slots, ...] form: 'stage' before a stack's 'layers'."""

        def convert(keypath, axes):
            """A stacked leaf's logical axes with 'stage' in front; other leaves' as they are.
            Raises ValueError for a stack whose axes do not start with 'layers'."""
            if self.segment_of(key_parts(keypath)) is None:
                return axes
            if not axes or axes[0] != "layers":
                raise ValueError(
                    f"{'/'.join(key_parts(keypath))}: stacked axes {axes} lack 'layers'"
                )
            return ("stage", *axes)

        return jax.tree_util.tree_map_with_path(convert, axes_tree, is_leaf=is_axes)

    def in_spec(self, tree: Any) -> Any:
        """Per leaf, the stage axis's placement inside the pipeline's shard_map: the stage dim
        of a pipelined stack, nothing (replicated over stages) otherwise."""
        spec = jax.sharding.PartitionSpec
        return jax.tree_util.tree_map_with_path(
            lambda kp, _: spec("stage") if self.segment_of(key_parts(kp)) else spec(), tree
        )
