"""Tile capacities (block-sparse attention) from the data and from dry runs of a planner.

A planner that holds its tile capacities near the mean need (`registry.HOLDS_TILES`) gets the
data's mean need of a bucket plus the headroom that does the most useful work per computed FLOP
(`size_tiles`), with long variants of the step for the documents too long for that
(`jaxmllm.plan.ladder`); any other planner gets the most a dry run of its plans needed
(`dry_run_tiles`). The data's figures come from its summary (`summary.summary_of`), never from
every sample.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from jaxmllm.config.phases import LLM, NAMES, PHASES
from jaxmllm.cost.model import TileWeights
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.plan.contract import (
    Capacities,
    Planner,
    StepPlan,
    device_tile_caps,
    documents,
    phase_docs,
    span_extras,
    spans_alone,
    step_tiles,
    work_of,
)
from jaxmllm.plan.ladder import group_rung, size_ladder
from jaxmllm.plan.select import BINDING
from jaxmllm.plan.summary import IndexSummary, summary_of
from jaxmllm.plan.tiles import (
    band_above,
    bin_tiles,
    own_tiles,
    packed_density,
    span_blocks,
    tiles_alone,
    window_reach,
    window_tile_capacity,
)

HELD_DRY_RUN_STEPS = 50  # a holding planner's tile capacity: at most what this many of its
# plans needed without a bound (uniform data: its tiles are even without holding them)
TILE_HEADROOM = 0.03  # a tile-aware planner's capacity: the data's mean need per device + this
# With a cost model, the headroom among these that does the most useful work per computed FLOP
# in a short dry run of each (`held_tiles`): a tight capacity turns samples away (fill falls,
# by 3-5% at 8 devices on random mixes at +3%), a loose one computes padding tiles.
HELD_HEADROOMS = (0.03, 0.06, 0.10, 0.15, 0.30)
HELD_TRIAL_STEPS = 12  # plans each headroom is tried for


def tile_density(
    index: LengthsIndex, caps: Capacities, most: int = 20000, seed: int = 0
) -> dict[str, float]:
    """Per phase, the attention tiles (of caps.attention_block) the data needs per unit: a
    bucket of C units of documents drawn from the data needs about C times this. Measured, not
    assumed: (up to `most` of) the phase's documents in random order are laid one after another
    into rows of the bucket's length, as a packer lays them, and their tiles counted, so sizes
    that are multiples of the block (images of whole tiles) and documents a row boundary moves
    count as they will; bidirectional spans add, per LLM token, what the planner counts for
    them (`contract.span_extras`). (Of the index's summary: a uniform sample, the whole index
    when small.)"""
    body = summary_of(index, caps.per_token).body
    out = {
        phase: packed_density(n, row_len, caps.attention_block, causal, most, seed)
        for phase, (n, causal, row_len) in documents(body, caps).items()
    }
    extras = span_extras(body, np.arange(len(body)), caps)
    if extras is not None and LLM in out:
        tokens = work_of(body, np.arange(len(body)), caps.per_token)[:, 0].sum()
        out[LLM] += float(extras.sum()) / max(float(tokens), 1.0)
    return out


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
    units = {LLM: caps.llm_rows * caps.group_row_len}
    units.update({p: caps.units[p] // caps.row_units(p) for p in NAMES})
    rows = {p: caps.llm_rows if p == LLM else 1 for p in PHASES}
    summary = summary_of(index, caps.per_token)
    largest = {p: n for p, (n, _, _) in documents(summary.body, caps).items()}
    work = {p: float(largest[p].sum()) for p in units}  # (the body's: shares of it matter)
    longest = longest_rows(summary, caps)
    # (per device: a group's LLM bucket is context devices' units)
    devices = {p: caps.context if p == LLM else 1 for p in PHASES}
    demand = {p: work[p] * devices[p] / units[p] if units[p] else 0.0 for p in units}
    top = max(demand.values()) or 1.0
    share = {p: 1.0 if demand[p] >= BINDING * top else demand[p] / top for p in units}
    out = {}
    for phase, rho in (density or tile_density(index, caps)).items():
        causal = phase == LLM
        if not units[phase] or not longest[phase]:
            out[phase] = 0
            continue
        blocks = units[phase] // rows[phase] // caps.attention_block
        every = rows[phase] * int(own_tiles(np.array([blocks]), causal)[0])
        alone = int(own_tiles(np.array([-(-longest[phase] // caps.attention_block)]), causal)[0])
        if causal and caps.bidirectional:  # (spans: tiles above the diagonal too)
            every += rows[phase] * band_above(blocks, span_upper(caps))
            alone = max(alone, spans_alone(index, caps)[0])
        want = math.ceil(rho * units[phase] * share[phase] * (1 + headroom))
        out[phase] = int(min(max(want, alone), every))
    return out


def longest_rows(summary: IndexSummary, caps: Capacities) -> dict[str, int]:
    """Per phase, the attention rows of the data's largest document (`contract.documents`' of
    the largest item; 0 for a phase without data)."""
    return {p: n // (1 if p == LLM else caps.row_units(p)) for p, n in summary.most.items()}


def largest_doc_tiles(index: LengthsIndex, caps: Capacities) -> dict[str, int]:
    """Per phase, the tiles the data's largest document needs wherever in a block it starts
    (it may span one block more than its size in blocks): the least a bucket's tile capacity
    can be."""
    out = {}
    for phase, n in longest_rows(summary_of(index, caps.per_token), caps).items():
        out[phase] = int(tiles_alone(n, caps.attention_block, phase == LLM)) if n else 0
    if caps.bidirectional:  # (a sample's spans add tiles above the diagonal)
        out[LLM] = max(out[LLM], spans_alone(index, caps, anywhere=True)[0])
    return out


@dataclass(frozen=True)
class TileSizes:
    """The tile capacities a holding planner is given: the `*_tiles` of its base steps and,
    where some document needs more than a base bucket holds, the `*_long_tiles` of its long
    steps (`jaxmllm.plan.ladder`; empty: no long variant)."""

    tiles: dict[str, int]
    long: tuple[dict[str, int], ...]


def held_tiles(
    planner: Planner,
    index: LengthsIndex,
    caps: Capacities,
    steps: int,
    *,
    make: Callable[[Capacities], Planner] | None = None,
    weights: Mapping[str, tuple] | None = None,
) -> dict:
    """`size_tiles`' capacities without a long variant: every bucket at least the largest
    document's own tiles."""
    return size_tiles(planner, index, caps, steps, make=make, weights=weights, ladder=False).tiles


