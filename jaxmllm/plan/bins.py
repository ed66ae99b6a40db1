"""The bins of one phase: what each holds (units and quadratic cost), and a packing of items
into them in progress.

`quad_cost` is the one place that says what the packers equalise across bins besides the fill:
each item's attention (quadratic) cost, size**2 in the phase's units.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def quad_cost(sizes: np.ndarray) -> np.ndarray:
    """The quadratic (attention) cost of items of `sizes` units, as float64: size**2.

    The same in every phase for now (`jaxmllm.data.cost.CostModel` has the per-phase
    coefficients the planners do not use yet)."""
    return sizes.astype(np.float64) ** 2


@dataclass
class Loads:
    """Per bin of one phase: units placed and their quadratic cost (updated as items land)."""

    units: np.ndarray  # int64 [bin]
    quad: np.ndarray  # float64 [bin]

    @classmethod
    def zeros(cls, bins: int) -> Loads:
        return cls(np.zeros(bins, np.int64), np.zeros(bins))

    def add(self, bins: np.ndarray, sizes: np.ndarray, quad: np.ndarray) -> None:
        """Adds items of `sizes` (and `quad` cost) to `bins`, any bin any number of times."""
        nb = len(self.units)
        self.units += np.bincount(bins, sizes, nb).astype(self.units.dtype)  # (exact: << 2**53)
        self.quad += np.bincount(bins, quad, nb)


@dataclass
class Packing:
    """One phase's items being packed into bins of capacity `cap`."""

    sizes: np.ndarray  # [item] units
    sq: np.ndarray  # [item] quadratic cost (quad_cost)
    home: np.ndarray | None  # [item] the bin each would rather sit in (its text's), or None
    loads: Loads  # the bins' (the caller's: updated in place)
    cap: int  # units per bin
    qstar: float  # each bin's share of the quadratic cost once every item is placed
    out: np.ndarray  # [item] its bin, -1 until placed

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
