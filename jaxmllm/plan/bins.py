"""The bins of one phase: what each holds (units and quadratic cost), and a packing of items
into them in progress.

A bin's `cost` function is the one place that says what the packers equalise across bins
besides the fill: each item's attention (quadratic) cost. With dense attention that is
size**2 in the phase's units (`quad_cost`); with block-sparse attention it is the tiles the
item adds on average (`tile_cost`), which the device computes instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jaxmllm.plan.tiles import expected_tiles

Cost = Callable[[np.ndarray], np.ndarray]  # item sizes -> their quadratic cost (float64)
TABLE_MAX = 1 << 22  # `tile_cost` reads sizes up to this many attention units off a table


def quad_cost(sizes: np.ndarray) -> np.ndarray:
    """The quadratic (attention) cost of items of `sizes` units under dense attention, as
    float64: size**2 (`jaxmllm.cost.model.CostModel` has per-phase coefficients the planners
    do not use yet)."""
    return np.asarray(sizes).astype(np.float64) ** 2


def tile_cost(block: int, causal: bool, per: int = 1) -> Cost:
    """The cost of items under block-sparse attention: the tiles each adds on average
    (`jaxmllm.plan.tiles.expected_tiles`) over its `sizes // per` attention units (read off
    a table of every size up to the largest seen, grown by doubling: the planner prices the
    items of every step's window, and a table look-up is a tenth of the arithmetic)."""
    table = np.zeros(0)

    def cost(sizes: np.ndarray) -> np.ndarray:
        nonlocal table
        units = np.asarray(sizes, np.int64) // per
        top = int(units.max(initial=0))
        if top >= TABLE_MAX:
            return expected_tiles(units, block, causal)
        if top >= len(table):
            table = expected_tiles(np.arange(max(2 * top + 1, 1024)), block, causal)
        return table[units]

    return cost


@dataclass
class Loads:
    """Per bin of one phase: units placed and their quadratic cost (updated as items land)."""

    units: np.ndarray  # int64 [bin]
    quad: np.ndarray  # float64 [bin]
    cost: Cost = field(default=quad_cost)  # an item's quadratic cost from its size

    @classmethod
    def zeros(cls, bins: int, cost: Cost = quad_cost) -> Loads:
        return cls(np.zeros(bins, np.int64), np.zeros(bins), cost)

    def add(self, bins: np.ndarray, sizes: np.ndarray, quad: np.ndarray) -> None:
        """Adds items of `sizes` (and `quad` cost) to `bins`, any bin any number of times."""
        nb = len(self.units)
        self.units += np.bincount(bins, sizes, nb).astype(self.units.dtype)  # (exact: << 2**53)
        self.quad += np.bincount(bins, quad, nb)


@dataclass
class Packing:
    """One phase's items being packed into bins of capacity `cap`."""

    sizes: np.ndarray  # [item] units
    sq: np.ndarray  # [item] quadratic cost (loads.cost)
    home: np.ndarray | None  # [item] the bin each would rather sit in (its text's), or None
    loads: Loads  # the bins' (the caller's: updated in place)
    cap: int  # units per bin
    qstar: float  # each bin's share of the quadratic cost once every item is placed
    out: np.ndarray  # [item] its bin, -1 until placed
    per_host: int = 0  # bins a host (0: one host): an item not at home prefers its home's host

    def place(
        self, idx: np.ndarray, bins: np.ndarray, distinct: bool, sizes: np.ndarray | None = None
    ) -> None:
        """Puts items `idx` into `bins` (`distinct`: no bin twice); `sizes`: theirs, if at hand."""
        self.out[idx] = bins
        sizes = self.sizes[idx] if sizes is None else sizes
        if distinct:
            self.loads.units[bins] += sizes
            self.loads.quad[bins] += self.sq[idx]
        else:
            self.loads.add(bins, sizes, self.sq[idx])
