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
from jaxmllm.data.lengths import document_table
from jaxmllm.plan.contract import Capacities, bucket_tile_caps
from jaxmllm.plan.ragged import run_cumsum, run_lengths, run_positions, stable_sort
from jaxmllm.plan.tiles import packed_tiles


class TileBudget:
    """Exact tiles per bucket and phase of one microbatch (`used`), and their capacities (an
    LLM bucket is a device, or a context group: `contract.bucket_tile_caps`) in a step of
    `variant` (`contract.Capacities.tile_caps`)."""

    def __init__(self, caps: Capacities, variant: int = 0):
        self.block = caps.attention_block
        self.caps = bucket_tile_caps(caps, variant)
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
            documents so far end, size in the phase's units[, where each splits into its
            documents: a pair's or a group's text, `LengthsIndex.split`; None or missing: one[,
            the most tiles its bidirectional spans add, `contract.span_extras`; None or
            missing: none]]).
          ok: per sample, whether all its parts were placed (updated in place).

        Returns:
          (`ok`, per phase each document's offset in its bin: where it starts once the
          documents kept are laid out after the bin's earlier ones; the plan's offsets).
        """
        # (each phase's documents sorted by bin once; a sample turned away only changes the
        # bins it had documents in: the passes after the first count those again)
        docs = {p: _Docs(self, p, *args) for p, args in placed.items()}
        gone = None  # (the samples turned away since the last pass; None: all count)
        while True:
            over = np.zeros(len(ok), bool)
            for d in docs.values():
                d.count(ok, over, gone)
            if not over.any():
                break
            ok &= ~over
            gone = over
        offsets = {}
        for p, d in docs.items():
            self.used[p] += d.used(len(self.used[p]))
            offsets[p] = np.full(len(placed[p][1]), -1, np.int64)
            offsets[p][d.at] = d.offset
        return ok, offsets


class _Docs:
    """One phase's new documents, by bin (in the order placed within a bin), while
    `TileBudget.admit` turns samples away."""

    def __init__(
        self,
        budget: TileBudget,
        phase: str,
        owner: np.ndarray,
        bins: np.ndarray,
        start: np.ndarray,
        size: np.ndarray,
        split: np.ndarray | None = None,
        extra: np.ndarray | None = None,
    ):
        self.block, self.per, self.causal = budget.block, budget.per_row[phase], phase == LLM
        self.cap, self.start = budget.caps[phase], start  # (where each bin's documents end)
        self.rows = budget.llm_rows if self.causal else 1  # bins a device
        self.device_used = budget.used[phase]
        placed = np.flatnonzero(bins >= 0)
        order, key = stable_sort(bins[placed], len(start))
        self.at = placed[order]  # (positions in the order placed)
        self.owner, self.size = owner[self.at], size[self.at]
        # (each document's units but the last: the sample splits there, each right after the
        # one before)
        self.split = None if split is None else split[self.at]
        self.extra = None if extra is None else extra[self.at]  # (spans' tiles, at most)
        self.units = self.size // self.per if self.per > 1 else self.size  # (attention units)
        self.bins = _Runs(key)
        # by device, in the order placed (an LLM device's rows are several bins)
        self.by_device = self.devices = None
        if self.rows > 1:
            by_device, device = stable_sort(bins[placed] // self.rows, len(self.device_used))
            rank = np.empty(len(order), np.int64)
            rank[order] = np.arange(len(order))
            self.by_device, self.devices = rank[by_device], _Runs(device)
        self.tiles = np.zeros(len(placed), np.int64)
        self.offset = np.zeros(len(placed), np.int64)  # (offsets in their bins, as last counted)

    def count(self, ok: np.ndarray, over: np.ndarray, gone: np.ndarray | None) -> None:
        """The exact tiles of the documents of the samples `ok` (`tiles`), each laid out after
        the bin's earlier ones, in the bins where samples `gone` had documents (all: None);
        marks in `over` the samples of those that take their device past its capacity."""
        if gone is None:
            idx, runs, r = slice(None), self.bins.all(), slice(None)
        else:
            hit = np.flatnonzero(gone[self.owner])
            if not len(hit):  # (nothing moved here: no document was over either)
                return
            r = np.unique(self.bins.of(hit))
            idx, runs = self.bins.positions(r)
        keep = ok[self.owner[idx]]
        size = np.where(keep, self.size[idx], 0)
        offset = run_cumsum(None, size, runs, base=self.start[self.bins.key[r]])
        offset -= size
        self.offset[idx] = offset
        first = offset // self.per if self.per > 1 else offset
        t = packed_tiles(first, self.units[idx], self.block, self.causal)
        if self.split is not None:  # (several documents: their tiles, back to back)
            many = np.flatnonzero((self.split[idx] > 0).any(1))
            if len(many):
                sizes, real = document_table(self.units[idx][many], self.split[idx][many])
                starts = first[many][:, None] + np.cumsum(sizes, 1) - sizes
                each = packed_tiles(starts[real], sizes[real], self.block, self.causal)
                t[many] = np.bincount(np.nonzero(real)[0], each, len(many)).astype(t.dtype)
        if self.extra is not None:
            t += self.extra[idx]
        t *= keep
        self.tiles[idx] = t
        if not self.cap or not len(t):
            return
        devices = self.bins.key[r]
        if self.devices is not None:  # (the devices of those bins, their documents in order)
            dr = self.devices.runs_of(np.unique(devices // self.rows))
            at, runs = self.devices.positions(dr)
            idx, devices = self.by_device[at], self.devices.key[dr]
            t, keep = self.tiles[idx], ok[self.owner[idx]]
        total = run_cumsum(None, t, runs, base=self.device_used[devices])
        over[self.owner[idx][keep & (total > self.cap)]] = True

    def used(self, buckets: int) -> np.ndarray:
        """The tiles counted, per device (`buckets` of them)."""
        if not len(self.tiles):
            return np.zeros(buckets, np.int64)
        per_bin = np.add.reduceat(self.tiles, self.bins.first)
        return np.bincount(self.bins.key // self.rows, per_bin, buckets).astype(np.int64)


class _Runs:
    """The runs of equal keys of a sorted array: where each starts, its length and key."""

    def __init__(self, keys: np.ndarray):
        starts, self.length = run_lengths(keys)
        self.first = np.concatenate([[0], starts]) if len(keys) else starts
        self.key = keys[self.first]

    def all(self) -> tuple[np.ndarray, np.ndarray]:
        """`run_lengths` of every run."""
        return self.first[1:], self.length

    def of(self, positions: np.ndarray) -> np.ndarray:
        """The run of each of `positions`."""
        return np.searchsorted(self.first, positions, "right") - 1

    def positions(self, runs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the positions of the elements of `runs` (ascending, distinct), their
        `run_lengths`)."""
        length = self.length[runs]
        return run_positions(self.first[runs], length), (np.cumsum(length)[:-1], length)

    def runs_of(self, keys: np.ndarray) -> np.ndarray:
        """The runs of `keys` (each present)."""
        return np.searchsorted(self.key, keys)
