"""Packing one phase: items to bins of one capacity, equalising each bin's fill and its
attention (quadratic) cost.

`pack_phase` emulates the sequential greedy "each item, largest first, to the bin whose
remaining attention budget per free unit (the item size it wants) is largest": the big items in
rounds (`jaxmllm.plan.rounds`), the bins that want the biggest items taking the next ones; once
the items are small, the rest are laid out in a few passes as contiguous runs (largest first)
over the bins in order of the size they want, each bin's run proportional to its room. Small
encoder items (video frames, small images, short clips) first go to their home bin, each bin
taking up to its share of them (`_home_small`). The attention balance is about the sequential
greedy's, in about n/bins rounds (plan/README.md).
"""

from __future__ import annotations

import numpy as np

from jaxmllm.plan.bins import Loads, Packing
from jaxmllm.plan.ragged import argsort_stable, desc_order, run_cumsum
from jaxmllm.plan.rounds import pack_round

# Tuned constants of the packer (what each was measured to do: plan/README.md).
BIG = 0.003  # items whose size**2 is over this share of a bin's attention budget go in rounds
PASSES = 8  # most passes that lay out the small items
SIZE_TOL = 0.01  # items this close in size share an exchange group (may trade bins)
LATE_ROUNDS = 16  # fewest rounds that place what the rounds and passes missed, by room


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
    loads: Loads,
    cap: int,
    first: np.ndarray | None = None,
    home: np.ndarray | None = None,
    per_host: int = 0,
    costs: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Assigns items to bins of capacity `cap`, equalising fill and attention cost.

    Args:
      sizes: item sizes.
      loads: per bin, units and quadratic cost already there (updated in place).
      cap: bin capacity.
      first: items to place before all others (urgent ones), wherever they fit.
      home: per item, the bin it would rather sit in (its text's device), or None: within a
        round, an item goes there if that bin was to take an item within HOME_TOL of its size.
      per_host: bins a host (0: one host): within a round, the items that do not go home
        take the round's bins on their home's host first.
      costs: the items' quadratic costs (`loads.cost(sizes)`), if at hand.

    Returns:
      (bin per item, -1 where it did not fit; exchange group per item: items of one group
      are within about SIZE_TOL in size, so they may trade bins at almost no cost; -1 for the
      few placed one by one at the end, and for those that did not fit).
    """
    n, nb = len(sizes), len(loads.units)
    out = np.full(n, -1, np.int64)
    if n == 0:
        return out, out.copy()
    sq = loads.cost(sizes) if costs is None else costs
    placeable = min(1.0, float((cap - loads.units).sum()) / max(float(sizes.sum()), 1.0))
    qstar = (float(loads.quad.sum()) + placeable * float(sq.sum())) / nb  # each bin's share
    pk = Packing(sizes, sq, home, loads, cap, qstar, out, per_host)
    order = desc_order(sizes, first)
    n_first = int(first.sum()) if first is not None else 0
    # Rounds for the urgent and the big items, largest first.
    rest_sq = sq[order[n_first:]]
    # (items within SIZE_TOL of the smallest one need no rounds: any even layout suits them)
    small = max(BIG * qstar, float(loads.cost(np.array([float(sizes.min()) * (1 + SIZE_TOL)]))[0]))
    big_end = n_first + int(np.searchsorted(-rest_sq, -small, "right"))
    pos, failed = 0, []
    neg_sorted = -sizes[order[:big_end]]  # (ascending within each of the two segments)
    while pos < big_end:
        urgent = pos < n_first
        end = n_first if urgent else big_end
        start = pos
        pos = pack_round(pk, order, pos, end, urgent)
        if pos == start:  # none fits the next item: all bigger than the most room fail at once
            room = int((cap - loads.units).max())
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
        free = cap - loads.units
        share = free * min(1.0, float(sizes[rest].sum()) / max(float(free.sum()), 1.0))
        target = np.minimum(cap, np.ceil(loads.units + share).astype(np.int64))
        at_home = _home_small(pk, rest, share)
        rest = rest[~at_home]
        room = target  # (the passes fill each bin up to the same share of its room: the bins
        # whose own items took less of it get more of the others)
    s_rest = sizes[rest]
    vol = np.cumsum(s_rest)
    start = 0
    # (about a bin's share of items a pass at least: a few items need no 8 passes)
    for p in range(min(PASSES, -(-len(rest) // nb)), 0, -1):
        # each pass takes 1/p of the volume left (an integer bound: the same first vol >= it)
        done = int(vol[start - 1]) if start else 0
        bound = done - (done - int(vol[-1])) // p
        k = len(rest) if p == 1 else start + int(np.searchsorted(vol[start:], bound)) + 1
        chunk = rest[start:k]
        ok = _cut(pk, chunk, s_rest[start:k], room)
        failed.append(chunk[~ok])
        start = k
    group = np.where(out >= 0, size_class(sizes), -1)
    if at_home is not None:
        group[order[big_end:][at_home]] = -1  # (at home: nothing to gain from a trade)
    if failed:
        late = np.concatenate(failed)
        _fit_rest(pk, late, max(LATE_ROUNDS, -(-len(late) // nb) + 4))
        group[late] = -1
    return out, group


def _home_small(pk: Packing, rest: np.ndarray, share: np.ndarray) -> np.ndarray:
    """Places small items (`rest`, largest first) in their home bin, each bin taking at most
    `share` of them (per bin: the same share of its room as the passes would give it);
    returns the mask (over `rest`) of those placed.

    For items this small the passes' order by want hardly moves the attention balance, and
    most of them (video frames, small images, short clips) can sit at home: their encoder
    rows then need no exchange, and localize need not trade them (a sort of every item)."""
    h = pk.home[rest]
    s = pk.sizes[rest]
    o = argsort_stable(h, len(share))  # by home, largest first within it
    hs, ss = h[o], s[o]
    fits = run_cumsum(hs, ss) <= share[hs]
    at = np.empty(len(rest), bool)
    at[o] = fits
    pk.place(rest[at], h[at], distinct=False)
    return at


def _cut(pk: Packing, chunk: np.ndarray, s: np.ndarray, room: int | np.ndarray) -> np.ndarray:
    """Lays out `chunk` (largest first; sizes `s`) as contiguous runs over the bins in order of
    the item size they want, each run proportional to the bin's room (up to `room` units, per
    bin or for all); returns the mask of items placed (an item past its bin's room is not)."""
    nb = len(pk.loads.units)
    if not len(s):
        return np.zeros(0, bool)
    free = room - pk.loads.units
    want = (pk.qstar - pk.loads.quad) / np.maximum(free, 1)
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
        pk.place(chunk, b, distinct=False, sizes=s)
    else:
        pk.place(chunk[ok], b[ok], distinct=False, sizes=s[ok])
    return ok


def _fit_rest(pk: Packing, idx: np.ndarray, rounds: int) -> None:
    """What missed, largest first, a round at a time to the bins with the most room."""
    sizes, load = pk.sizes, pk.loads.units
    idx = idx[desc_order(sizes[idx])]
    nb = len(load)
    for _ in range(rounds):
        idx = idx[sizes[idx] <= pk.cap - load.min()]
        if not len(idx):
            return
        take = idx[:nb]
        bins = np.argsort(load, kind="stable")[: len(take)]
        ok = load[bins] + sizes[take] <= pk.cap
        pk.place(take[ok], bins[ok], distinct=True)
        idx = np.concatenate([take[~ok], idx[nb:]])
