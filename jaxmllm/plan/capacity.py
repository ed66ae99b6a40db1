"""Capacity planning: per-device bucket sizes that match the data's modality ratios.

Given a lengths index and a target number of LLM tokens per device and microbatch, suggest the
LLM row shape and each encoder phase's capacity so that every phase fills at the same rate
(capacity_p / capacity_llm = total_p / total_llm over the data), each at least the largest
sample's need, all on a small ladder of shapes (8 values per octave: {8..15} x 2^k, so a rounded
capacity is within 6% of the ideal and a handful of configs share compiled shapes). Since every
capacity is rounded, `match_llm=True` lets the LLM bucket move one ladder step from the target
when that brings the phases' demands closer together (the phase whose demand runs ahead binds
first; the others can fill only up to their demand relative to it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from jaxmllm.config.phases import BY_NAME, LLM, NAMES, PHASES
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.plan.contract import (
    Capacities,
    Planner,
    device_tile_caps,
    documents,
    pair_rows,
    step_documents,
    step_tiles,
)
from jaxmllm.plan.select import BINDING
from jaxmllm.plan.tiles import own_tiles, packed_density


def ladder_values(lo: int = 32, hi: int = 1 << 22, per_octave: int = 8) -> np.ndarray:
    """The shape ladder: m * 2**k for m in [per_octave, 2*per_octave), between lo and hi."""
    out = []
    k = 0
    while per_octave << k <= hi:
        out += [m << k for m in range(per_octave, 2 * per_octave)]
        k += 1
    v = np.array(sorted(set(out)), np.int64)
    return v[(v >= lo) & (v <= hi)]


def ladder_up(x: float, per_octave: int = 8, multiple: int = 32) -> int:
    """Smallest ladder value >= x (and a multiple of `multiple`)."""
    v = _ladder(per_octave, multiple, x)
    return int(v[np.searchsorted(v, x)])


def ladder_nearest(x: float, per_octave: int = 8, multiple: int = 32) -> int:
    """Ladder value nearest to x in ratio."""
    v = _ladder(per_octave, multiple, x)
    i = int(np.clip(np.searchsorted(v, x), 1, len(v) - 1))
    lo, hi = v[i - 1], v[i]
    return int(lo if x > 0 and math.log(x / lo) < math.log(hi / x) else hi)


def _ladder(per_octave: int, multiple: int, x: float = 0) -> np.ndarray:
    """The ladder's multiples of `multiple`, up to 2^22 or on past x (a row of 8M tokens, the
    patches of a sample with a thousand images: the shape is large, not a crash)."""
    top = 22 if x <= 1 << 22 else math.ceil(math.log2(x)) + 1
    v = ladder_values(hi=1 << top, per_octave=per_octave)
    return v[v % multiple == 0]


@dataclass(frozen=True)
class CapacitySuggestion:
    """Per device and microbatch bucket sizes (the batch.* keys of the same names)."""

    llm_rows: int
    llm_row_len: int
    units: dict[str, int]  # per encoder phase, its bucket (0 when the data has none of it)
    demand: dict  # per phase: total work / capacity, relative to the LLM's (1.0 = matched)

    def batch_overrides(self) -> dict:
        """The batch config keys to set (e.g. for `capacity: auto`)."""
        out = {"llm_rows": self.llm_rows, "llm_row_len": self.llm_row_len}
        out.update({BY_NAME[p].capacity: n for p, n in self.units.items()})
        return out


def suggest_capacities(
    index: LengthsIndex,
    llm_tokens_per_device: int,
    per_token: Mapping[str, int],
    *,
    per_row: Mapping[str, int] | None = None,
    max_row_len: int | None = None,
    per_octave: int = 8,
    match_llm: bool = False,
    block: int = 1,
) -> CapacitySuggestion:
    """Suggests capacities for `llm_tokens_per_device` LLM tokens per device and microbatch.

    Args:
      index: the data's lengths index.
      llm_tokens_per_device: target LLM tokens per device per microbatch.
      per_token: per encoder phase, its units per LLM token (vision: merge**2).
      per_row: per encoder phase, its units per encoder row (audio: the stem's stride; 1 where
        missing), so that a bucket holds whole blocks of rows.
      max_row_len: longest LLM row allowed (attention memory); None = one row per device.
      per_octave: ladder resolution.
      match_llm: let the LLM bucket move one ladder step (rows or row length) from the target
        when that brings the phases' demands closer together; otherwise it stays the nearest
        ladder shape to the target (`batch.capacity: auto` keeps the user's LLM bucket).
      block: block-sparse attention's block: every row (LLM, patches, audio encoder rows) a
        whole number of blocks.
    """
    llm = index.llm_tokens(per_token)
    longest = int(llm.max()) if len(llm) else 1
    target = max(llm_tokens_per_device, longest)
    mult = math.lcm(32, block)
    if max_row_len is None or target <= max_row_len:
        near = max(ladder_nearest(target, per_octave, mult), ladder_up(longest, per_octave, mult))
        shapes = [(1, near)]
        if match_llm:  # with rounded capacities, the phase whose demand runs ahead binds first
            ladder = _ladder(per_octave, mult)
            i = int(np.searchsorted(ladder, near))
            shapes += [(1, int(v)) for v in ladder[max(i - 1, 0) : i + 2] if v >= longest]
    else:
        row_len = ladder_up(max(longest, max_row_len // 2), per_octave, mult)
        rows = max(1, round(target / row_len))
        shapes = [(rows, row_len)]
        if match_llm:
            shapes += [(r, row_len) for r in (rows - 1, rows + 1) if r >= 1]
    best = None
    for rows, row_len in shapes:
        sug = _encoder_caps(index, llm, rows, row_len, per_token, per_row, per_octave, block)
        mismatch = math.log(max(sug.demand.values()) / min(sug.demand.values()))
        score = (round(mismatch, 3), abs(math.log(rows * row_len / target)))
        if best is None or score < best[0]:
            best = (score, sug)
    return best[1]


def encoder_capacities(
    index: LengthsIndex,
    llm_tokens_per_device: int,
    per_token: Mapping[str, int],
    *,
    per_row: Mapping[str, int] | None = None,
    per_octave: int = 8,
    block: int = 1,
) -> CapacitySuggestion:
    """Encoder buckets matched to exactly `llm_tokens_per_device` LLM tokens a device (as one
    row): where the LLM rows are not a device's (a context group's rows are longer than any
    device's tokens, and its longest document no measure of a device's share)."""
    llm = index.llm_tokens(per_token)
    return _encoder_caps(
        index, llm, 1, llm_tokens_per_device, per_token, per_row, per_octave, block
    )


def _encoder_caps(
    index: LengthsIndex,
    llm: np.ndarray,
    rows: int,
    row_len: int,
    per_token: Mapping[str, int],
    per_row: Mapping[str, int] | None,
    per_octave: int,
    block: int = 1,
) -> CapacitySuggestion:
    llm_cap = rows * row_len
    total_llm = max(int(llm.sum()), 1)
    caps, demand = {}, {LLM: 1.0}
    for name, per_sample in index.units().items():
        if not per_sample.any():
            caps[name] = 0
            continue
        # (a bucket: whole LLM tokens, a multiple of 4, whole blocks of encoder rows)
        rows_of = (per_row or {}).get(name, 1)
        mult = math.lcm(4 * per_token[name], block * rows_of, 32)
        ideal = llm_cap * per_sample.sum() / total_llm
        caps[name] = max(
            ladder_nearest(ideal, per_octave, mult),
            ladder_up(int(per_sample.max()), per_octave, mult),
        )
        demand[name] = float(ideal / caps[name])
    return CapacitySuggestion(llm_rows=rows, llm_row_len=row_len, units=caps, demand=demand)


# ----------------------------------------------------------------------------- tiles

HELD_DRY_RUN_STEPS = 50  # a holding planner's tile capacity: at most what this many of its
# plans needed without a bound (uniform data: its tiles are even without holding them)
TILE_HEADROOM = 0.03  # a tile-aware planner's capacity: the data's mean need per device + this
# With a cost model, the headroom among these that does the most useful work per computed FLOP
# in a short dry run of each (`held_tiles`): a tight capacity turns samples away (fill falls,
# by 3-5% at 8 devices on random mixes at +3%), a loose one computes padding tiles.
HELD_HEADROOMS = (0.03, 0.06, 0.10, 0.15)
HELD_TRIAL_STEPS = 12  # plans each headroom is tried for


def tile_density(
    index: LengthsIndex, caps: Capacities, most: int = 20000, seed: int = 0
) -> dict[str, float]:
    """Per phase, the attention tiles (of caps.block) the data needs per unit: a bucket of C
    units of documents drawn from the data needs about C times this. Measured, not assumed:
    (up to `most` of) the phase's documents in random order are laid one after another into
    rows of the bucket's length, as a packer lays them, and their tiles counted, so sizes
    that are multiples of the block (images of whole tiles) and documents a row boundary moves
    count as they will."""
    return {
        phase: packed_density(n, row_len, caps.block, causal, most, seed)
        for phase, (n, causal, row_len) in documents(index, caps).items()
    }


def suggest_tiles(
    index: LengthsIndex,
    caps: Capacities,
    headroom: float = TILE_HEADROOM,
    density: dict[str, float] | None = None,
) -> dict[str, int]:
    """Tile capacities per bucket for a planner that holds them (orchestrated): the mean need
    of a bucket filled to the phase's long-run share (1 for the phases that bind, less for the
    others: their buckets are filled only as far as the data's mix has work for them) plus
    `headroom`, at least the largest document's own tiles, at most every tile of the bucket's
    rows (0 for a phase without data). An LLM bucket is a device or a context group
    (`contract.device_tile_caps` gives a device's). `density`: `tile_density(index, caps)`,
    when the caller has it."""
    units = {LLM: caps.llm_rows * caps.llm_bin_len}
    units.update({p: caps.units[p] // caps.row_units(p) for p in NAMES})
    rows = {p: caps.llm_rows if p == LLM else 1 for p in PHASES}
    largest = {p: n for p, (n, _, _) in documents(index, caps).items()}
    work = {p: float(largest[p].sum()) for p in units}
    # (per device: a group's LLM bucket is context devices' units)
    devices = {p: caps.context if p == LLM else 1 for p in PHASES}
    demand = {p: work[p] * devices[p] / units[p] if units[p] else 0.0 for p in units}
    top = max(demand.values()) or 1.0
    share = {p: 1.0 if demand[p] >= BINDING * top else demand[p] / top for p in units}
    out = {}
    for phase, rho in (density or tile_density(index, caps)).items():
        n, causal = largest[phase], phase == LLM
        if not units[phase] or not len(n) or not n.any():
            out[phase] = 0
            continue
        blocks = units[phase] // rows[phase] // caps.block
        every = rows[phase] * int(own_tiles(np.array([blocks]), causal)[0])
        alone = int(own_tiles(-(-n // caps.block), causal).max())
        want = math.ceil(rho * units[phase] * share[phase] * (1 + headroom))
        out[phase] = int(min(max(want, alone), every))
    return out


def largest_doc_tiles(index: LengthsIndex, caps: Capacities) -> dict[str, int]:
    """Per phase, the tiles the data's largest document needs wherever in a block it starts
    (it may span one block more than its size in blocks): the least a bucket's tile capacity
    can be."""
    out = {}
    for phase, (n, causal, _) in documents(index, caps).items():
        n = n[n > 0]
        out[phase] = (
            int(own_tiles(np.array([(n.max() - 1) // caps.block + 2]), causal)[0]) if len(n) else 0
        )
    return out


def dry_run_documents(
    planner: Planner, index: LengthsIndex, caps: Capacities, steps: int
) -> dict[str, int]:
    """The most documents one row of `planner`'s plans holds per phase over `steps` plans
    (`planner` is used up: its state advances)."""
    most = dict.fromkeys(PHASES, 0)
    for _ in range(steps):
        for phase, n in step_documents(planner.plan(), index, caps).items():
            most[phase] = max(most[phase], n)
    return most


def most_documents(index: LengthsIndex, caps: Capacities) -> dict[str, int]:
    """Per phase, the most documents one packed row can hold with this data: the row over the
    smallest document (documents never share a position), at most the row, at least 1."""
    out = {}
    for phase, (n, _, row) in documents(index, caps).items():
        n = n[n > 0]
        out[phase] = max(1, min(row, row // int(n.min()))) if len(n) and row else 1
    return out


def held_tiles(
    planner: Planner,
    index: LengthsIndex,
    caps: Capacities,
    steps: int,
    *,
    make: Callable[[Capacities], Planner] | None = None,
    weights: dict[str, tuple[float, float]] | None = None,
) -> dict:
    """The tile capacities of a planner that holds them (`registry.HOLDS_TILES`), per phase the
    least of: the data's mean need of a bucket filled to the phase's share plus headroom
    (`suggest_tiles`); the mean need of `steps` of its own plans without a bound plus the same
    headroom (less where its plans fill less than that: few devices to choose among, samples
    that wait); the most any of those plans needed (uniform data, tiles even unheld). Never
    below the largest document's own tiles. (`planner`, built on `caps` without tile bounds,
    is used up.)

    The headroom is TILE_HEADROOM, or with `make` (a planner on given capacities) and
    `weights` (per phase: FLOPs per unit, per computed tile, from the cost model) the one of
    HELD_HEADROOMS whose plans do the most useful work per FLOP the buckets compute
    (`goodput`) over HELD_TRIAL_STEPS plans each.

    Returns the `*_tiles` capacities (a device's, where an LLM bucket is a context group:
    `contract.device_tile_caps`)."""
    most, mean = dry_run_tile_stats(planner, index, caps, steps)
    least = largest_doc_tiles(index, caps)
    density = tile_density(index, caps)  # (once for every headroom tried)

    def at(headroom: float) -> dict[str, int]:
        bucket = {
            p: max(least[p], min(n, most[p], math.ceil(mean[p] * (1 + headroom)))) if n else 0
            for p, n in suggest_tiles(index, caps, headroom, density).items()
        }
        return device_tile_caps(caps, bucket)

    if make is None or weights is None:
        return at(TILE_HEADROOM)
    best, best_score = at(HELD_HEADROOMS[0]), -1.0
    for headroom in HELD_HEADROOMS:
        tiles = at(headroom)
        if headroom > HELD_HEADROOMS[0] and tiles == best:
            continue
        held = dataclasses.replace(caps, tiles=tiles)
        score = goodput(make(held), index, held, HELD_TRIAL_STEPS, weights)
        if score > best_score * (1 + 1e-9):
            best, best_score = tiles, score
    return best


def goodput(
    planner: Planner, index: LengthsIndex, caps: Capacities, steps: int, weights: dict
) -> float:
    """Useful FLOPs over computed FLOPs of `planner`'s first `steps` plans (`flop_share` of
    their units and needed tiles over `caps`' buckets). (`planner` is used up.)"""
    work = index.work(caps.per_token)
    units, tiles = np.zeros(len(PHASES)), dict.fromkeys(weights, 0.0)
    for _ in range(steps):
        plan = planner.plan()
        units += work[plan.samples].sum(0)
        for phase, need in step_tiles(plan, index, caps).items():
            tiles[phase] = tiles.get(phase, 0.0) + float(need.sum())
    buckets = steps * caps.microbatches * caps.devices
    return flop_share(units, tiles, caps, caps.tile_caps(), buckets, weights)


