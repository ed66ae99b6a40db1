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
from jaxmllm.plan.ragged import run_cumsum, stable_sort
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
    ) -> np.ndarray:
        """Turns away (ok = False) the samples whose documents would take a device over its
        tile capacity; counts the tiles of the documents kept.

        Args:
          placed: per phase, the new documents in the order they were placed: (owner sample
            position in `ok`, bin: LLM row bin or encoder device, offset where the bin's
            documents so far end, size in the phase's units).
          ok: per sample, whether all its parts were placed (updated in place).
        """
        while True:
            tiles, over = {}, np.zeros(len(ok), bool)
            for phase, (owner, bins, start, size) in placed.items():
                keep = ok[owner] & (bins >= 0)
                t, bucket = self._tiles(phase, bins[keep], start, size[keep])
                tiles[phase] = (bucket, t)
                cap = self.caps[phase]
                if cap and len(t):
                    order, key = stable_sort(bucket, len(self.used[phase]))
                    total = run_cumsum(key, t[order]) + self.used[phase][key]
                    over[owner[keep][order[total > cap]]] = True
            if not over.any():
                break
            ok &= ~over
        for phase, (bucket, t) in tiles.items():
            self.used[phase] += np.bincount(bucket, t, len(self.used[phase])).astype(np.int64)
        return ok

    def _tiles(
        self, phase: str, bins: np.ndarray, start: np.ndarray, size: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(exact tiles, device) of documents laid out in order after `start[bin]`."""
        per = self.per_row[phase]
        order, key = stable_sort(bins, len(start))
        s = size[order]
        end = run_cumsum(key, s) + start[key]
        offset = end - s
        t = np.empty(len(bins), np.int64)
        t[order] = item_tiles(offset // per, s // per, self.block, phase == LLM, offset // per)
        device = bins // self.llm_rows if phase == LLM else bins
        return t, device
