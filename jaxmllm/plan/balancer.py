"""The balancer: per-step selection, per-phase device assignment, packing and deferral.

Each step the planner takes the deferred samples (oldest first) plus enough upcoming samples of
the epoch-shuffled stream to overfill the step by `lookahead`, then, one microbatch at a time
(hierarchical, in the spirit of Entrain: every microbatch gets a full, equal share first, then
its devices are balanced):

1. selects, in priority order (oldest first), the samples that fit the microbatch's total
   capacity in every phase and take about an equal share of what the window holds (vectorised
   greedy rounds: take the longest prefix that fits, then the next items that still fit, ...);
2. assigns them to buckets: `orchestrated` packs every phase on its own (`pack_phase`: LLM
   samples to rows, images and clips to devices, anywhere: the routing tables bring encoder
   output rows to their text), `balanced` assigns whole samples to devices (no routing);
3. fills what slack is left with the next samples of the window that fit (same packer,
   starting from the loads; up to MANY_BUCKETS buckets: beyond, the slack is a sliver and the
   look-ahead shrinks, see BalancedPlanner.__init__);
4. `orchestrated` keeps encoder items on their text's device where that costs no balance: in
   a packing round an item takes its home bin's slot when that slot was to get an item within
   `HOME_TOL` of its size; afterwards items of nearly the same size (within `SIZE_TOL`) trade
   devices so that as many as possible sit at home (`localize`; each device keeps its count of
   items per size class; the small shifts in load are undone where they would overfill a
   bucket: no room is kept back for them, which cost a whole item of fill on sets of
   equal-size tiles), then the per-(src, dst) route
   capacity is enforced (a sample whose items would exceed it waits).

`pack_phase` equalises both each bin's fill and its attention (sum of squared item sizes) cost.
Small encoder items (video frames, small images, short clips) first go to their home bin, each
bin taking up to its share of them (`_home_small`); the rest are laid out as below.
It emulates the sequential greedy "each item, largest first, to the bin whose remaining
attention budget per free unit (the item size it wants) is largest": in rounds, the bins that
want the biggest items take the next ones, as many as bring their wants down to a common level
chosen so that a round places about one item per open bin; once the items are small, the rest are
laid out in a few passes as contiguous runs (largest first) over the bins in order of the size
they want, each bin's run proportional to its room. Quality: on the built-in mixes the
attention max/mean over bins is within 1-2% (the sequential greedy's), in ~n/bins rounds.

A sample is planned only when all its parts are; what is not planned waits for a later step,
oldest first, and a sample that has waited `max_age - 1` steps goes first into the emptiest
buckets, so no sample waits more than `max_age` steps. Nothing is dropped: a sample that can
never fit fails `check_fits` at start-up (the data issue's oversize policy).

All of it is numpy over arrays (the only Python loops run over packing rounds, passes and
microbatches), deterministic (stable sorts only, so every host computes the same plan), and a
function of (seed, step, index, carried state).
"""

from __future__ import annotations

import numpy as np

from jaxmllm.data.samples import LengthsIndex
from jaxmllm.plan.contract import Capacities, ItemPlan, OversizeError, StepPlan, check_fits
from jaxmllm.plan.ragged import (
    argsort_stable,
    compact_keys,
    desc_order,
    gather_items,
    offsets_in_bins,
    run_cumsum,
    smallest,
    stable_sort,
)
from jaxmllm.plan.stream import SampleStream

ENC = ("vision", "audio")
BIG = 0.003  # items with size**2 above this share of a bin's attention budget go in rounds
PASSES = 8  # passes that lay out the small items
SIZE_TOL = 0.01  # items within 1% in size (and of one round) may trade devices for locality
FILL = 0.997  # a microbatch's first selection takes at most this share of each capacity
SMALL = 0.02  # then samples no bigger than this share of a bucket fill what is left
HOME_TOL = 0.1  # in a packing round, an item may swap to its home bin within 10% in size
BINDING = 0.98  # phases whose long-run demand is within 2% of the largest one's bind
SWAP_SHORT = 0.02  # a phase this far below what it may take trades samples (_swap)
MANY_BUCKETS = 128  # beyond this many buckets the planner works coarser (see __init__)
HEADROOM = 1 / 3  # a non-binding phase's microbatch takes <= its share + this of the rest


def size_class(sizes: np.ndarray) -> np.ndarray:
    """Sizes within about SIZE_TOL of each other share a class (integer bounds, so that every
    host computes the same classes: no transcendental function whose last bit may differ)."""
    top = int(sizes.max(initial=1))
    if top < _CLASS_LUT_MAX:
        return _class_lut(top)[sizes]
    return np.searchsorted(_class_bounds(top), sizes, "right")


_CLASS_LUT_MAX = 1 << 20
_class_cache: dict[str, np.ndarray] = {}


def _class_bounds(top: int) -> np.ndarray:
    """The class bounds 1, 2, ..., each SIZE_TOL (at least 1) above the last, past `top`."""
    bounds = [1]
    while bounds[-1] <= top:
        bounds.append(bounds[-1] + max(1, int(bounds[-1] * SIZE_TOL)))
    return np.array(bounds, np.int64)


def _class_lut(top: int) -> np.ndarray:
    """size -> class for sizes 0..top (at least), built once and grown by doubling."""
    lut = _class_cache.get("lut")
    if lut is None or len(lut) <= top:
        n = max(2 * top + 2, 1 << 12)
        lut = np.searchsorted(_class_bounds(n), np.arange(n), "right")
        _class_cache["lut"] = lut
    return lut