def flop_share(
    units: np.ndarray,
    tiles: dict[str, float],
    caps: Capacities,
    cap_tiles: dict[str, int],
    buckets: int,
    weights: dict[str, tuple[float, float]],
) -> float:
    """Useful over computed FLOPs: the real `units` (per phase: LLM tokens, patches, frames)
    and the `tiles` their documents need, over `buckets` buckets of `caps`' units and
    `cap_tiles` tiles each, weighted by `weights[phase]` = (per unit, per tile)."""
    cap_units = (caps.llm_rows * caps.llm_row_len, *(caps.units[p] for p in NAMES))
    useful = computed = 0.0
    for i, phase in enumerate(PHASES):
        unit_w, tile_w = weights.get(phase, (0.0, 0.0))
        useful += unit_w * float(units[i]) + tile_w * tiles.get(phase, 0.0)
        computed += buckets * (unit_w * cap_units[i] + tile_w * cap_tiles.get(phase, 0))
    return useful / computed if computed > 0 else 0.0


def dry_run_tiles(planner: Planner, index: LengthsIndex, caps: Capacities, steps: int) -> dict:
    """The most tiles any bucket of `planner` needs per phase over its first `steps` plans:
    the smallest tile capacities a planner that ignores them never exceeds (`planner` is used
    up: its state advances)."""
    return dry_run_tile_stats(planner, index, caps, steps)[0]


