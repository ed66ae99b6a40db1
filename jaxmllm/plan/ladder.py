"""The long variants of a step: where rare very long documents go instead of setting every
device's tile capacity.

A bucket's tile capacity (block-sparse attention) is a fixed shape: every device of every step
computes it, padding included. Sized near the mean need of a bucket (`capacity.size_tiles`) it
wastes little, but a document alone may need more tiles than that: a causal document of n
tokens needs about n^2 / (2 b^2), so one of 16k tokens needs ~8k tiles of 128 where a device's
32k tokens of 400-token chats need ~1.5k. Held at least as large as the longest document,
every device of every step pays for it, and the longest document grows with the data set
(a lognormal tail: 12k LLM tokens among 20k samples, 18k among a million).

So a step comes in a few compiled variants (at most `MAX_VARIANTS`) that differ only in their
tile capacities (`Capacities.tile_caps(variant)`): the base one, held near the mean need, and
long ones up to what the longest document needs, *per phase*: a variant long for the LLM keeps
the encoders' base tiles and one long for the vision encoder the LLM's, a last one raises
every long phase (`phase_variants`: where each step's variant raised every phase at once,
chats seed 100 computed 2.3% of its FLOPs as the LLM's padding tiles and 2.3% as the vision
encoder's). A phase's *levels* are its tile capacities over the variants, in order
(`phase_levels`); a document's level in its phase is the lowest whose bucket holds it
comfortably: at most `SHARE` of the bucket's tiles alone (wherever in a block it starts), or
alone at all at the phase's top level; a sample's levels are its documents' highest per phase
(its text in the LLM, its images and clips in their encoders). A step of a variant plans the
long samples its levels hold first (urgent: into the emptiest buckets) and leaves the others
waiting; it fills the rest as any step.

Which variant a step is comes from the deferred queue alone, so the plan stays a function of
(seed, step, index, carried state): per phase the highest level such that the samples waiting
at it or above could give each of the phase's buckets one (`BATCH` of them), or one of them
has waited `LONG_WAIT - 1` steps; the step is the first variant at those levels or above. A
long sample waits at most LONG_WAIT steps (more only while more of them wait than one long
step holds: then the next step is long too).

With a context degree per step (`Capacities.long_context`) the long variants' LLM buckets are
context groups (rows of several devices, `plan.context`) while the base one's are each device's
own: a document longer than a device's rows is of a long rung whatever its tiles, and a group
holds its long documents with the rest of its devices' rows at the base's density
(`group_rung`), each rank a share of it, so the long documents' tiles no longer set one
device's capacity.

What it costs: a long step's devices compute its capacity, padding included; when long
documents are many, long steps come as soon as they fill every bucket, when they are rare, once
in LONG_WAIT steps (measured in docs/long-tails.md).
"""

from __future__ import annotations

import math

import numpy as np

from jaxmllm.config.phases import LLM, PHASES
from jaxmllm.plan.contract import Capacities, bucket_tile_caps
from jaxmllm.plan.tiles import own_tiles, packed_density, tiles_alone

# Tuned constants of the long variants (what each was measured to do: docs/long-tails.md).
MAX_VARIANTS = 7  # step variants at most: each is a compiled program
LONG_WAIT = 16  # most steps a long sample waits for a long step
SHARE = 0.5  # a document belongs to the base if it fills at most this share of its bucket
BATCH = 0.75  # a long step comes as soon as its samples waiting are this many a bucket
# A phase gets long capacities where its longest document needs more than its base by this
# share of a bucket's FLOPs, all phases (of its own tiles without a cost model): below it, a
# second compiled step would save too little
GAIN_FLOPS = 0.005
GAIN_TILES = 0.05
MIDDLE = 2.0  # a middle variant where the longest document needs this times the base or more
# The base holds at least this share of the documents within its bound (`base_floor`): scaled
# by the density of the documents under its bound alone, a base whose bound misses the common
# document shrinks further each round (a device row of 8 blocks, chats of 3: a base of 14
# tiles bounded at 32 rows where the chats' median is 40, every step after the first long)
BODY = 0.9


def longest_fitting(cap: float, block: int, causal: bool) -> int:
    """The most attention rows a document may have and still fit `cap` tiles alone wherever
    in a block it starts (it spans one block more than its size in blocks when it starts
    inside one); 0 when not even one row fits."""
    if cap < 1:
        return 0
    m = int(np.floor((np.sqrt(8 * cap + 1) - 1) / 2)) if causal else int(np.floor(np.sqrt(cap)))
    while own_tiles(np.array([m + 1]), causal)[0] <= cap:  # (float rounding)
        m += 1
    while m > 0 and own_tiles(np.array([m]), causal)[0] > cap:
        m -= 1
    return max((m - 1) * block, 0)


