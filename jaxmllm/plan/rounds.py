"""Packing rounds: the sequential greedy "each item, largest first, to the bin that wants the
biggest item", many items at a time.

A bin wants items of size (attention budget left) / (room left). A round gives the next items
to the bins that want the biggest ones, as many as bring their wants down to a common level
chosen so that a round places about one item per open bin (`_deal`); with `home`, an item takes
its home bin's slot in the round when that slot was to get an item of about its size
(`_prefer_home`).
"""

from __future__ import annotations

import numpy as np

from jaxmllm.plan.bins import Packing
from jaxmllm.plan.ragged import argsort_stable, compact_keys, match_sub_first, smallest

# Tuned constants of the rounds (what each was measured to do: plan/README.md).
HOME_TOL = 0.1  # an item takes its home bin's slot in a round if that slot's item is this close
FEW_OPEN = 16  # rounds end when under 1/FEW_OPEN of the bins have room for the next item
ROUND_FILL = 1  # items per open bin an LLM round aims at
ENC_ROUND_FILL = 2  # items per open bin an encoder round (items with a home) aims at
FAST_BINS = 64  # under this many open bins, a round is the sequential greedy's next step


def pack_round(pk: Packing, order: np.ndarray, pos: int, end: int, urgent: bool) -> int:
    """One round of `pk` over its items order[pos:end] (largest first; `urgent`: urgent items,
    each to its own bin), placed in `pk`. Returns the new position: pos
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
    that take two, ...). So a round places about as many items as there are open bins.
    Under FAST_BINS open bins, a round gives one item each to the bins above what the top bin
    wants after its item (the sequential greedy's next step). Urgent items go one per open
    bin, to the bins that want the biggest."""
    sizes, quad, home = pk.sizes, pk.loads.quad, pk.home
    nxt = int(sizes[order[pos]])
    free = pk.cap - pk.loads.units
    closed = free < nxt  # every item left is <= nxt, so the others take any one of them
    n_closed = int(np.count_nonzero(closed))
    n_open = len(free) - n_closed
    if not n_open:
        return pos
    if not urgent and n_open * FEW_OPEN < len(free) and n_open < end - pos:
        return -1
    key = quad - pk.qstar
    key /= np.maximum(free, 1)  # minus the item size the bin wants
    if n_closed:
        key[closed] = np.inf
    ranked = smallest(key, n_open)  # open bins, wanting the biggest first
    if urgent:
        bins = ranked[: end - pos]
        first_layer = len(bins)
    else:
        fill = ROUND_FILL if home is None else ENC_ROUND_FILL
        cost = float(pk.sq[order[pos]])
        count = _deal(key[ranked], free[ranked], nxt, cost, pk.qstar - quad[ranked[0]], fill)
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
    s_take = sizes[take]
    if home is not None and len(bins) > 1:
        bins = _prefer_home(bins, s_take, home[take], len(free), pk.per_host)
    pk.place(take, bins, first_layer == len(bins), s_take)
    return pos + len(take)


def _deal(neg_want, free, s, c, budget_top, fill):
    """Per bin above the round's level (a prefix of the open bins by want), the number of
    items of size `s` it takes (see pack_round). `neg_want`, `free`: the open bins' minus wants
    (ascending) and rooms; `s`, `c`: the next item's size and attention cost (the largest
    left: counted with it, a bin never gets more than its room); `budget_top`: the attention
    budget left in the top bin; `fill`: items per open bin the round aims at."""
    n = len(neg_want)
    # Wants are attention cost per unit of room; the item's own is r = c / s (= s when the
    # cost is size**2, dense attention; tiles per unit with block-sparse). A bin of want w
    # and room f above the level L takes (w - L) f / (s (r - L)) items to come down to L.
    # Over all open bins, fill * n items need L = (sum(w f) - T c) / (sum(f) - T s) (bins
    # below it would count negative: the bins above it take more, and the round stops at T
    # items); at most what the top bin wants after one item.
    t = fill * n
    f = free.astype(np.float64)
    sum_f = float(f.sum())
    r = c / max(float(s), 1.0)
    after = min((budget_top - c) / max(float(f[0]) - s, 1.0), -float(neg_want[0]))
    if n < FAST_BINS:  # (few bins: rounds are cheap, take the sequential greedy's own step)
        level = after
    elif sum_f > t * s:
        level = min((-float(neg_want @ f) - t * c) / (sum_f - t * s), after)
    else:  # (they cannot take so many: every bin takes all it has room for)
        level = -np.inf
    k = max(int(np.searchsorted(neg_want, -level, "left")), 1)
    if level == -np.inf:
        return free[:k] // s
    if k == n and fill == 1:  # (every open bin is above the level and the round takes one each)
        return np.ones(n, np.int64)
    lv = min(level, r - 1e-6)  # (bins that want r or more take all they have room for)
    x = (neg_want[:k] + lv) * f[:k]
    x *= -1.0 / (s * (r - lv))
    x += 1 - 1e-9  # (ceil, and at least one: x > 0 above the level)
    c = x.astype(np.int64)
    np.minimum(c, free[:k] // s, out=c)
    return np.maximum(c, 1, out=c)  # (open bins have room for one; float edge cases)


def _prefer_home(
    bins: np.ndarray, s: np.ndarray, home: np.ndarray, nb: int, per_host: int = 0
) -> np.ndarray:
    """Rematches one round (item i -> bins[i], both largest first) so that an item whose home
    bin takes an item of about its size in this round (within HOME_TOL) goes home instead; the
    others keep the order of the rest, or with `per_host` bins a host, take the round's bins
    on their home's host first (`_prefer_host`)."""
    k = len(bins)
    rank_of = np.full(nb, -1, np.int64)
    rank_of[bins] = np.arange(k)
    r = rank_of[home]
    cand = np.flatnonzero(r >= 0)
    sc = s[cand]
    rc = r[cand]
    keep = np.abs(sc - s[rc]) <= HOME_TOL * sc
    cand, rc = cand[keep], rc[keep]
    if not len(cand) and not 0 < per_host < nb:
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
    if 0 < per_host < nb:
        _prefer_host(out, home, ~claimed, ~mine, per_host)
    return out


def _prefer_host(
    out: np.ndarray, home: np.ndarray, slot: np.ndarray, item: np.ndarray, per_host: int
) -> None:
    """Rematches the items of a round not sent home (mask `item`, in order) with their bins
    (those of the round's positions `slot`, in the same order) so that as many as the round
    has bins on their home's host take one there (`ragged.match_sub_first`); in place. The
    round's items differ in size by less than the bins' loads do (about one item per open
    bin, largest first), and the next rounds even out what a trade moves: on omni the same
    attention balance, a third of the rows across hosts (trades only within 10% in size:
    half as many less)."""
    idx = np.flatnonzero(item)
    if len(idx) < 2:
        return
    bins = out[idx]
    a, b = home[idx] // per_host, bins // per_host
    hosts = int(max(a.max(), b.max())) + 1
    oa, ob = argsort_stable(a, hosts), argsort_stable(b, hosts)
    out[idx[oa]] = bins[ob[match_sub_first(a[oa], b[ob])]]