def size_tiles(
    planner: Planner,
    index: LengthsIndex,
    caps: Capacities,
    steps: int,
    *,
    make: Callable[[Capacities], Planner] | None = None,
    weights: Mapping[str, tuple] | None = None,
    ladder: bool = True,
) -> TileSizes:
    """The tile capacities of a planner that holds them (`registry.HOLDS_TILES`), per phase the
    least of: the data's mean need of a bucket filled to the phase's share plus headroom
    (`suggest_tiles`); the mean need of `steps` of its own plans without a bound plus the same
    headroom (less where its plans fill less than that: few devices to choose among, samples
    that wait); the most any of those plans needed (uniform data, tiles even unheld).

    A document must fit alone, wherever in a block it starts (`largest_doc_tiles`): where the
    largest one needs more than that, with `ladder` the phase gets long variants that hold it
    (`jaxmllm.plan.ladder.size_ladder` says when and how large: long steps plan the documents a
    base bucket cannot hold), without it the base capacity is raised to it.

    The headroom is TILE_HEADROOM, or with `make` (a planner on given capacities) and
    `weights` (per phase: FLOPs per unit, per computed tile and per windowed tile,
    `CostModel.tile_weights`) the one of HELD_HEADROOMS whose plans do the most useful work per
    FLOP the buckets compute (`goodput`: a decoder's windowed layers' list counted at its own
    capacity, `window_cap`) over HELD_TRIAL_STEPS plans each. (`planner`, built on `caps`
    without tile bounds, is used up.)

    Returns the capacities of a device (where an LLM bucket is a context group:
    `contract.device_tile_caps`)."""
    most, mean = dry_run_tile_stats(planner, index, caps, steps)
    least = largest_doc_tiles(index, caps)
    # (a degree per step: a base bucket holds at most a device's row of a document, the
    # longer ones a long variant's groups)
    held_least = dict(least)
    if caps.long_context and least[LLM]:
        row = tiles_alone(caps.llm_row_len, caps.attention_block, True)
        held_least[LLM] = min(least[LLM], int(row))
    density = tile_density(index, caps)  # (once for every headroom tried)
    summary = summary_of(index, caps.per_token)
    docs = documents(summary.body, caps)  # (the body's for densities, and the tail's too for
    tail = documents(summary.tail, caps)  # the longest documents)
    rows = {
        LLM: caps.llm_rows * caps.group_row_len,
        **{p: caps.units[p] // caps.row_units(p) for p in NAMES},
    }

    suggested = {}  # headroom -> suggest_tiles' capacities (each computed once)

    def at(headroom: Mapping[str, float]) -> TileSizes:
        for h in set(headroom.values()) - set(suggested):
            suggested[h] = suggest_tiles(index, caps, h, density)
        held = {
            p: min(n, most[p], math.ceil(mean[p] * (1 + headroom[p]))) if n else -1
            for p, n in ((p, suggested[headroom[p]][p]) for p in suggested[headroom[LLM]])
        }  # (-1: a phase without data)
        held = {p: max(n, 0) for p, n in held.items()}
        if not ladder:
            base, long = {p: max(n, held_least[p]) if n else 0 for p, n in held.items()}, []
        else:
            row_weights = None if weights is None else ladder_weights(weights, caps, held, rows)
            # (a degree per step: the LLM has a long level, its groups, even at the base's
            # tiles, `size_ladder`'s `always`)
            always = (LLM,) if caps.long_context else ()
            base, long = size_ladder(
                held,
                held_least,
                docs,
                tail,
                rows,
                density,
                caps.attention_block,
                row_weights,
                always,
            )
        if caps.long_context:  # (a degree per step: a long rung's bucket is a group)
            # (one at least: a document longer than a device's row fits no base bucket, even
            # where its tiles gave no long rung; a variant long for an encoder alone has its
            # groups at the base's LLM tiles, as one long for the LLM alone at the base's
            # tiles: one variant)
            long = [group_rung(base, r, caps.long_context) for r in long or [dict(base)]]
            long = [r for k, r in enumerate(long) if r not in long[:k]]
        return TileSizes(
            device_tile_caps(caps.at(0), base),
            tuple(device_tile_caps(caps.at(v + 1), r) for v, r in enumerate(long)),
        )

    if make is None or weights is None:
        return at(dict.fromkeys(PHASES, TILE_HEADROOM))
    # One headroom for every phase, then each phase's own, the encoders' first (a phase whose
    # exact tiles spread more, or whose tiles cost little, gains from more; the one that
    # then held the others back may need less)
    best_room, best, best_score = None, None, -1.0

    def rooms():  # (lazily: each phase's trials start from the best so far)
        for h in HELD_HEADROOMS:
            yield dict.fromkeys(PHASES, h)
        for p in (*NAMES, LLM):
            yield from ({**best_room, p: h} for h in HELD_HEADROOMS if h != best_room[p])

    tried: list[TileSizes] = []
    for room in rooms():
        sizes = at(room)
        if sizes in tried:
            continue
        tried.append(sizes)
        held = dataclasses.replace(caps, tiles=sizes.tiles, long_tiles=sizes.long)
        got = goodput(make(held), index, held, HELD_TRIAL_STEPS, weights)
        if got > best_score * (1 + 1e-9):
            best_room, best, best_score = room, sizes, got
    return best


def ladder_weights(
    weights: Mapping[str, tuple], caps: Capacities, held: Mapping[str, int], rows: Mapping
) -> dict[str, tuple[float, float]]:
    """Per phase (FLOPs per attention row, per tile): the cost of a bucket of `rows` rows
    near `held` tiles, as `plan.ladder.size_ladder` weighs its capacities. A decoder's
    windowed list (`window_cap`) costs its windowed weight per tile: where the band binds it
    does not grow with the causal capacity (a fixed cost, spread over the rows), elsewhere it
    is as long (each causal tile costs both weights)."""
    out = {}
    for p, w in weights.items():
        w = TileWeights(*w)
        unit, tile = w.unit * (1 if p == LLM else caps.row_units(p)), w.tile
        if p == LLM and w.window:
            band = window_cap(caps, held.get(LLM, 0), w)
            if held.get(LLM, 0) and band < held[LLM]:
                unit += w.window_tile * band / max(rows[LLM], 1)
            else:
                tile += w.window_tile
        out[p] = (unit, tile)
    return out


def window_cap(caps: Capacities, llm_tiles: float, weight: tuple) -> int:
    """The windowed layers' tile capacity of an LLM bucket of `llm_tiles` causal tiles
    (`batch.bucketize.window_tile_cap`, from `caps` and the LLM's `TileWeights`): the fewer of
    those and the band a window reaches; 0 where the weights price no list of their own (no
    window; context groups, whose ranks' windowed lists `CostModel.tile_weights` prices as
    their causal ones, leaving `window` 0)."""
    w = TileWeights(*weight)
    if not (w.window and caps.attention_block):
        return 0
    return window_tile_capacity(
        int(llm_tiles),
        caps.llm_rows,
        caps.llm_row_len,
        caps.attention_block,
        w.window,
        longest_span(caps),
    )


def longest_span(caps: Capacities) -> int:
    """The most LLM tokens a bidirectional span may have: the largest item its phase's bucket
    holds (0: no spans)."""
    return max((caps.units[p] // caps.per_token[p] for p in caps.bidirectional), default=0)


def span_upper(caps: Capacities) -> int:
    """How many key blocks after its own a query block's span may reach (`band_above`)."""
    n = longest_span(caps)
    return int(span_blocks(np.int64(n), caps.attention_block)) - 1 if n else 0


def step_window_tiles(
    plan: StepPlan, index: LengthsIndex, caps: Capacities, window: int
) -> np.ndarray:
    """The windowed tiles (a sliding window of `window` tokens) each LLM bucket of the plan
    needs [microbatch, bucket], as `contract.step_tiles` counts the causal ones (context 1),
    bidirectional spans' tiles above the diagonal included (`contract.span_extras`)."""
    micro, dev, row, off, size = phase_docs(plan, index, caps, LLM)
    m_n, d_n, rows = caps.microbatches, caps.llm_buckets, caps.llm_rows
    bins = (micro * d_n + dev) * rows + row
    reach = window_reach(window, caps.attention_block)
    tiles = bin_tiles(bins, off, size, m_n * d_n * rows, caps.attention_block, True, reach)
    extras = span_extras(index, plan.samples, caps)
    if extras is not None:
        at = (plan.micro * d_n + plan.device) * rows + plan.row
        tiles += np.bincount(at, extras, m_n * d_n * rows).astype(np.int64)
    return tiles.reshape(m_n, d_n, rows).sum(2)


def goodput(
    planner: Planner, index: LengthsIndex, caps: Capacities, steps: int, weights: Mapping
) -> float:
    """Useful FLOPs over computed FLOPs of `planner`'s first `steps` plans (`trial_flops`).
    (`planner` is used up.)"""
    useful, computed, _ = trial_flops(planner, index, caps, steps, weights)
    return useful / computed if computed > 0 else 0.0


def trial_flops(
    planner: Planner, index: LengthsIndex, caps: Capacities, steps: int, weights: Mapping
) -> tuple[float, float, int]:
    """(useful FLOPs, computed FLOPs, steps of a long variant) of `planner`'s first `steps`
    plans (`flop_parts` of their units and needed tiles over `caps`' buckets; a decoder's
    windowed layers: the windowed tiles they need over their list's capacity, `window_cap`).
    (`planner` is used up.)"""
    units, tiles = np.zeros(len(PHASES)), dict.fromkeys(weights, 0.0)
    computed = dict.fromkeys(PHASES, 0.0)  # (each step's capacities: its variant's)
    llm = weights.get(LLM, (0.0, 0.0))
    window = TileWeights(*llm).window if caps.attention_block else 0
    window_tiles = cap_window = 0.0
    long_steps = 0
    for _ in range(steps):
        plan = planner.plan()
        long_steps += plan.variant > 0
        units += work_of(index, plan.samples, caps.per_token).sum(0)
        for phase, need in step_tiles(plan, index, caps).items():
            tiles[phase] = tiles.get(phase, 0.0) + float(need.sum())
        for phase, n in caps.tile_caps(plan.variant).items():
            computed[phase] += n / steps
        if window:
            window_tiles += float(step_window_tiles(plan, index, caps, window).sum())
            cap_window += window_cap(caps, caps.tile_caps(plan.variant)[LLM], llm) / steps
    buckets = steps * caps.microbatches * caps.devices
    parts = flop_parts(units, tiles, caps, computed, buckets, weights, window_tiles, cap_window)
    return (*parts, long_steps)


def flop_share(*args, **kwargs) -> float:
    """Useful over computed FLOPs: the ratio of `flop_parts` (its arguments)."""
    useful, computed = flop_parts(*args, **kwargs)
    return useful / computed if computed > 0 else 0.0


def flop_parts(
    units: np.ndarray,
    tiles: dict[str, float],
    caps: Capacities,
    cap_tiles: dict[str, float],
    buckets: int,
    weights: Mapping[str, tuple],
    window_tiles: float = 0.0,
    cap_window: float | None = None,
) -> tuple[float, float]:
    """(useful FLOPs, computed FLOPs): the real `units` (per phase: LLM tokens, patches, frames)
    and the `tiles` their documents need, over `buckets` buckets of `caps`' units and
    `cap_tiles` tiles each (with a long variant: the mean over the steps), weighted by
    `weights[phase]` = (per unit, per tile[, per windowed tile, window]: `TileWeights`).

    A decoder whose windowed layers have a list of their own (the LLM's weights' `window`)
    adds the `window_tiles` its documents need (`step_window_tiles`) over `cap_window` tiles a
    bucket (the mean over the steps; None: `window_cap` of the LLM's `cap_tiles`, exact
    without long variants)."""
    cap_units = (caps.llm_rows * caps.llm_row_len, *(caps.units[p] for p in NAMES))
    useful = computed = 0.0
    for i, phase in enumerate(PHASES):
        w = TileWeights(*weights.get(phase, (0.0, 0.0)))
        cap = cap_tiles.get(phase, 0)
        cap_w = 0.0
        if phase == LLM and w.window:
            cap_w = window_cap(caps, cap, w) if cap_window is None else cap_window
        useful += w.cost(float(units[i]), tiles.get(phase, 0.0), window_tiles if w.window else 0)
        computed += buckets * w.cost(cap_units[i], cap, cap_w)
    return useful, computed


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