def longest_filling(cap: float, density: float, rows: int, block: int, causal: bool) -> int:
    """The most attention rows a document may have and still fit `cap` tiles with the rest of
    its bucket's `rows` filled at `density` tiles a row (wherever in a block it starts)."""
    m = np.arange(1, rows // block + 3)  # blocks spanned (one more than its blocks at worst)
    n = (m - 1) * block
    ok = own_tiles(m, causal) + density * np.maximum(rows - n, 0) <= cap
    return int(n[ok].max()) if ok.any() else 0


def bucket_rows(caps: Capacities) -> dict[str, int]:
    """Per phase, a bucket's attention rows (an LLM bucket's tokens, an encoder's rows)."""
    out = {LLM: caps.llm_rows * caps.group_row_len}
    out.update({p: caps.units[p] // caps.row_units(p) for p in PHASES if p != LLM})
    return out


def phase_levels(caps: Capacities) -> np.ndarray:
    """Per variant and phase (`PHASES`' order), its level: the rank of its bucket's tiles (a
    context group's with a degree per step) among the phase's over every variant, 0 the
    base's (a phase's long variants need not raise every phase: one long for the LLM may keep
    the encoders' base tiles, `phase_variants`)."""
    caps_vp = np.array(
        [[bucket_tile_caps(caps.at(v), v)[p] for p in PHASES] for v in range(caps.variants)]
    )
    out = np.zeros(caps_vp.shape, np.int64)
    for j in range(len(PHASES)):
        out[:, j] = np.searchsorted(np.unique(caps_vp[:, j]), caps_vp[:, j])
    return out


def variant_at(levels: np.ndarray, phase: int, level: int) -> int | None:
    """The first variant whose level in `phase` (a column of `phase_levels`) is `level`; None
    where no variant has it."""
    found = np.flatnonzero(levels[:, phase] == level)
    return int(found[0]) if found.size else None


def base_floor(sizes: np.ndarray, block: int, causal: bool) -> int:
    """The fewest tiles a base bucket may have so that BODY of the documents `sizes` (in
    attention rows) are under its bound: each fills at most SHARE of it alone, wherever in a
    block it starts (`longest_fitting`); 0 without documents."""
    if not sizes.size:
        return 0
    rows = int(np.ceil(np.quantile(sizes, BODY)))
    return int(math.ceil(tiles_alone(rows, block, causal) / SHARE))


def rung_rows(caps: Capacities) -> list[dict[str, int]]:
    """Per phase with a tile capacity and each of its levels but the top one (`phase_levels`),
    the most attention rows of a document of that level (module docstring): the base's fill
    at most SHARE of a bucket alone; a long one's fit with the rest of their bucket at the
    base's density (its tiles over its rows); where no level above holds more of a phase, its
    documents fit alone. Entry k: the bounds of level k (a phase missing: none at level k)."""
    levels = phase_levels(caps)
    top = caps.variants - 1
    views = [caps.at(v) for v in range(caps.variants)]  # (a degree per step: its groups)
    buckets = [bucket_tile_caps(view, v) for v, view in enumerate(views)]
    rows = [bucket_rows(view) for view in views]
    out = [{} for _ in range(max(int(levels.max()), 1))]
    for j, p in enumerate(PHASES):
        causal = p == LLM
        for level in range(int(levels[:, j].max()) + 1):
            v = variant_at(levels, j, level)  # (any variant of the level)
            cap = buckets[v][p]
            if not cap or 0 < level == levels[:, j].max():  # (the top level: no bound)
                continue
            if level == levels[:, j].max():  # (nothing above holds more)
                bound = longest_fitting(cap, caps.attention_block, causal)
            elif level == 0:
                bound = longest_fitting(SHARE * cap, caps.attention_block, causal)
            else:
                density = buckets[0][p] / max(rows[0][p], 1)
                bound = longest_filling(cap, density, rows[v][p], caps.attention_block, causal)
            out[level][p] = bound
    # (a document longer than a level's rows waits for the groups above, whose rows are
    # longer: a context degree per step)
    j = PHASES.index(LLM)
    for level, bound in enumerate(out):
        v = variant_at(levels, j, level)
        v = top if v is None else v
        if views[top].group_row_len > views[v].group_row_len:
            bound[LLM] = min(bound.get(LLM, views[v].group_row_len), views[v].group_row_len)
    return out


class Ladder:
    """Which level each sample is in each phase, and which variant each step is (module
    docstring)."""

    def __init__(self, caps: Capacities, wait: int = LONG_WAIT):
        self.wait, self.variants = wait, caps.variants
        self.levels = phase_levels(caps)  # [variant, phase]
        self.rows = rung_rows(caps)
        self.per_row = {p: 1 if p == LLM else caps.row_units(p) for p in PHASES}
        # Per phase and level, the samples waiting that make a step long: BATCH a bucket of
        # the phase's (the LLM's with a degree per step: a long step's groups, each sized for
        # one long sample, `group_rung`; counted by the devices instead, groups were sent
        # more than they hold: goodput 0.935 on speech, 0.941 on docqa, against 0.982 and
        # 0.964); an encoder's buckets are a device's in every variant
        self.batch = np.zeros(self.levels.shape[1:] + (int(self.levels.max()) + 1,))
        for j, p in enumerate(PHASES):
            for level in range(int(self.levels[:, j].max()) + 1):
                v = variant_at(self.levels, j, level)
                buckets = caps.at(v).llm_buckets if p == LLM else caps.devices
                self.batch[j, level] = BATCH * caps.microbatches * buckets

    def sample_levels(
        self, llm: np.ndarray, items: dict[str, tuple[np.ndarray, np.ndarray]]
    ) -> np.ndarray:
        """Per sample and phase, its level: its LLM tokens `llm` (its longest LLM document: a
        preference pair's two are two documents), and per encoder phase its items' (owner
        sample position, size in units)."""
        out = np.zeros((len(llm), len(PHASES)), np.int64)
        j_llm = PHASES.index(LLM)
        for bound in self.rows:
            if LLM in bound:
                out[:, j_llm] += llm > bound[LLM]
            for p, (owner, size) in items.items():
                if p in bound:
                    above = np.zeros(len(llm), bool)
                    above[owner[size // self.per_row[p] > bound[p]]] = True
                    out[:, PHASES.index(p)] += above
        return out

    def rungs(self, llm: np.ndarray, items: dict[str, tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """Per sample, the first variant that holds it (`sample_levels`; 0: the base)."""
        return self._first_holding(self.sample_levels(llm, items))

    def _first_holding(self, levels: np.ndarray) -> np.ndarray:
        """Per row of `levels` ([n, phase]), the first variant as high in every phase."""
        holds = (levels[:, None, :] <= self.levels[None]).all(2)  # [n, variant]
        return holds.argmax(1)

    def held(self, levels: np.ndarray, variant: int) -> np.ndarray:
        """Per sample of `levels`, whether a step of `variant` cannot hold it."""
        return (levels > self.levels[variant]).any(1)

    def variant(self, step: int, since: np.ndarray, levels: np.ndarray) -> int:
        """The variant of step `step` from the waiting samples (pulled at `since`, of
        `levels`): per phase, the highest level such that those of it or above are BATCH a
        bucket of the phase, or one of them has waited LONG_WAIT - 1 steps; the step is the
        first variant whose levels are as high in every phase (0 when none is long)."""
        need = np.zeros(levels.shape[1], np.int64)
        old = step - since >= self.wait - 1
        for j in range(levels.shape[1]):
            for level in range(int(self.levels[:, j].max()), 0, -1):
                up = levels[:, j] >= level
                if up.sum() >= self.batch[j, level] or (up & old).any():
                    need[j] = level
                    break
        return int(self._first_holding(need[None])[0])


def size_ladder(
    held: dict[str, int],
    least: dict[str, int],
    docs: dict[str, tuple[np.ndarray, bool, int]],
    tail: dict[str, tuple[np.ndarray, bool, int]],
    rows: dict[str, int],
    density: dict[str, float],
    block: int,
    weights: dict[str, tuple[float, float]] | None = None,
    always: tuple[str, ...] = (),
) -> tuple[dict[str, int], list[dict[str, int]]]:
    """(the base bucket tile capacities, the long variants', cheapest first: `phase_variants`)
    of a bucket held at `held` tiles without long variants (0: a phase without a bound).

    Documents of a bucket's rung fill at most SHARE of it alone (`rung_rows`), so the base holds
    only the documents under that bound: its capacity is `held` scaled by their packed density over
    the whole data's (`density`), settled in a few rounds (the bound moves with it), never so low
    that the bound misses more than 1 - BODY of the documents (`base_floor`: a base that holds no
    common document is a compiled program no step uses). A long variant holds its documents with the
    rest of its bucket filled at the base's density: per phase the most any of them needs alone
    (wherever in a block it starts, `least` for the longest) plus that density times the rest of the
    bucket's `rows`. A phase whose longest document the base holds within GAIN_TILES of its tiles
    gets no long capacity (its base is raised to it), or with `weights` (per phase: FLOPs per unit
    of `rows`, per tile) within GAIN_FLOPS of what a whole bucket computes, all phases (the tiles of
    a phase whose attention costs little, an audio encoder's, are not worth a second program). Where
    the top is MIDDLE times the base or more, a middle variant at their geometric mean (the
    documents between two rungs of such a ratio are too many kinds for one: those near the bottom
    would leave most of the top's tiles to padding).

    `docs`: per phase (document sizes in attention rows, causal, row length), as
    `contract.documents`, of a uniform sample of the data (its densities); `tail`: the same
    of its longest documents (what the long variants must hold); `rows`: per phase a bucket's
    attention rows; `always`: phases with a long level even at the base's tiles (the LLM with
    a context degree per step: its long steps' groups hold the documents a device's rows do
    not)."""
    base = dict(held)
    dens0 = dict(density)
    floor = {p: base_floor(docs[p][0], block, docs[p][1]) for p, n in held.items() if n}
    for _ in range(3):
        for p, n in held.items():
            sizes, causal, row_len = docs[p]
            if not n or not density.get(p):
                continue
            bound = longest_fitting(SHARE * base[p], block, causal)
            dens0[p] = packed_density(sizes[sizes <= bound], row_len, block, causal)
            base[p] = max(1, math.ceil(n * dens0[p] / density[p]), floor[p])
    if weights is None:
        worth = {p: GAIN_TILES * n for p, n in held.items()}
    else:
        flops = sum(weights[p][0] * rows[p] + weights[p][1] * n for p, n in held.items())
        worth = {p: GAIN_FLOPS * flops / weights[p][1] if weights[p][1] else np.inf for p in held}
    top = {}
    for p, n in base.items():
        sizes, causal, _ = docs[p]
        if not n or least[p] - held[p] <= worth[p]:
            continue
        sizes = np.concatenate([sizes, tail[p][0]])
        long = sizes[sizes > longest_fitting(SHARE * n, block, causal)]
        if not long.size:  # (a base at its floor can hold even the longest: no long rung)
            continue
        alone = tiles_alone(long, block, causal)
        top[p] = int(np.ceil((alone + n / rows[p] * np.maximum(rows[p] - long, 0)).max()))
    if not top:
        return {p: max(n, least[p]) if n else 0 for p, n in held.items()}, []
    base = {p: base[p] if p in top else max(n, least[p]) if n else 0 for p, n in held.items()}
    for p in always:  # (a long level at the base's tiles: a degree per step's groups)
        top.setdefault(p, base[p])
    mid = {p: int(np.sqrt(base[p] * n)) for p, n in top.items() if n >= MIDDLE * base[p]}
    return base, phase_variants(base, mid, top)


def phase_variants(
    base: dict[str, int], mid: dict[str, int], top: dict[str, int]
) -> list[dict[str, int]]:
    """The long variants of a ladder whose phases `top` are long (`mid`: those with a middle
    rung), every phase's tiles set, cheapest first (a step's variant is the first that holds
    what its phases need, `Ladder.variant`): each phase's rungs alone, the others at
    the base's, and where several phases are long one variant with every middle rung (a top
    where a phase has none) and one with every top, for a step whose phases each need a long
    level (a step long for its LLM need not compute the long vision tiles, nor the other way
    round: chats seed 100 computed 2.3% of its FLOPs as each's padding tiles when one variant
    raised both). At most MAX_VARIANTS with the base: past it, the old chain (one variant
    raising every phase's middle rung, one every top)."""
    alone = [{**base, p: n} for p, n in mid.items()] + [{**base, p: n} for p, n in top.items()]
    every = {**base, **top}
    out = alone + ([{**every, **mid}] if len(top) > 1 and mid else [])
    out += [every] if len(top) > 1 else []
    if 1 + len(out) <= MAX_VARIANTS:  # (cheapest first: the tiles over the base's, summed)
        return sorted(out, key=lambda r: sum(n / max(base[p], 1) for p, n in r.items()))
    return [{**every, **mid}, every] if mid else [every]


def group_rung(base: dict[str, int], rung: dict[str, int], degree: int) -> dict[str, int]:
    """A long rung's bucket tiles (`size_ladder`'s, a device's bucket) held by a context group
    of `degree` devices (a context degree per step): the LLM's, its documents with the rest
    of one device's bucket at the base's density, and the other devices' buckets at the
    base's (at least what the group's rows need, where a document overruns a device's rows);
    the encoders' buckets stay a device's."""
    out = dict(rung)
    if out.get(LLM):
        out[LLM] += (degree - 1) * base[LLM]
    return out