def pack_phase(
    sizes: np.ndarray,
    load: np.ndarray,
    quad: np.ndarray,
    cap: int,
    first: np.ndarray | None = None,
    home: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Assigns items to bins of capacity `cap`, equalising fill and attention cost.

    Args:
      sizes: item sizes.
      load, quad: per bin, units and sum of squared item sizes already there (updated in place).
      cap: bin capacity.
      first: items to place before all others (urgent ones), wherever they fit.
      home: per item, the bin it would rather sit in (its text's device), or None: within a
        round, an item goes there if that bin was to take an item within HOME_TOL of its size.

    Returns:
      (bin per item, -1 where it did not fit; exchange group per item: items of one group
      are within about SIZE_TOL in size, so they may trade bins at almost no cost; -1 for the
      few placed one by one at the end, and for those that did not fit).
    """
    n, nb = len(sizes), len(load)
    out = np.full(n, -1, np.int64)
    if n == 0:
        return out, out.copy()
    sq = sizes.astype(np.float64) ** 2
    placeable = min(1.0, float((cap - load).sum()) / max(float(sizes.sum()), 1.0))
    qstar = (float(quad.sum()) + placeable * float(sq.sum())) / nb  # each bin's final share
    order = desc_order(sizes, first)
    n_first = int(first.sum()) if first is not None else 0
    # Rounds for the urgent and the big items, largest first.
    rest_sq = sq[order[n_first:]]
    # (items within SIZE_TOL of the smallest one need no rounds: any even layout suits them)
    small = max(BIG * qstar, (float(sizes.min()) * (1 + SIZE_TOL)) ** 2)
    big_end = n_first + int(np.searchsorted(-rest_sq, -small, "right"))
    pos, failed = 0, []
    neg_sorted = -sizes[order[:big_end]]  # (ascending within each of the two segments)
    while pos < big_end:
        urgent = pos < n_first
        end = n_first if urgent else big_end
        start = pos
        pos = _round(order, pos, end, sizes, sq, load, quad, cap, qstar, out, urgent, home)
        if pos == start:  # none fits the next item: all bigger than the most room fail at once
            room = int((cap - load).max())
            pos = start + max(int(np.searchsorted(neg_sorted[start:end], -room, "left")), 1)
            failed.append(order[start:pos])
        elif pos < 0:  # few bins have room left: the last ones fill the gaps (_fit_rest)
            failed.append(order[start:end])
            pos = end
    # The small ones: first at home, up to each home bin's share of them, then the rest in
    # passes.
    rest = order[big_end:]
    at_home, room = None, cap
    if home is not None and len(rest):
        free = cap - load
        share = free * min(1.0, float(sizes[rest].sum()) / max(float(free.sum()), 1.0))
        target = np.minimum(cap, np.ceil(load + share).astype(np.int64))
        at_home = _home_small(rest, sizes, sq, home, share, load, quad, out)
        rest = rest[~at_home]
        room = target  # (the passes fill each bin up to the same share of its room: the bins
        # whose own items took less of it get more of the others)
    s_rest, sq_rest = sizes[rest], sq[rest]
    vol = np.cumsum(s_rest)
    start = 0
    # (about a bin's share of items a pass at least: a few items need no 8 passes)
    for p in range(min(PASSES, -(-len(rest) // nb)), 0, -1):
        # each pass takes 1/p of the volume left (an integer bound: the same first vol >= it)
        done = int(vol[start - 1]) if start else 0
        bound = done - (done - int(vol[-1])) // p
        k = len(rest) if p == 1 else start + int(np.searchsorted(vol[start:], bound)) + 1
        chunk = rest[start:k]
        ok = _cut(chunk, s_rest[start:k], sq_rest[start:k], load, quad, room, qstar, out)
        failed.append(chunk[~ok])
        start = k
    group = np.where(out >= 0, size_class(sizes), -1)
    if at_home is not None:
        group[order[big_end:][at_home]] = -1  # (at home: nothing to gain from a trade)
    if failed:
        late = np.concatenate(failed)
        _fit_rest(late, sizes, sq, load, quad, cap, out, max(16, -(-len(late) // nb) + 4))
        group[late] = -1
    return out, group


def _home_small(rest, sizes, sq, home, share, load, quad, out) -> np.ndarray:
    """Places small items (`rest`, largest first) in their home bin, each bin taking at most
    `share` of them (per bin: the same share of its room as the passes would give it);
    returns the mask (over `rest`) of those placed.

    For items this small the passes' order by want hardly moves the attention balance, and
    most of them (video frames, small images, short clips) can sit at home: their encoder
    rows then need no exchange, and localize need not trade them (a sort of every item)."""
    h = home[rest]
    s = sizes[rest]
    o = argsort_stable(h, len(load))  # by home, largest first within it
    hs, ss = h[o], s[o]
    fits = run_cumsum(hs, ss) <= share[hs]
    at = np.empty(len(rest), bool)
    at[o] = fits
    idx, hb = rest[at], h[at]
    out[idx] = hb
    load += np.bincount(hb, sizes[idx], len(load)).astype(load.dtype)  # (exact)
    quad += np.bincount(hb, sq[idx], len(load))
    return at


FEW_OPEN = 16  # rounds end when under 1/16 of the bins have room for the next item
# Items per open bin an LLM round aims at: 2 would halve its rounds, but on omni it costs 2%
# of attention balance.
ROUND_FILL = 1
# Encoder rounds (items with a home) aim at two items per open bin: their rounds cost more
# (_prefer_home), and on omni at 512 devices this takes ~5 ms off a step with the same
# attention balance; more encoder rows go away from home (routed 0.36 -> 0.47).
ENC_ROUND_FILL = 2
# Under this many open bins a round takes only the bins above what the top bin wants after its
# item, one item each (the sequential greedy's next step): rounds cost little there, and the
# coarser level rounds raised the microbatch cost CV by ~10% at 8 devices (chartqa).
FAST_BINS = 64


def _round(order, pos, end, sizes, sq, load, quad, cap, qstar, out, urgent, home):
    """One packing round over order[pos:end] (largest first). Returns the new position: pos
    if the next item fits nowhere, -1 if under 1/FEW_OPEN of the bins have room for it (the
    rest then fill the gaps in _fit_rest instead of in rounds of one or two items).

    A bin wants items of size w = (attention budget left) / (room left). An item of size s
    moves w away from s (down if s > w, up if s < w), so the sequential greedy "each item,
    largest first, to the bin that wants the biggest" brings the top wants down to a common
    level: a bin above it takes items until its want is at the level (and one that wants at
    least s keeps taking them until it is full), bins below it wait for smaller items. A
    round does the same at once for the level where the bins above it take about one item
    per open bin in all (`_deal`): each takes the number of items of the next item's size it
    needs, dealt largest first in layers (one to each bin by want, then a second to those
    that take two, ...). So a round places about as many items as there are open bins
    (before: only the bins that wanted at least what the top bin would want after its item
    took one, ~130 of 512 on ai2d, ~340 rounds a step). Urgent items go one per open bin, to
    the bins that want the biggest."""
    nxt = int(sizes[order[pos]])
    free = cap - load
    closed = free < nxt  # every item left is <= nxt, so the others take any one of them
    n_closed = int(np.count_nonzero(closed))
    n_open = len(free) - n_closed
    if not n_open:
        return pos
    if not urgent and n_open * FEW_OPEN < len(free) and n_open < end - pos:
        return -1
    key = quad - qstar
    key /= np.maximum(free, 1)  # minus the item size the bin wants
    if n_closed:
        key[closed] = np.inf
    ranked = smallest(key, n_open)  # open bins, wanting the biggest first
    if urgent:
        bins = ranked[: end - pos]
        first_layer = len(bins)
    else:
        fill = ROUND_FILL if home is None else ENC_ROUND_FILL
        count = _deal(key[ranked], free[ranked], nxt, qstar - quad[ranked[0]], fill)
        first_layer = len(count)
        top = int(count.max())
        if top == 1:
            bins = ranked[: min(first_layer, end - pos)]
        elif top <= 8:  # (the same layers, one at a time: cheaper than a sort for a few)
            limit = min(end - pos, max(fill * n_open, first_layer))
            layers, got = [ranked[:first_layer]], first_layer
            for lay in range(1, top):
                if got >= limit:
                    break
                layers.append(ranked[np.flatnonzero(count > lay)])
                got += len(layers[-1])
            bins = np.concatenate(layers)[:limit]
        else:  # layers: one item to each bin by want, then a second to those that take two...
            rep = np.repeat(np.arange(first_layer), count)
            layer = np.arange(len(rep)) - np.repeat(np.cumsum(count) - count, count)
            bins = ranked[rep[np.argsort(compact_keys(layer), kind="stable")]]
            bins = bins[: min(end - pos, max(fill * n_open, first_layer))]
        first_layer = min(first_layer, len(bins))
    take = order[pos : pos + len(bins)]
    distinct = first_layer == len(bins)
    s_take = sizes[take]
    if home is not None and len(bins) > 1:
        bins = _prefer_home(bins, s_take, home[take], len(load))
    out[take] = bins
    if distinct:
        load[bins] += s_take
        quad[bins] += sq[take]
    else:
        load += np.bincount(bins, s_take, len(load)).astype(load.dtype)  # (exact)
        quad += np.bincount(bins, sq[take], len(load))
    return pos + len(take)


def _deal(neg_want, free, s, budget_top, fill):
    """Per bin above the round's level (a prefix of the open bins by want), the number of
    items of size `s` it takes (see _round). `neg_want`, `free`: the open bins' minus wants
    (ascending) and rooms; `s`: the next item's size (the largest left: counted with it, a
    bin never gets more than its room); `budget_top`: the attention budget left in the top
    bin; `fill`: items per open bin the round aims at."""
    n = len(neg_want)
    # A bin of want w and room f above the level L takes (w - L) f / (s (s - L)) items to
    # come down to L. Over all open bins, fill * n items need L = (sum(w f) - T s^2) /
    # (sum(f) - T s) (bins below it would count negative: the bins above it take more, and
    # the round stops at T items); at most what the top bin wants after one item.
    t = fill * n
    f = free.astype(np.float64)
    sum_f = float(f.sum())
    after = min((budget_top - float(s) * s) / max(float(f[0]) - s, 1.0), -float(neg_want[0]))
    if n < FAST_BINS:  # (few bins: rounds are cheap, take the sequential greedy's own step)
        level = after
    elif sum_f > t * s:
        level = min((-float(neg_want @ f) - t * s * s) / (sum_f - t * s), after)
    else:  # (they cannot take so many: every bin takes all it has room for)
        level = -np.inf
    k = max(int(np.searchsorted(neg_want, -level, "left")), 1)
    if level == -np.inf:
        return free[:k] // s
    if k == n and fill == 1:  # (every open bin is above the level and the round takes one each)
        return np.ones(n, np.int64)
    lv = min(level, s - 1e-6)  # (bins that want s or more take all they have room for)
    x = (neg_want[:k] + lv) * f[:k]
    x *= -1.0 / (s * (s - lv))
    x += 1 - 1e-9  # (ceil, and at least one: x > 0 above the level)
    c = x.astype(np.int64)
    np.minimum(c, free[:k] // s, out=c)
    return np.maximum(c, 1, out=c)  # (open bins have room for one; float edge cases)


def _prefer_home(bins: np.ndarray, s: np.ndarray, home: np.ndarray, nb: int) -> np.ndarray:
    """Rematches one round (item i -> bins[i], both largest first) so that an item whose home
    bin takes an item of about its size in this round (within HOME_TOL) goes home instead; the
    others keep the order of the rest."""
    k = len(bins)
    rank_of = np.full(nb, -1, np.int64)
    rank_of[bins] = np.arange(k)
    r = rank_of[home]
    cand = np.flatnonzero(r >= 0)
    sc = s[cand]
    rc = r[cand]
    keep = np.abs(sc - s[rc]) <= HOME_TOL * sc
    cand, rc = cand[keep], rc[keep]
    if not len(cand):
        return bins
    hc = home[cand]
    first_of = np.empty(nb, np.int64)  # one item per home bin: its first
    first_of[hc[::-1]] = cand[::-1]
    one = first_of[hc] == cand
    claimed = np.zeros(k, bool)
    claimed[rc[one]] = True
    mine = np.zeros(k, bool)
    mine[cand[one]] = True
    out = np.empty(k, np.int64)
    out[mine] = hc[one]
    out[~mine] = bins[~claimed]
    return out


def _cut(chunk, s, s_sq, load, quad, cap, qstar, out) -> np.ndarray:
    """Lays out `chunk` (largest first; sizes `s`, squares `s_sq`) as contiguous runs over the
    bins in order of the item size they want, each run proportional to the bin's room; returns
    the mask of items placed (an item past its bin's room is not)."""
    nb = len(load)
    if not len(s):
        return np.zeros(0, bool)
    free = cap - load
    want = (qstar - quad) / np.maximum(free, 1)
    border = np.argsort(-want, kind="stable")
    frac = min(1.0, float(s.sum()) / max(float(free.sum()), 1.0))
    ends = np.cumsum(free[border] * frac)
    cum = np.cumsum(s)
    mid = cum - 0.5 * s  # an item goes to the first run whose end is past its middle
    # (the last run takes what is left): the runs' first items, by a search per bin
    starts = np.zeros(nb + 1, np.int64)
    starts[1:nb] = np.searchsorted(mid, ends[:-1], "left")
    starts[nb] = len(s)
    count = np.diff(starts)
    before = cum[np.maximum(starts[:nb] - 1, 0)]  # volume ahead of each run
    before[starts[:nb] == 0] = 0
    within = cum - np.repeat(before, count)
    b = np.repeat(border, count)
    ok = within <= free[b]
    if ok.all():
        out[chunk] = b
        load += np.bincount(b, s, nb).astype(load.dtype)  # (exact: sums far below 2**53)
        quad += np.bincount(b, s_sq, nb)
        return ok
    b = b[ok]
    out[chunk[ok]] = b
    load += np.bincount(b, s[ok], nb).astype(load.dtype)
    quad += np.bincount(b, s_sq[ok], nb)
    return ok


def _fit_rest(idx, sizes, sq, load, quad, cap, out, rounds: int = 16) -> None:
    """What missed, largest first, a round at a time to the bins with the most room."""
    idx = idx[desc_order(sizes[idx])]
    nb = len(load)
    for _ in range(rounds):
        idx = idx[sizes[idx] <= cap - load.min()]
        if not len(idx):
            return
        take = idx[:nb]
        bins = np.argsort(load, kind="stable")[: len(take)]
        ok = load[bins] + sizes[take] <= cap
        out[take[ok]] = bins[ok]
        load[bins[ok]] += sizes[take[ok]]
        quad[bins[ok]] += sq[take[ok]]
        idx = np.concatenate([take[~ok], idx[nb:]])


def _fits(w: np.ndarray, left: np.ndarray) -> np.ndarray:
    """Mask of the columns of w [phase, item] that are <= left in every phase."""
    ok = w[0] <= left[0]
    for p in range(1, len(w)):
        ok &= w[p] <= left[p]
    return ok


class _Micro:
    """Bucket loads and placements of one microbatch while it is being filled."""

    def __init__(self, caps: Capacities):
        self.rows = np.zeros(caps.devices * caps.llm_rows, np.int64)
        self.enc = {p: np.zeros(caps.devices, np.int64) for p in ENC}
        self.rows_q = np.zeros(caps.devices * caps.llm_rows)  # sum of squared sizes
        self.enc_q = {p: np.zeros(caps.devices) for p in ENC}
        z = np.zeros(0, np.int64)
        self.entries: list[np.ndarray] = [z]  # pool positions placed, in order
        self.row_bin: list[np.ndarray] = [z]  # their LLM row bin (device * rows + row)
        # per phase: (owner entry, item number, size, device) of placed items
        self.items: dict[str, list[tuple[np.ndarray, ...]]] = {p: [] for p in ENC}
        self.remote: dict[str, tuple[np.ndarray, np.ndarray]] = {
            p: (np.zeros(0, np.int64), np.zeros(0, np.int64)) for p in ENC
        }


class BalancedPlanner:
    """Ours, joint per device: a sample's text and media share a device (no routing)."""

    routed = False

    def __init__(
        self,
        index: LengthsIndex,
        caps: Capacities,
        seed: int,
        *,
        max_age: int = 4,
        lookahead: float = 0.5,
    ):
        self._check(index, caps)
        self.index, self.caps, self.seed = index, caps, seed
        self.max_age = max_age
        # Beyond MANY_BUCKETS buckets (microbatches x devices) a step's totals are sums over
        # so many samples that their spread is small: the window overfills the step by
        # lookahead * sqrt(MANY_BUCKETS / buckets) of its capacity instead of `lookahead`
        # (what selection needs to even out the phases grows as the square root of the
        # samples in a step, not in proportion), and `orchestrated` leaves out the slack pass
        # after each microbatch (it adds ~0.1% LLM fill at 512 devices, for ~5 ms of planning
        # a step; `balanced`, packing whole samples per device, leaves 3% that it fills).
        # omni at 512 devices: the same fill, balance and ages with half the samples waiting
        # (24k -> 12k).
        buckets = caps.microbatches * caps.devices
        self.lookahead = lookahead * min(1.0, (MANY_BUCKETS / max(buckets, 1)) ** 0.5)
        self.slack_pass = buckets <= MANY_BUCKETS or not self.routed
        self.stream = SampleStream(len(index), seed)
        self.llm = index.llm_tokens(caps.merge_area, caps.subsample)
        self.sizes = {"vision": index.images, "audio": index.audio}
        self.ptr = {"vision": index.images_ptr, "audio": index.audio_ptr}
        self.per_row = {"vision": caps.merge_area, "audio": caps.subsample}
        self.cap = {"vision": caps.vision_patches, "audio": caps.audio_frames}
        # A route capacity of a device's whole encoder output can never overflow.
        self._route_free = {
            p: caps.route_pair_capacity >= self.cap[p] // self.per_row[p] for p in ENC
        }
        self.work = np.stack(
            [
                self.llm,
                index.per_sample_sum(index.images, index.images_ptr),
                index.per_sample_sum(index.audio, index.audio_ptr),
            ],
            1,
        )
        self.work_t = np.ascontiguousarray(self.work.T)  # [phase, sample], for fast columns
        self.cap_vec = np.array(
            [caps.llm_rows * caps.llm_row_len, caps.vision_patches, caps.audio_frames], np.int64
        )
        self.mean_work = self.work.mean(0) if len(index) else np.ones(3)
        # Long-run share of its capacity each phase fills when the most demanding one is full.
        demand = np.where(self.cap_vec > 0, self.mean_work / np.maximum(self.cap_vec, 1), 0)
        self.share = demand / max(demand.max(), 1e-30)
        # A phase that does not bind (its long-run demand under BINDING of the largest) gets
        # at most its share of a microbatch plus HEADROOM of the rest: taking all the window
        # offers would leave the next microbatch (or step) short of it, and its buckets' cost
        # would swing with the window (omni at 8 devices, vision: microbatch cost CV 0.0139
        # -> 0.0112 over 12 steps). A binding phase may fill its whole capacity.
        nonbinding = (self.share > 0) & (self.share < BINDING)
        self.micro_cap = np.where(nonbinding, self.share + HEADROOM * (1 - self.share), 1.0)
        self.cursor, self.step = 0, 0
        self.deferred = np.zeros((0, 2), np.int64)  # (sample, stream step it was pulled at)
        self.ages = np.zeros(0, np.int64)

    def _check(self, index: LengthsIndex, caps: Capacities) -> None:
        check_fits(index, caps)

    # ------------------------------------------------------------------ carried state

    def get_state(self) -> dict:
        """Carried state: cursor, step and the deferred queue (sample, step pulled), JSON-able."""
        return {
            "step": int(self.step),
            "cursor": int(self.cursor),
            "deferred": self.deferred.tolist(),
        }

    def set_state(self, state: dict) -> None:
        self.step, self.cursor = int(state["step"]), int(state["cursor"])
        self.deferred = np.array(state.get("deferred", []), np.int64).reshape(-1, 2)

    # ------------------------------------------------------------------ one step

    def plan(self) -> StepPlan:
        """Plans the next step and advances the state."""
        caps, step = self.caps, self.step
        pool = self._pull()
        samples, since = pool[:, 0], pool[:, 1]
        urgent = step - since >= self.max_age - 1
        taken = np.zeros(len(pool), bool)
        work = np.take(self.work_t, samples, axis=1)  # [phase, pool position]
        left = work.sum(1)  # work of the pool not yet taken
        micros = []
        for m in range(caps.microbatches):
            mb = _Micro(caps)
            # Across microbatches first: each gets at most an equal share of what is left.
            share = left / (caps.microbatches - m)
            sel = self._select(work, taken, share, urgent=urgent)
            self._add(mb, sel, samples, urgent)
            taken[np.concatenate(mb.entries)] = True
            # Slack left: the next samples of the window that fit it, in the same order.
            if self.slack_pass:
                sel = self._select(work, taken, self._free(mb), small=True)
                self._add(mb, sel, samples, urgent)
            placed = np.concatenate(mb.entries)
            taken[placed] = True
            left = left - np.take(work, placed, axis=1).sum(1)
            micros.append(mb)
        self.deferred = pool[~taken]
        self.step += 1
        return self._emit(step, micros, samples, since)

    def _pull(self) -> np.ndarray:
        """Deferred samples then fresh ones, until every phase holds its long-run share of the
        step's capacity plus `lookahead`, or one phase its whole capacity plus `lookahead` (a
        rare modality must not make the window, and so the waits, grow)."""
        m = self.caps.microbatches * self.caps.devices
        budget = np.where(self.share > 0, m * self.cap_vec * self.share, np.inf)
        goal = (1 + self.lookahead) * budget
        have = np.take(self.work_t, self.deferred[:, 0], axis=1).sum(1)
        per = np.where(self.cap_vec > 0, self.mean_work, 0)
        need = np.where(per > 0, np.where(np.isfinite(goal), goal, 0) - have, 0)
        n = int((need / np.maximum(per, 1e-9)).max()) + 16
        n = max(n * 5 // 4, 16)
        # Each phase's running sum never falls (work >= 0): the first sample at which it reaches
        # its bound (the integer above it) is a binary search away, and the window ends at the
        # first sample where every phase with a share is in, or one phase is full.
        all_in = [(p, goal[p] - have[p]) for p in range(len(goal)) if self.share[p] > 0]
        one_full = [
            (p, (1 + self.lookahead) * m * self.cap_vec[p] - have[p])
            for p in range(len(goal))
            if self.cap_vec[p] > 0
        ]
        while True:
            fresh = self.stream.take(self.cursor, n)
            cum = np.cumsum(np.take(self.work_t, fresh, axis=1), 1)
            first = [int(np.searchsorted(cum[p], int(np.ceil(b)), "left")) for p, b in all_in]
            k = max(first, default=0)
            for p, b in one_full:
                k = min(k, int(np.searchsorted(cum[p], int(np.ceil(b)), "left")))
            if k < n or n > m * self.cap_vec[0]:  # (only empty samples get here)
                k = k + 1 if k < n else n
                break
            n *= 2
        fresh = np.stack([fresh[:k], np.full(k, self.step)], 1)
        self.cursor += k
        return np.concatenate([self.deferred, fresh])

    def _select(
        self,
        work: np.ndarray,
        taken: np.ndarray,
        share: np.ndarray,
        rounds: int = 32,
        small: bool = False,
        urgent: np.ndarray | None = None,
    ) -> np.ndarray:
        """Pool positions (priority order) that together fit one microbatch in every phase and
        take at most about `share` of each phase's work (with `small`: exactly `share`, and
        only samples no bigger than SMALL of a bucket in any phase). `work`: [phase, pool
        position]."""
        full = self.caps.devices * self.cap_vec.astype(np.float64) * FILL
        left = np.minimum(full, np.where(share > 0, share * 1.02, full))
        left = np.minimum(left, full * self.micro_cap)  # (non-binding phases: see __init__)
        if small:
            left = np.where(self.cap_vec > 0, share, 0.0)
        chosen = np.zeros(taken.shape, bool)
        cand = np.flatnonzero(~taken)
        bound = SMALL * self.cap_vec if small else None
        # Each round takes the longest prefix of the candidates that fit (each on its own) whose
        # running sum fits, and drops the next one that fits. Sizes are >= 0, so `left` never
        # grows and a candidate that does not fit now never will: the rounds scan the
        # candidates once, in chunks (doubling), instead of filtering and summing all those
        # left each round (the same picks and the same `left`: integer sums).
        pos, n = 0, len(cand)
        for _ in range(rounds):
            picks, total, step = [], np.zeros(len(work), work.dtype), 1024
            while pos < n:
                c = cand[pos : pos + step]
                wc = np.take(work, c, axis=1)
                fit = _fits(wc, left)
                if bound is not None:
                    fit &= _fits(wc, bound)
                i = np.flatnonzero(fit)
                if not len(i):
                    pos, step = pos + len(c), 2 * step
                    continue
                cw = np.cumsum(np.take(wc, i, axis=1), 1)
                cw += total[:, None]
                ok = _fits(cw, left)
                if ok.all():
                    picks.append(c[i])
                    total = cw[:, -1]
                    pos, step = pos + len(c), 2 * step
                    continue
                k = int(np.argmin(ok))
                picks.append(c[i[:k]])
                if k:
                    total = cw[:, k - 1]
                pos += int(i[k]) + 1  # (the one that did not fit, at k, is out)
                break
            if not picks:
                break
            chosen[np.concatenate(picks)] = True
            left = left - total
        if urgent is not None:
            self._swap(work, taken, chosen, left, urgent)
        return np.flatnonzero(chosen)

    def _swap(
        self,
        work: np.ndarray,
        taken: np.ndarray,
        chosen: np.ndarray,
        left: np.ndarray,
        urgent: np.ndarray,
    ) -> None:
        """Trades chosen samples for others of the window when a phase is left short.

        Taking samples in priority order can fill one phase (say the LLM, with text-only
        chats) while another (audio) has room that no sample in order fits without text; a
        phase that does not bind can likewise end well under its microbatch cap (see
        __init__), and its buckets' cost then swings from step to step. Then the window's
        samples richest in the short phase p (its share of a bucket over the other phases'
        shares) come in, and the chosen non-urgent samples poorest in it (youngest first)
        wait for a later step, as many as make room in the fullest phase q: the number of
        trades that gains p most with every phase within what is left of its share
        (`left`). Updates `chosen` in place. On omni at 8 devices audio fill goes 0.972 ->
        0.990 (with the 0.5 look-ahead; 0.986 -> 0.993 at 64); counting the non-binding
        vision too (trades that keep every other binding phase), the microbatch cost CV
        ratio random/ours over 12 steps goes 13.0x -> 16.0x, over an epoch (29 steps)
        9.4x -> 10.5x, audio fill 0.988 both. Urgent samples never wait.
        """
        full = self.caps.devices * self.cap_vec * FILL
        rel = left / np.maximum(full, 1)
        p = int(np.argmax(np.where(full > 0, rel, -1.0)))
        q = int(np.argmin(np.where(full > 0, rel, np.inf)))
        if rel[p] < SWAP_SHORT or p == q:
            return
        add = np.flatnonzero(~taken & ~chosen & (work[p] > 0))
        rem = np.flatnonzero(chosen & ~urgent)[::-1]  # (youngest first)
        if not len(add) or not len(rem):
            return
        # Only the few best of each side matter: about 4x what the gap can take.
        others = np.where((np.arange(len(full)) != p) & (full > 0), 1.0 / np.maximum(full, 1), 0)
        k = min(len(add), int(4 * left[p] / max(float(work[p, add].mean()), 1.0)) + 16)
        wa = np.take(work, add, axis=1)
        add = add[smallest(-wa[p] / np.maximum(others @ wa, 1e-12), k)]
        wa = np.cumsum(np.take(work, add, axis=1), 1)  # [phase, adds]
        k = min(len(rem), int(4 * wa[q, -1] / max(float(work[q, rem].mean()), 1.0)) + 16)
        wr = np.take(work, rem, axis=1)
        rem = rem[smallest(wr[p] / np.maximum(others @ wr, 1e-12), k)]
        wr = np.zeros((len(work), len(rem) + 1), work.dtype)
        np.cumsum(np.take(work, rem, axis=1), 1, out=wr[:, 1:])  # [phase, removals]
        # per count of adds, the fewest removals that make room in q
        j = np.searchsorted(wr[q], wa[q] - left[q], "left")
        ok = j < wr.shape[1]
        j = np.minimum(j, wr.shape[1] - 1)
        net = wa - wr[:, j]
        ok &= (net <= left[:, None]).all(0) & (net[p] > 0)
        if self.share[p] < BINDING:  # (for a phase that does not bind, no binding phase
            # but the fullest one gives anything up: omni's audio clips stay in)
            keep = (self.share >= BINDING) & (np.arange(len(full)) != q) & (full > 0)
            ok &= (net[keep] >= 0).all(0)
        if not ok.any():
            return
        i = int(np.argmax(np.where(ok, net[p], -1)))
        chosen[add[: i + 1]] = True
        chosen[rem[: j[i]]] = False

    def _free(self, mb: _Micro) -> np.ndarray:
        """Units still free in each phase of the microbatch."""
        used = np.array([mb.rows.sum(), mb.enc["vision"].sum(), mb.enc["audio"].sum()])
        return self.caps.devices * self.cap_vec - used

    # ------------------------------------------------------------------ placement

    def _add(
        self, mb: _Micro, entries: np.ndarray, samples: np.ndarray, urgent: np.ndarray
    ) -> None:
        """Places what it can of `entries` into the microbatch (all parts of a sample or none)."""
        if not len(entries):
            return
        s = samples[entries]
        rows = self._assign(mb, s, urgent[entries])
        items = {}
        ok = rows >= 0
        for p in ENC:
            owner, j, flat = gather_items(self.ptr[p], s)
            items[p] = (owner, j, self.sizes[p][flat])
        ok, devs = self._assign_items(mb, rows, items, urgent[entries], ok)
        # Roll back the samples that did not get all their parts.
        bad = np.flatnonzero(~ok & (rows >= 0))
        np.subtract.at(mb.rows, rows[bad], self.llm[s[bad]])
        np.subtract.at(mb.rows_q, rows[bad], self.llm[s[bad]].astype(np.float64) ** 2)
        for p in ENC:
            owner, j, size = items[p]
            dev = devs[p]
            drop = ~ok[owner] & (dev >= 0)
            np.subtract.at(mb.enc[p], dev[drop], size[drop])
            np.subtract.at(mb.enc_q[p], dev[drop], size[drop].astype(np.float64) ** 2)
            keep = ok[owner]
            mb.items[p].append((entries[owner[keep]], j[keep], size[keep], dev[keep]))
        mb.entries.append(entries[ok])
        mb.row_bin.append(rows[ok])

    def _assign(self, mb: _Micro, s: np.ndarray, urgent: np.ndarray) -> np.ndarray:
        """Joint: whole samples to devices (vector bin packing), then a row on that device."""
        caps = self.caps
        d_n, r_n, row_len = caps.devices, caps.llm_rows, caps.llm_row_len
        w = self.work[s]
        cap = self.cap_vec
        norm = np.where(cap > 0, w / np.maximum(cap, 1), 0).max(1)
        order = np.lexsort((-norm, ~urgent))
        out = np.full(len(s), -1, np.int64)
        rows2 = mb.rows.reshape(d_n, r_n)
        enc = np.stack([mb.enc["vision"], mb.enc["audio"]], 1)  # [D, 2] (copy, written back)
        for start in range(0, len(s), d_n):
            idx = order[start : start + d_n]
            dev_load = np.concatenate([rows2.sum(1, keepdims=True), enc], 1)
            score = (dev_load / np.maximum(cap, 1)).max(1)
            devs = np.argsort(score, kind="stable")[: len(idx)]
            r = np.argmin(rows2[devs], 1)
            ok = (rows2[devs, r] + w[idx, 0] <= row_len) & (enc[devs] + w[idx, 1:] <= cap[1:]).all(
                1
            )
            devs, r, idx = devs[ok], r[ok], idx[ok]
            rows2[devs, r] += w[idx, 0]
            enc[devs] += w[idx, 1:]
            out[idx] = devs * r_n + r
        missed = order[out[order] < 0]
        for i in missed[:64]:
            fits_enc = (enc + w[i, 1:] <= cap[1:]).all(1)
            r = np.argmin(rows2, 1)
            fits = fits_enc & (rows2[np.arange(d_n), r] + w[i, 0] <= row_len)
            if not fits.any():
                continue
            slack = (cap[1:] - enc).sum(1) + (row_len - rows2[np.arange(d_n), r])
            d = int(np.argmin(np.where(fits, slack, np.iinfo(np.int64).max)))
            rows2[d, r[d]] += w[i, 0]
            enc[d] += w[i, 1:]
            out[i] = d * r_n + r[d]
        mb.enc["vision"][:], mb.enc["audio"][:] = enc[:, 0], enc[:, 1]
        return out

    def _assign_items(self, mb, rows, items, urgent, ok):
        """Joint: media sit on their text's device (already counted in the loads)."""
        devs = {}
        for p in ENC:
            owner = items[p][0]
            devs[p] = np.where(rows[owner] >= 0, rows[owner] // self.caps.llm_rows, -1)
        return ok, devs

    # ------------------------------------------------------------------ output

    def _emit(
        self, step: int, micros: list[_Micro], samples: np.ndarray, since: np.ndarray
    ) -> StepPlan:
        # Each microbatch's arrays concatenated straight into the step's (int64 already: no
        # astype copies), its offsets computed while they are in cache (one sort over all
        # microbatches, keyed by microbatch and bin, gives the same offsets but is slower).
        r_n = self.caps.llm_rows
        counts = [sum(len(x) for x in mb.entries) for mb in micros]
        e, rb, off = (np.empty(sum(counts), np.int64) for _ in range(3))
        a = 0
        for mb, c in zip(micros, counts, strict=True):
            np.concatenate(mb.entries, out=e[a : a + c])
            np.concatenate(mb.row_bin, out=rb[a : a + c])
            off[a : a + c] = offsets_in_bins(rb[a : a + c], self.llm[samples[e[a : a + c]]])
            a += c
        micro = np.repeat(np.arange(len(micros)), counts)
        pos_of = np.empty(len(samples), np.int64)  # (entries are distinct pool positions)
        pos_of[e] = np.arange(len(e))
        dev, row = np.divmod(rb, r_n)
        self.ages = step - since[e]
        plans = {}
        for p in ENC:
            if not any(mb.items[p] for mb in micros):
                plans[p] = ItemPlan.empty()
                continue
            counts = [sum(len(q[0]) for q in mb.items[p]) for mb in micros]
            it = ItemPlan(*(np.empty(sum(counts), np.int64) for _ in range(4)))
            a = 0
            for mb, c in zip(micros, counts, strict=True):
                if not mb.items[p]:
                    continue
                ent, j, size, idev = zip(*mb.items[p], strict=True)
                # (owners already by owner, then item: the order they were added)
                np.take(pos_of, np.concatenate(ent), out=it.owner[a : a + c])
                np.concatenate(j, out=it.item[a : a + c])
                np.concatenate(idev, out=it.device[a : a + c])
                it.offset[a : a + c] = offsets_in_bins(it.device[a : a + c], np.concatenate(size))
                a += c
            plans[p] = it
        return StepPlan(
            step=step,
            samples=samples[e],
            micro=micro,
            device=dev,
            row=row,
            offset=off,
            vision=plans["vision"],
            audio=plans["audio"],
            deferred=len(self.deferred),
        )


class OrchestratedPlanner(BalancedPlanner):
    """Ours, per phase with routing: images and clips may be encoded away from their text."""

    routed = True

    def _check(self, index: LengthsIndex, caps: Capacities) -> None:
        if caps.route_pair_capacity <= 0:
            raise OversizeError(
                "batch.planner=orchestrated routes encoder outputs between "
                "devices: set batch.route_pair_capacity > 0 (e.g. the largest "
                "item's encoder rows, or vision_patches / merge^2)"
            )
        llm = index.llm_tokens(caps.merge_area, caps.subsample)
        checks = [("batch.llm_row_len", llm, caps.llm_row_len)]
        for key, values, cap, per in (
            ("batch.vision_patches", index.images, caps.vision_patches, caps.merge_area),
            ("batch.audio_frames", index.audio, caps.audio_frames, caps.subsample),
        ):
            if len(values) and not cap:
                phase = "vision" if "vision" in key else "audio"
                share = "image_fraction" if phase == "vision" else "audio_fraction"
                raise OversizeError(
                    f"the data has {phase} items but model.{phase}.enabled is false: enable it, "
                    f"or use data without {phase} (e.g. data.synthetic.{share}: 0)"
                )
            checks.append((key, values, cap))
            if len(values) and values.max() // per > caps.route_pair_capacity:
                raise OversizeError(
                    f"an item needs {int(values.max() // per)} encoder rows, more than "
                    f"batch.route_pair_capacity={caps.route_pair_capacity}; raise it"
                )
        for key, need, cap in checks:
            bad = np.flatnonzero(need > cap)
            if len(bad):
                raise OversizeError(
                    f"{len(bad)} item(s) need more than {key}={cap} (the "
                    f"largest needs {int(need.max())}); raise {key}"
                )

    def _assign(self, mb: _Micro, s: np.ndarray, urgent: np.ndarray) -> np.ndarray:
        """LLM phase on its own: samples to rows (bins of llm_row_len)."""
        rows, _ = pack_phase(self.llm[s], mb.rows, mb.rows_q, self.caps.llm_row_len, urgent)
        return rows

    def _assign_items(self, mb, rows, items, urgent, ok):
        """Each encoder phase on its own, then exchanges towards the text's device."""
        devs, groups = {}, {}
        home_all = np.where(rows >= 0, rows // self.caps.llm_rows, -1)
        for p in ENC:
            owner, _, size = items[p]
            dev = np.full(len(owner), -1, np.int64)
            group = np.full(len(owner), -1, np.int64)
            sel = np.flatnonzero(ok[owner])
            dev[sel], group[sel] = pack_phase(
                size[sel],
                mb.enc[p],
                mb.enc_q[p],
                self.cap[p],
                urgent[owner[sel]],
                home_all[owner[sel]],
            )
            ok[owner[sel[dev[sel] < 0]]] = False
            devs[p], groups[p] = dev, group
        for p in ENC:  # locality, then the route capacity, on the items that stay
            owner, _, size = items[p]
            dev = devs[p]
            keep = np.flatnonzero(ok[owner])
            home = home_all[owner[keep]]
            old = dev[keep]
            new = localize(groups[p][keep], old, home, self.caps.devices)
            dev[keep] = keep_capacity(
                groups[p][keep], new, old, size[keep], mb.enc[p], mb.enc_q[p], self.cap[p]
            )
            over = self._route_overflow(mb, p, size[keep], dev[keep], home)
            ok[owner[keep[over]]] = False
        for p in ENC:  # record the routed rows of what is finally kept
            if self._route_free[p]:
                continue
            owner, _, size = items[p]
            keep = np.flatnonzero(ok[owner])
            home = home_all[owner[keep]]
            remote = devs[p][keep] != home
            keys = devs[p][keep][remote] * self.caps.devices + home[remote]
            old_k, old_r = mb.remote[p]
            mb.remote[p] = (
                np.concatenate([old_k, keys]),
                np.concatenate([old_r, size[keep][remote] // self.per_row[p]]),
            )
        return ok, devs

    def _route_overflow(
        self, mb: _Micro, p: str, size: np.ndarray, dev: np.ndarray, home: np.ndarray
    ) -> np.ndarray:
        """Mask of items whose (src, dst) pair would exceed batch.route_pair_capacity."""
        d_n = self.caps.devices
        if self._route_free[p]:
            return np.zeros(len(size), bool)
        remote = dev != home
        keys = np.concatenate([mb.remote[p][0], dev[remote] * d_n + home[remote]])
        rows = np.concatenate([mb.remote[p][1], size[remote] // self.per_row[p]])
        order = np.argsort(keys, kind="stable")
        k, r = keys[order], rows[order]
        over_sorted = run_cumsum(k, r) > self.caps.route_pair_capacity
        over_all = np.empty(len(keys), bool)
        over_all[order] = over_sorted
        out = np.zeros(len(size), bool)
        out[np.flatnonzero(remote)] = over_all[len(mb.remote[p][0]) :]
        return out


def localize(group: np.ndarray, dev: np.ndarray, home: np.ndarray, devices: int) -> np.ndarray:
    """Reassigns devices among the items of each exchange group so that most sit at `home`.

    Every device keeps as many items of each group as before (so about the same load and
    attention cost); within a group, as many items as the device has slots stay home. Items of
    group -1 keep their device. O(items + groups * devices), one sort.
    """
    out = dev.copy()
    if not len(group):
        return out
    if group.min() >= 0:  # (the usual case: no gathers, no indirection at the end)
        idx, g, d, h = None, group, dev, home
    else:
        idx = np.flatnonzero(group >= 0)
        if not len(idx):
            return out
        g, d, h = group[idx], dev[idx], home[idx]
    g = g - g.min()
    number = np.cumsum(np.bincount(g) > 0)
    g = number[g]  # the groups present, numbered in order (from 1)
    g -= 1
    n_keys = int(number[-1]) * devices
    g *= devices
    slots = np.bincount(g + d, minlength=n_keys)  # per (group, device)
    g += h
    order, ik = stable_sort(g, n_keys)  # items by (group, home)
    # An item stays home when its rank among the items of its (group, home) is below the
    # slots there: its position in the order is below that key's first position + slots.
    cnt = np.bincount(ik, minlength=n_keys)
    free = slots - cnt
    end = np.cumsum(cnt)
    end += free
    local = np.arange(len(g)) < end[ik]
    stay, move = order[local], order[~local]
    # The others take the slots left (those of a key past its items at home), group by group:
    # both lists run in group order. (flatnonzero of a mask: much faster than of integers.)
    np.maximum(free, 0, out=free)
    keys = np.flatnonzero(free > 0)
    to = np.repeat(keys % devices, free[keys])
    if idx is None:
        out[stay] = h[stay]
        out[move] = to
    else:
        out[idx[stay]] = h[stay]
        out[idx[move]] = to
    return out


def keep_capacity(
    group: np.ndarray,
    new: np.ndarray,
    old: np.ndarray,
    size: np.ndarray,
    load: np.ndarray,
    quad: np.ndarray,
    cap: int,
) -> np.ndarray:
    """Applies the exchanges `old` -> `new` to the bin loads, undoing those of every group that
    touches a bin they would overfill (sizes differ within a group by up to SIZE_TOL)."""
    nb = len(load)
    new = new.copy()
    m = np.flatnonzero(new != old)
    nm, om, sm = new[m], old[m], size[m]  # (the moves, gathered once per attempt)
    for attempt in range(4):
        delta = np.bincount(nm, sm, nb) - np.bincount(om, sm, nb)
        over = load + delta > cap
        if not over.any():
            break
        if attempt < 3:
            gm = group[m]
            undo = np.isin(gm, gm[over[nm] | over[om]])
        else:
            undo = np.ones(len(m), bool)
        new[m[undo]] = om[undo]
        m = m[~undo]  # (the moves left: still in order)
        nm, om, sm = new[m], old[m], size[m]
    else:
        delta = np.bincount(nm, sm, nb) - np.bincount(om, sm, nb)
    sq = sm.astype(np.float64) ** 2
    load += delta.astype(load.dtype)  # (exact: integer sums far below 2**53)
    quad += np.bincount(nm, sq, nb) - np.bincount(om, sq, nb)
    return new
