"""Packing one phase: items to bins of one capacity, equalising each bin's fill and its
attention (quadratic) cost.

`pack_phase` emulates the sequential greedy "each item, largest first, to the bin whose
remaining attention budget per free unit (the item size it wants) is largest": the big items in
rounds (`jaxmllm.plan.rounds`), the bins that want the biggest items taking the next ones; once
the items are small, the rest are laid out in a few passes as contiguous runs (largest first)
over the bins in order of the size they want, each bin's run proportional to its room. Small
encoder items (video frames, small images, short clips) first go to their home bin, each bin
taking up to its share of them (`_home_small`). The attention balance is about the sequential
greedy's, in about n/bins rounds (plan/README.md). In the LLM's rows, what still fits nowhere
gets room made for it by trades between bins (`_make_room`), and trades then even out the
attention cost they moved (`_even`).
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
ROOM_BINS = 2  # bins (most room first) tried for an item that fits none
ROOM_SWAPS = 3  # most swaps that make room in one of them
PARTNER_BINS = 32  # other bins a trade search looks at (the roomiest, or the cheapest)
ROOM_MINE = 64  # most items of the bin itself a trade search looks at (its largest)
EVEN_SWAPS = 2  # per item placed or moved by making room, most trades that lower the costliest bin
EVEN_TOL = 1.01  # ... until it costs at most this times the mean


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
        if home is None:  # (the LLM's rows; see _make_room)
            _make_room(pk, late[out[late] < 0], first)
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


def _make_room(pk: Packing, idx: np.ndarray, first: np.ndarray | None) -> None:
    """Places what still fits nowhere (`idx`; urgent first, then largest first) by making room
    for it: in the first of the ROOM_BINS bins with the most room where up to ROOM_SWAPS
    trades (one of its items for a smaller one of another bin with room for the difference;
    each the smallest that makes enough room, else the largest there is) free enough. Then
    trades lower the costliest bins' attention cost again (`_even`).

    Rows of coarse documents (a few to a row: videos of 4k-7k tokens in 36,864) leave every
    bin a little room and none enough for the last ones: on video seed 101 the rounds left
    2.4% of what a step offered, the trades 0.06% (plan/README.md). The LLM's rows only: an
    encoder item traded away from its text's device needs an exchange, and the route capacity
    sized from the plans grew to a device's whole output on omni-like tiny buckets."""
    if not len(idx):
        return
    sizes, out, units, quad = pk.sizes, pk.out, pk.loads.units, pk.loads.quad
    idx = idx[desc_order(sizes[idx], None if first is None else first[idx])]
    top = int(sizes[out >= 0].max(initial=0))
    moved = 0
    for f in idx:
        s = int(sizes[f])
        room = pk.cap - units
        # (each trade frees at most its partner bin's room in the bin, and at most the size of
        # the item it moves out)
        most = np.sort(room)[-(ROOM_SWAPS + 1) :]
        if s > int(most.sum()) or s > int(most[-1]) + ROOM_SWAPS * top:
            continue
        for a in np.argsort(-room, kind="stable")[:ROOM_BINS]:
            swaps = _swaps(pk, int(a), s - int(room[a]))
            if swaps is not None:
                break
        else:
            continue
        for x, y in swaps:
            bx, by = out[x], out[y]
            out[x], out[y] = by, bx
            units[bx] += sizes[y] - sizes[x]
            units[by] += sizes[x] - sizes[y]
            quad[bx] += pk.sq[y] - pk.sq[x]
            quad[by] += pk.sq[x] - pk.sq[y]
        out[f] = a
        units[a] += s
        quad[a] += pk.sq[f]
        moved += 1 + len(swaps)
    if moved:
        _even(pk, EVEN_SWAPS * moved)


