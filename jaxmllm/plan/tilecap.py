"""The tile capacity of a microbatch's buckets: exact tiles of what is placed, never over.

The packers equalise each bucket's expected tiles (`bins.tile_cost`); the exact count depends on
where in its blocks each document lands, known once a placement is laid out (documents go into
a bin one after another, in the order they were placed: `Balancer._emit`). After each placement
this counts the new documents' exact tiles per device and phase and, where a device would go
over its tile capacity, turns away the samples of the documents past the point where it is
full (the last placed first: they shift nobody in their row). A sample turned away gives up all
its parts, which can shift later documents of other bins, so it counts again until nothing is
over; the samples turned away wait for a later step like any the step could not take.
"""

from __future__ import annotations

import numpy as np

from jaxmllm.config.phases import LLM, PHASES
from jaxmllm.plan.contract import Capacities, bucket_tile_caps
from jaxmllm.plan.ragged import run_cumsum, run_lengths, stable_sort
from jaxmllm.plan.tiles import item_tiles


class TileBudget:
    """Exact tiles per bucket and phase of one microbatch (`used`), and their capacities (an
    LLM bucket is a device, or a context group: `contract.bucket_tile_caps`)."""

    def __init__(self, caps: Capacities):
        self.block = caps.block
        self.caps = bucket_tile_caps(caps)
        self.per_row = {p: caps.row_units(p) for p in PHASES[1:]}  # units per encoder row
        self.per_row[LLM] = 1
        self.llm_rows = caps.llm_rows
        self.used = {p: np.zeros(caps.devices, np.int64) for p in PHASES}
        self.used[LLM] = np.zeros(caps.llm_buckets, np.int64)

    def admit(
        self,
        placed: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
        ok: np.ndarray,
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Turns away (ok = False) the samples whose documents would take a device over its
        tile capacity; counts the tiles of the documents kept.

        Args:
          placed: per phase, the new documents in the order they were placed: (owner sample
            position in `ok`, bin: LLM row bin or encoder device, offset where the bin's
            documents so far end, size in the phase's units).
          ok: per sample, whether all its parts were placed (updated in place).

        Returns:
          (`ok`, per phase each document's offset in its bin: where it starts once the
          documents kept are laid out after the bin's earlier ones; the plan's offsets).
        """
        # (each phase's documents sorted by bin and by device once: a sample turned away only
        # takes its documents' units and tiles out of the running sums)
        docs = {p: _Docs(self, p, *args) for p, args in placed.items()}
        while True:
            over = np.zeros(len(ok), bool)
            for d in docs.values():
                d.count(ok, over)
            if not over.any():
                break
            ok &= ~over
        offsets = {}
        for p, d in docs.items():
            self.used[p] += np.bincount(d.device, d.tiles, len(self.used[p])).astype(np.int64)
            offsets[p] = np.full(len(placed[p][1]), -1, np.int64)
            offsets[p][d.at] = d.offset
        return ok, offsets


class _Docs:
    """One phase's new documents, by bin (in the order placed within a bin) and by device,
    while `TileBudget.admit` turns samples away."""

    def __init__(
        self,
        budget: TileBudget,
        phase: str,
        owner: np.ndarray,
        bins: np.ndarray,
        start: np.ndarray,
        size: np.ndarray,
    ):
        self.budget, self.phase = budget, phase
        self.per, self.causal = budget.per_row[phase], phase == LLM
        self.cap, self.used = budget.caps[phase], budget.used[phase]
        placed = np.flatnonzero(bins >= 0)
        order, self.key = stable_sort(bins[placed], len(start))
        self.at = placed[order]  # (positions in the order placed)
        self.owner, self.size = owner[self.at], size[self.at]
        self.start = start[self.key]  # where the bin's documents so far end
        self.runs = run_lengths(self.key)
        # by device, in the order placed (an LLM device's rows are several bins)
        self.by_device, self.device, self.dev_runs = None, self.key, self.runs
        if self.causal and budget.llm_rows > 1:
            by_device, self.device = stable_sort(bins[placed] // budget.llm_rows, len(self.used))
            rank = np.empty(len(order), np.int64)
            rank[order] = np.arange(len(order))
            self.by_device = rank[by_device]
            self.dev_runs = run_lengths(self.device)
        self.tiles = np.zeros(len(placed), np.int64)
        self.offset = self.start  # (the documents' offsets in their bins, as last counted)

    def count(self, ok: np.ndarray, over: np.ndarray) -> None:
        """The exact tiles of the documents of the samples `ok` (`tiles`, by device), each
        laid out after the bin's earlier ones; marks in `over` the samples of those that take
        their device past its capacity."""
        keep = ok[self.owner]
        size = np.where(keep, self.size, 0)
        offset = run_cumsum(self.key, size, self.runs)
        offset += self.start
        offset -= size
        self.offset = offset
        first = offset // self.per  # (in the phase's attention units)
        t = item_tiles(first, self.size // self.per, self.budget.block, self.causal, first)
        t *= keep
        owner = self.owner
        if self.by_device is not None:
            t, keep, owner = t[self.by_device], keep[self.by_device], owner[self.by_device]
        self.tiles = t
        if self.cap and len(t):
            total = run_cumsum(self.device, t, self.dev_runs)
            total += self.used[self.device]
            over[owner[keep & (total > self.cap)]] = True