def dry_run_tile_stats(
    planner: Planner, index: LengthsIndex, caps: Capacities, steps: int
) -> tuple[dict[str, int], dict[str, float]]:
    """(most, mean) tiles a bucket of `planner`'s first `steps` plans needs, per phase (the
    mean over every bucket of every step; `planner` is used up)."""
    most = dict.fromkeys(PHASES, 0)
    total = dict.fromkeys(most, 0.0)
    for _ in range(steps):
        for phase, need in step_tiles(planner.plan(), index, caps).items():
            most[phase] = max(most[phase], int(need.max(initial=0)))
            total[phase] += float(need.mean()) if need.size else 0.0
    return most, {p: t / max(steps, 1) for p, t in total.items()}


# ----------------------------------------------------------------------------- routes

ROUTE_DRY_RUN_STEPS = 50  # plans of the dry run that sizes the per-pair route capacity
ROUTE_HEADROOM = 0.1  # over the dry run's most when the run is longer than the dry run


def whole_output_rows(caps: Capacities) -> int:
    """A device's whole encoder output in rows (the largest of its phases): a route capacity
    this large never binds (`route.Routes.free`)."""
    return max([*(caps.units[p] // caps.per_token[p] for p in NAMES), 1])


def largest_item_rows(index: LengthsIndex, caps: Capacities) -> int:
    """The encoder output rows of the data's largest item: the least a route capacity can be
    (every item must be able to leave its device)."""
    rows = [
        int(index.items[p].sizes.max(initial=0)) // caps.per_token[p] if caps.units[p] else 0
        for p in NAMES
    ]
    return max([*rows, 1])


def dry_run_route_rows(planner: Planner, index: LengthsIndex, caps: Capacities, steps: int) -> int:
    """The most encoder rows one (src, dst) device pair carries in one microbatch and phase of
    `planner`'s first `steps` plans (`planner` is used up: its state advances)."""
    most = 0
    for _ in range(steps):
        plan = planner.plan()
        for phase in NAMES:
            most = max(most, int(pair_rows(plan, index, caps, phase).max(initial=0)))
    return most


def route_capacity(
    planner: Planner, index: LengthsIndex, caps: Capacities, steps: int, run_steps: int
) -> int:
    """The per-pair route capacity from the planner's own traffic: the most rows a pair carried
    in a dry run of `steps` plans (`planner` built on `caps` with a route capacity that never
    binds; used up), `ROUTE_HEADROOM` more when the run (`run_steps`) is longer, never below
    the largest item's rows nor above a device's whole encoder output. The planner then holds
    it: a sample whose items would take a pair past it waits (`route.Routes`)."""
    most = dry_run_route_rows(planner, index, caps, steps)
    if steps < run_steps:
        most = math.ceil(most * (1 + ROUTE_HEADROOM))
    return min(max(most, largest_item_rows(index, caps)), whole_output_rows(caps))


# ----------------------------------------------------------------------------- fill


def bins_lower_bound(sizes: np.ndarray, cap: int) -> int:
    """Martello and Toth's L2 lower bound on the bins of `cap` units that items of `sizes` need
    (no packing of them uses fewer): for every threshold a <= cap/2, the items above cap - a
    each need a bin of their own, those in (cap/2, cap - a] too, and the items in [a, cap/2]
    fill what those leave free before opening more. O(n log n)."""
    s = np.sort(np.asarray(sizes, np.int64))
    s = s[s > 0]
    if not len(s):
        return 0
    cs = np.concatenate([[0], np.cumsum(s)])
    big = int(np.searchsorted(2 * s, cap, "right"))  # items from here are above cap / 2
    alphas = np.unique(np.concatenate([[0], s[:big]]))
    hi = np.searchsorted(s, cap - alphas, "right")  # items from here are above cap - a
    n_own = len(s) - big  # above cap - a, and in (cap/2, cap - a]: one bin each
    free = (hi - big) * cap - (cs[hi] - cs[big])  # what those in (cap/2, cap - a] leave free
    small = cs[big] - cs[np.searchsorted(s, alphas, "left")]  # items in [a, cap/2]
    extra = np.ceil(np.maximum(small - free, 0) / cap)
    return int((n_own + extra).max())


def fill_bound(index: LengthsIndex, caps: Capacities) -> dict[str, float]:
    """Per phase, the highest fill any packing of the data's items into the phase's bins (LLM
    rows, a device's patches, a device's frames) can reach over an epoch: total units over
    (`bins_lower_bound` x bin). Coarse items (clips of most of a bucket) hold it below 1."""
    phases = [(LLM, index.llm_tokens(caps.per_token), caps.llm_row_len)]
    phases += [(p, index.items[p].sizes, caps.units[p]) for p in NAMES]
    out = {}
    for p, sizes, cap in phases:
        bins = bins_lower_bound(sizes, cap) if cap > 0 else 0
        out[p] = round(float(sizes.sum()) / (bins * cap), 4) if bins else 1.0
    return out