def _even(pk: Packing, rounds: int) -> None:
    """Lowers the costliest bin's attention cost, up to `rounds` times, by trading one of its
    items for one of another bin (both within their rooms) that leaves the costlier of the two
    bins the least cost; stops when no trade lowers it."""
    sizes, out, units, quad, sq = pk.sizes, pk.out, pk.loads.units, pk.loads.quad, pk.sq
    placed = np.flatnonzero(out >= 0)
    goal = EVEN_TOL * float(quad.mean())  # (trades keep the sum)
    for _ in range(rounds):
        m = int(np.argmax(quad))
        if quad[m] <= goal:
            return
        mine = _largest(placed[out[placed] == m], sq)
        other = _items_in(out, _first(quad, m), len(quad))
        if not len(mine) or not len(other):
            return  # (its cost is items placed before this packing, which stay)
        b = out[other]
        ds = sizes[mine][:, None] - sizes[other][None, :]  # units m gives b
        dq = sq[mine][:, None] - sq[other][None, :]  # cost m gives b
        ok = (dq > 0) & (ds <= (pk.cap - units[b])[None, :]) & (-ds <= pk.cap - units[m])
        worse = np.maximum(quad[m] - dq, quad[b][None, :] + dq)
        worse = np.where(ok, worse, np.inf)
        i, j = np.unravel_index(np.argmin(worse), worse.shape)
        if not worse[i, j] < quad[m]:
            return
        x, y, bb = mine[i], other[j], int(b[j])
        out[x], out[y] = bb, m
        units[m] -= ds[i, j]
        units[bb] += ds[i, j]
        quad[m] -= dq[i, j]
        quad[bb] += dq[i, j]


def _swaps(pk: Packing, a: int, need: int) -> list[tuple[int, int]] | None:
    """Up to ROOM_SWAPS trades (an item of bin `a`, a smaller one of another bin with room for
    the difference) that free `need` units in `a`, or None if they cannot."""
    if need <= 0:
        return []
    sizes, out = pk.sizes, pk.out
    room = pk.cap - pk.loads.units
    # the partners: the placed items of the bins with the most room (a swap moves at most a
    # bin's room into it)
    placed = _items_in(out, _first(-room, a), len(room))
    sp, rp, qp = sizes[placed], room[out[placed]], pk.loads.quad[out[placed]]
    mine = _largest(np.flatnonzero(out == a), sizes)
    free = np.ones(len(placed), bool)
    swaps = []
    for _ in range(ROOM_SWAPS):
        d = sizes[mine][:, None] - sp[None, :]  # what each trade frees in a
        ok = (d > 0) & (d <= rp[None, :]) & free[None, :]
        if not ok.any():
            return None
        enough = ok & (d >= need)
        if enough.any():
            # (of those that make enough room, the one that leaves its partner's bin the least
            # attention cost)
            after = qp[None, :] + pk.sq[mine][:, None] - pk.sq[placed][None, :]
            i, j = np.unravel_index(np.argmin(np.where(enough, after, np.inf)), d.shape)
        else:
            i, j = np.unravel_index(np.argmax(np.where(ok, d, -1)), d.shape)
        gain = int(d[i, j])
        swaps.append((int(mine[i]), int(placed[j])))
        need -= gain
        rp[out[placed] == out[placed[j]]] -= gain  # (that bin's room for later trades)
        free[j] = False
        mine = np.delete(mine, i)
        if need <= 0:
            return swaps
    return None


def _first(key: np.ndarray, but: int) -> np.ndarray:
    """The PARTNER_BINS bins of the lowest `key` (stable), bin `but` left out."""
    bins = np.argsort(key, kind="stable")[: PARTNER_BINS + 1]
    return bins[bins != but][:PARTNER_BINS]


def _items_in(out: np.ndarray, bins: np.ndarray, nb: int) -> np.ndarray:
    """The items placed (`out`: bin or -1) in `bins` of `nb` (ascending)."""
    mask = np.zeros(nb + 1, bool)  # (the last: not placed)
    mask[bins] = True
    return np.flatnonzero(mask[out])


def _largest(idx: np.ndarray, by: np.ndarray) -> np.ndarray:
    """Of items `idx`, at most ROOM_MINE: those of the largest `by`."""
    if len(idx) <= ROOM_MINE:
        return idx
    return np.sort(idx[np.argsort(-by[idx], kind="stable")[:ROOM_MINE]])


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
