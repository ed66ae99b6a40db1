"""What the balancer works on: each sample's work per phase, and one microbatch's buckets while
they are being filled.

A work vector holds the phases in the table's order (`jaxmllm.config.phases.PHASES`): the LLM's
tokens first, then each encoder phase's units; `ENC` names the encoder phases.
"""

from __future__ import annotations

import numpy as np

from jaxmllm.config.phases import LLM, NAMES, PHASES
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.plan.bins import Cost, Loads, quad_cost, tile_cost
from jaxmllm.plan.contract import Capacities, bucket_tile_caps
from jaxmllm.plan.route import Routes
from jaxmllm.plan.tilecap import TileBudget
from jaxmllm.plan.tiles import expected_tiles, packed_density

ENC = NAMES
TILE_SCALE = 16  # selection counts expected tiles in 1/16 tiles, integers like the units


class Phases:
    """The index's work per sample and phase, and the per-device capacities it must fit."""

    def __init__(self, index: LengthsIndex, caps: Capacities):
        self.caps = caps
        self.work = index.work(caps.per_token)  # [sample, phase]
        self.llm = np.ascontiguousarray(self.work[:, 0])  # LLM tokens per sample
        self.sizes = {p: index.items[p].sizes for p in ENC}  # per item
        self.ptr = {p: index.items[p].ptr for p in ENC}  # items of a sample
        self.per_row = dict(caps.per_token)  # units per LLM row (projector output row)
        self.cap = dict(caps.units)  # per device
        self.work_t = np.ascontiguousarray(self.work.T)  # [phase, sample], for fast columns
        self.cap_vec = np.array(
            [caps.llm_rows * caps.llm_row_len, *(caps.units[p] for p in ENC)], np.int64
        )  # [phase]: units per device and microbatch
        # What the packers equalise: attention tiles with block-sparse attention, size**2 else
        self.cost: dict[str, Cost] = {p: quad_cost for p in PHASES}
        if caps.block:
            self.cost = {LLM: tile_cost(caps.block, True)}
            self.cost.update({p: tile_cost(caps.block, False, caps.row_units(p)) for p in ENC})
        # ... of each sample's text and each item, once (the packers' and loads' `sq`)
        self.llm_cost = self.cost[LLM](self.llm)
        self.item_cost = {p: self.cost[p](self.sizes[p]) for p in ENC}
        # What selection fits into a microbatch (`Selector`): each phase's units, and where
        # the tiles have a capacity (block-sparse attention and a planner that holds it) each
        # such phase's expected tiles too, so that a step takes a mix of samples whose tiles
        # fit as well as their tokens, instead of one the tile capacity then turns away.
        self.sel_work, self.sel_cap = self.work, self.cap_vec
        # per bucket (an LLM bucket may be a context group of caps.context devices)
        bucket_caps = bucket_tile_caps(caps)
        tile_caps = caps.tile_caps()
        if caps.block and any(tile_caps.values()):
            self.tile_phases = [p for p in PHASES if tile_caps[p]]
            cols, caps_t = [], []
            for p in self.tile_phases:
                cols.append(np.rint(TILE_SCALE * self._expected(index, p)).astype(np.int64))
                per_device = bucket_caps[p] / (caps.context if p == LLM else 1)
                caps_t.append(round(TILE_SCALE * per_device))
            self.sel_work = np.concatenate([self.work, np.stack(cols, 1)], 1)
            self.sel_cap = np.concatenate([self.cap_vec, np.array(caps_t, np.int64)])
        else:
            self.tile_phases = []
        self.sel_work_t = np.ascontiguousarray(self.sel_work.T)

    def _expected(self, index: LengthsIndex, phase: str) -> np.ndarray:
        """Expected attention tiles of each sample in `phase`: `tiles.expected_tiles` (each
        document from a uniformly random point of a block), scaled per phase so that the data's
        total is what its documents packed back to back need (`tiles.packed_density`: sizes of
        whole blocks stay aligned, which the uniform guess misses)."""
        b, caps = self.caps.block, self.caps
        if phase == LLM:
            units, causal, row_len, t = self.llm, True, caps.llm_bin_len, None
        else:
            per = caps.row_units(phase)
            units, causal, row_len = self.sizes[phase] // per, False, self.cap[phase] // per
        t = np.where(units > 0, expected_tiles(units, b, causal), 0.0)
        scale = packed_density(units, row_len, b, causal) * units.sum() / max(t.sum(), 1e-9)
        t = t * scale
        if phase == LLM:
            return t
        ptr = self.ptr[phase]
        owner = np.repeat(np.arange(len(ptr) - 1), np.diff(ptr))
        return np.bincount(owner, weights=t, minlength=len(ptr) - 1)


class Micro:
    """Bucket loads and placements of one microbatch while it is being filled."""

    def __init__(self, caps: Capacities, cost: dict[str, Cost] | None = None):
        cost = cost or {p: quad_cost for p in PHASES}
        # per LLM row (bucket * rows + row; a bucket is a device or a context group), per device
        # for the encoders
        self.rows = Loads.zeros(caps.llm_buckets * caps.llm_rows, cost[LLM])
        self.enc = {p: Loads.zeros(caps.devices, cost[p]) for p in ENC}
        # exact attention tiles per bucket and phase, within their capacity (block-sparse)
        self.tiles = TileBudget(caps) if caps.block else None
        z = np.zeros(0, np.int64)
        self.entries: list[np.ndarray] = [z]  # pool positions placed, in order
        self.row_bin: list[np.ndarray] = [z]  # their LLM row bin (device * rows + row)
        self.row_offset: list[np.ndarray] = [z]  # where each starts in its row
        # per phase: (owner entry, item number, device, offset in its bucket) of placed items
        self.items: dict[str, list[tuple[np.ndarray, ...]]] = {p: [] for p in ENC}
        self.routes = {
            p: Routes(caps.devices, caps.per_token[p], caps.route_pair_capacity, caps.units[p],
                      caps.context)
            for p in ENC
        }  # fmt: skip

    def used_selected(self, phases: Phases) -> np.ndarray:
        """What `used` counts plus, for the phases selection counts tiles of, the exact tiles
        placed (over all devices, in selection's 1/TILE_SCALE tiles)."""
        if not phases.tile_phases:
            return self.used()
        tiles = [TILE_SCALE * self.tiles.used[p].sum() for p in phases.tile_phases]
        return np.concatenate([self.used(), np.array(tiles, np.int64)])

    def used(self) -> np.ndarray:
        """Units placed in each phase (the LLM's, then each encoder's), over all devices."""
        return np.array([self.rows.units.sum(), *(self.enc[p].units.sum() for p in ENC)])
