"""What the balancer works on: each sample's work per phase, and one microbatch's buckets while
they are being filled.

A work vector holds the phases in the table's order (`jaxmllm.config.phases.PHASES`): the LLM's
tokens first, then each encoder phase's units; `ENC` names the encoder phases.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from jaxmllm.config.phases import LLM, NAMES, PHASES
from jaxmllm.data.lengths import LengthsIndex, document_table
from jaxmllm.plan.bins import Cost, Loads, quad_cost, tile_cost
from jaxmllm.plan.contract import Capacities, bucket_tile_caps, span_extras
from jaxmllm.plan.ragged import gather_items
from jaxmllm.plan.route import Routes
from jaxmllm.plan.summary import summary_of
from jaxmllm.plan.tilecap import TileBudget
from jaxmllm.plan.tiles import expected_tiles, packed_density

ENC = NAMES
TILE_SCALE = 16  # selection counts expected tiles in 1/16 tiles, integers like the units
KEEP_EVERY = 1 << 21  # `Phases` keeps every sample's work for indexes of at most this many
_EVERY: dict[tuple, Pool] = {}  # (that work, per index and the capacities it depends on)


class Phases:
    """How much work each sample is per phase, and the per-device capacities it must fit.

    Per-sample work is computed for the samples a step looks at (`of`: its window, its
    deferred ones), from the index's arrays, never for the whole index at once: start-up and
    memory do not grow with the data set. What needs the whole data (the selection's long-run
    mean, the expected tiles' scale) comes from its summary (`summary.summary_of`: a uniform
    sample and its tail; the whole index when it is small, so plans are what they were)."""

    def __init__(self, index: LengthsIndex, caps: Capacities):
        self.caps, self.index = caps, index
        self.sizes = {p: index.items[p].sizes for p in ENC}  # per item
        self.ptr = {p: index.items[p].ptr for p in ENC}  # items of a sample
        self.per_row = dict(caps.per_token)  # units per LLM row (projector output row)
        self.cap = dict(caps.units)  # per device
        self.cap_vec = np.array(
            [caps.llm_rows * caps.llm_row_len, *(caps.units[p] for p in ENC)], np.int64
        )  # [phase]: units per device and microbatch
        # What the packers equalise: attention tiles with block-sparse attention, size**2 else
        self.cost: dict[str, Cost] = {p: quad_cost for p in PHASES}
        if caps.attention_block:
            self.cost = {LLM: tile_cost(caps.attention_block, True)}
            self.cost.update(
                {p: tile_cost(caps.attention_block, False, caps.row_units(p)) for p in ENC}
            )
        # What selection fits into a microbatch (`Selector`): each phase's units, and where
        # the tiles have a capacity (block-sparse attention and a planner that holds it) each
        # such phase's expected tiles too, so that a step takes a mix of samples whose tiles
        # fit as well as their tokens, instead of one the tile capacity then turns away.
        # (per step variant: `sel_caps[variant]`; `sel_cap` the base one's)
        self.sel_caps = [self.cap_vec] * caps.variants
        tile_caps = caps.tile_caps()
        self.tile_phases, self.scale = [], {}
        body = summary_of(index, caps.per_token).body
        if caps.attention_block and any(tile_caps.values()):
            self.tile_phases = [p for p in PHASES if tile_caps[p]]
            self.scale = {p: self._tile_scale(body, p) for p in self.tile_phases}
            self.sel_caps = [self._sel_cap(v) for v in range(caps.variants)]
        self.sel_cap = self.sel_caps[0]
        # Every sample's work, once, where the index is small enough that it costs little
        # memory (a step's then is a gather, as cheap as it was before the summary)
        self.every = None
        if len(index) <= KEEP_EVERY:
            key = (
                id(index),
                *(tuple(sorted(d.items())) for d in (caps.per_token, caps.units)),
                caps.attention_block,
                caps.group_row_len,
                tuple(self.tile_phases),
                caps.bidirectional,
            )
            self.every = _EVERY.get(key)
            if self.every is None:  # (sizing builds several planners on one index)
                self.every = _EVERY[key] = self.of(np.arange(len(index)))
                weakref.finalize(index, _EVERY.pop, key, None)
        # the long-run mean of a sample's selection work (the body's: the index's when small;
        # [sample, column] reduced over samples, as numpy sums it in that layout)
        sel = np.ascontiguousarray(self.of(np.arange(len(body)), body).sel.T)
        self.mean_work = sel.mean(0) if len(sel) else np.ones(len(self.sel_cap))

    def sel_of(self, samples: np.ndarray) -> np.ndarray:
        """The selection work [column, sample] of `samples` (`of`'s, read off `every` where
        that is kept)."""
        if self.every is not None:
            return np.take(self.every.sel, samples, axis=1)
        return self.of(samples).sel

    def of(self, samples: np.ndarray, index: LengthsIndex | None = None) -> Pool:
        """The work of `samples` (of `index`, default the planner's: read off `every` where
        that is kept)."""
        if index is None and self.every is not None:
            return self.every.pick(np.asarray(samples, np.int64))
        index = self.index if index is None else index
        s = np.asarray(samples, np.int64)
        llm = np.asarray(index.text[s], np.int64)
        units, items = [], {}
        for p in ENC:
            owner, _, flat = gather_items(index.items[p].ptr, s)
            size = np.asarray(index.items[p].sizes[flat], np.int64)
            items[p] = (owner, size, self.cost[p](size))
            units.append(np.bincount(owner, size, len(s)).astype(np.int64))
            llm = llm + np.bincount(owner, size // self.per_row[p], len(s)).astype(np.int64)
        split = None if index.split is None else index.split_of(s)
        llm_cost = self._llm_cost(llm, split)
        extra = span_extras(index, s, self.caps)  # (bidirectional spans' tiles, at most)
        if extra is not None:
            llm_cost = llm_cost + extra
        work = np.stack([llm, *units])  # [phase, sample]
        tiles = [
            np.rint(TILE_SCALE * self._expected(llm, llm_cost, items, p)).astype(np.int64)
            for p in self.tile_phases
        ]
        sel = np.concatenate([work, np.stack(tiles)]) if tiles else work
        return Pool(llm, llm_cost, np.ascontiguousarray(work.T), sel, items, split, extra)

    def _llm_cost(self, llm: np.ndarray, split: np.ndarray | None) -> np.ndarray:
        """The LLM cost of samples of `llm` tokens: their documents' (a sample split at
        `split` [samples, K] > 0, a preference pair or a GRPO group, is several documents, each
        attending to itself: the sum of their costs)."""
        cost = self.cost[LLM](llm)
        if split is not None:
            many = np.flatnonzero((split > 0).any(1))
            if len(many):
                cost = np.array(cost, np.float64)
                sizes, real = document_table(llm[many], split[many])
                each = np.asarray(self.cost[LLM](sizes[real]), np.float64)
                cost[many] = np.bincount(np.nonzero(real)[0], each, len(many))
        return cost

    def _sel_cap(self, variant: int) -> np.ndarray:
        """What selection fits into a device's share of a microbatch of a step of `variant`:
        the units, then the tile phases' tiles (in 1/TILE_SCALE tiles; an LLM bucket may be a
        context group of caps.context devices: a device's share of it)."""
        caps, bucket_caps = self.caps, bucket_tile_caps(self.caps, variant)
        tiles = [
            round(TILE_SCALE * bucket_caps[p] / (caps.context if p == LLM else 1))
            for p in self.tile_phases
        ]
        return np.concatenate([self.cap_vec, np.array(tiles, np.int64)])

    def _documents(self, llm: np.ndarray, sizes: np.ndarray, phase: str):
        """(each document's attention rows, causal, a row's length) of a phase: the LLM's
        documents `llm` (`LengthsIndex.llm_documents`), or an encoder phase's item `sizes`."""
        caps = self.caps
        if phase == LLM:
            return llm, True, caps.group_row_len
        per = caps.row_units(phase)
        return sizes // per, False, self.cap[phase] // per

    def _tile_scale(self, body: LengthsIndex, phase: str) -> float:
        """A phase's expected tiles (`tiles.expected_tiles`: each document from a uniformly
        random point of a block) scaled so that the data's total (the body's) is what its
        documents packed back to back need (`tiles.packed_density`: sizes of whole blocks stay
        aligned, which the uniform guess misses)."""
        sizes = body.items[phase].sizes if phase != LLM else None
        llm = body.llm_documents(self.caps.per_token) if phase == LLM else None
        units, causal, row_len = self._documents(llm, sizes, phase)
        t = np.where(units > 0, expected_tiles(units, self.caps.attention_block, causal), 0.0)
        return (
            packed_density(units, row_len, self.caps.attention_block, causal)
            * units.sum()
            / max(t.sum(), 1e-9)
        )

    def _expected(self, llm: np.ndarray, llm_cost: np.ndarray, items: dict, phase: str):
        """Expected attention tiles of each sample (LLM tokens `llm`) in `phase`: its
        documents' `tile_cost` (their cost: `llm_cost`, an item's third field), scaled by
        `_tile_scale`."""
        if phase == LLM:
            return np.where(llm > 0, llm_cost, 0.0) * self.scale[phase]
        owner, size, cost = items[phase]
        t = np.where(size // self.caps.row_units(phase) > 0, cost, 0.0) * self.scale[phase]
        return np.bincount(owner, weights=t, minlength=len(llm))


@dataclass
class Pool:
    """The work of some samples (a step's pool): per sample its LLM tokens, their cost (what
    the packers equalise: its documents'), its units per phase [sample, phase], its selection
    work [column, sample] (the units, then the tile phases' expected tiles), per encoder phase
    its items' (owner position, size, cost), by owner then item, where each splits into
    its documents (`LengthsIndex.split`; None: every sample one document), and the most LLM
    tiles its bidirectional spans add (`contract.span_extras`; None: none)."""

    llm: np.ndarray
    llm_cost: np.ndarray
    work: np.ndarray
    sel: np.ndarray
    items: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    split: np.ndarray | None = None
    extra: np.ndarray | None = None
    _ptr: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # (items_of's)

    def __len__(self) -> int:
        return len(self.llm)

    def longest(self) -> np.ndarray:
        """Each sample's longest LLM document (its tokens, or the longest of its documents)."""
        if self.split is None:
            return self.llm
        sizes, _ = document_table(self.llm, self.split)
        return sizes.max(1)

    def take(self, positions: np.ndarray, sel: bool = True) -> Pool:
        """The work of the samples at `positions` (items left out; and their selection work
        too unless `sel`)."""
        return Pool(
            self.llm[positions],
            self.llm_cost[positions],
            self.work[positions],
            np.take(self.sel, positions, axis=1) if sel else self.sel[:, :0],
            {},
            None if self.split is None else self.split[positions],
            None if self.extra is None else self.extra[positions],
        )

    def items_of(self, phase: str, positions: np.ndarray):
        """The items of the samples at `positions` in a phase: (owner: index into
        `positions`, item number within its sample, size, cost)."""
        owner, size, cost = self.items[phase]
        ptr = self._ptr.get(phase)
        if ptr is None:
            ptr = self._ptr[phase] = np.zeros(len(self) + 1, np.int64)
            np.cumsum(np.bincount(owner, minlength=len(self)), out=ptr[1:])
        at, j, flat = gather_items(ptr, positions)
        return at, j, size[flat], cost[flat]

    def pick(self, positions: np.ndarray) -> Pool:
        """The work of the samples at `positions` (any order), items with them."""
        pool = self.take(positions)
        for p in self.items:
            at, _, size, cost = self.items_of(p, positions)
            pool.items[p] = (at, size, cost)
        return pool


class Micro:
    """Bucket loads and placements of one microbatch while it is being filled."""

    def __init__(self, caps: Capacities, cost: dict[str, Cost] | None = None, variant: int = 0):
        cost = cost or {p: quad_cost for p in PHASES}
        # per LLM row (bucket * rows + row; a bucket is a device or a context group), per device
        # for the encoders
        self.rows = Loads.zeros(caps.llm_buckets * caps.llm_rows, cost[LLM])
        self.enc = {p: Loads.zeros(caps.devices, cost[p]) for p in ENC}
        # exact attention tiles per bucket and phase, within their capacity (block-sparse) in
        # a step of `variant`
        self.tiles = TileBudget(caps, variant) if caps.attention_block else None
        z = np.zeros(0, np.int64)
        self.entries: list[np.ndarray] = [z]  # pool positions placed, in order
        self.row_bin: list[np.ndarray] = [z]  # their LLM row bin (device * rows + row)
        self.row_offset: list[np.ndarray] = [z]  # where each starts in its row
        # per phase: (owner entry, item number, device, offset in its bucket) of placed items
        self.items: dict[str, list[tuple[np.ndarray, ...]]] = {p: [] for p in ENC}
        self.routes = {
            p: Routes(
                caps.devices,
                caps.per_token[p],
                caps.route_pair_capacity,
                caps.units[p],
                caps.context,
            )
            for p in ENC
        }

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
