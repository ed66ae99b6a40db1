"""Routing: encoder items away from their text's device, within the route capacity.

After a phase is packed, items of nearly the same size (one exchange group) trade devices so
that as many as possible sit at home (`localize`: each device keeps its count of items per
group); the small shifts in load are undone where they would overfill a bucket
(`keep_capacity`: no room is kept back for them); then each (src, dst) device pair may carry at
most `batch.route_pair_capacity` encoder rows per microbatch (`Routes`: a sample whose items
would exceed it waits).
"""

from __future__ import annotations

import numpy as np

from jaxmllm.plan.bins import Loads
from jaxmllm.plan.ragged import match_sub_first, run_cumsum, stable_sort

UNDO_ROUNDS = 3  # rounds undoing the groups of overfilled bins before all exchanges are undone
DENSE_PAIRS = 1 << 24  # up to this many (src, dst) pairs (4096 devices) Routes keeps a table


class Routes:
    """Encoder rows one microbatch sends between devices in one phase, per (src, dst) pair.

    With context groups (`context` > 1) an item encoded in its text's group needs no exchange
    (the group gathers its devices' rows), and one encoded elsewhere goes to the device of its
    text's group at the position of its own in its group (`src % context`): the pair is
    (src, the text's group, `home // context`), as the batch's send tables and the exchange
    count them (`*_send[src, group]`, `models.mllm.exchange_rows`).

    The rows per pair sit in a table indexed by pair (up to DENSE_PAIRS pairs: a scatter-add
    instead of a sort of every routed item), or beyond it as the sorted keys of the pairs that
    carry rows and their totals."""

    def __init__(self, devices: int, per_row: int, capacity: int, bucket: int, context: int = 1):
        self.devices, self.per_row, self.capacity = devices, per_row, capacity
        self.context = context
        # A route capacity of a device's whole encoder output (`bucket` units) never overflows.
        self.free = capacity >= bucket // per_row
        self.top = devices * devices  # (src, dst) keys below this
        self.dense = self.top <= DENSE_PAIRS
        # (a pair's rows never pass a microbatch's: int32 where those fit)
        self.dtype = np.int32 if devices * (bucket // per_row) < 1 << 31 else np.int64
        self.table = None  # rows per pair key (dense; allocated at first use)
        self.pairs = np.zeros(0, np.int64)  # the keys of the pairs that carry rows, ascending
        self.rows = np.zeros(0, np.int64)  # the rows each carries

    def _routed(self, dev: np.ndarray, home: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mask of the items that count, their (src, dst) keys)."""
        if self.context == 1:
            remote = dev != home
            return remote, dev[remote] * self.devices + home[remote]
        group = home // self.context
        remote = dev // self.context != group
        return remote, dev[remote] * (self.devices // self.context) + group[remote]

    def _table(self) -> np.ndarray:
        if self.table is None:
            self.table = np.zeros(self.top, self.dtype)
        return self.table

    def _find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions of `keys` in `pairs`: where each would go if not there, found mask)."""
        at = np.searchsorted(self.pairs, keys)
        found = at < len(self.pairs)
        found[found] = self.pairs[at[found]] == keys[found]
        return at, found

    def _carried(self, keys: np.ndarray) -> np.ndarray:
        """Rows already on the pairs `keys`."""
        if self.dense:
            return self._table()[keys]
        at, found = self._find(keys)
        rows = np.zeros(len(keys), np.int64)
        rows[found] = self.rows[at[found]]
        return rows

    def overflow(self, size: np.ndarray, dev: np.ndarray, home: np.ndarray) -> np.ndarray:
        """Mask of the items (encoded on `dev`, text on `home`) whose (src, dst) pair would
        exceed the route capacity, counting the rows already routed first."""
        out = np.zeros(len(size), bool)
        if self.free:
            return out
        remote, keys = self._routed(dev, home)
        idx, rows = np.flatnonzero(remote), size[remote] // self.per_row
        if self.dense:  # (only the pairs the new items take past the capacity need their sums)
            table, add = self._table(), rows.astype(self.dtype)  # (ufunc.at: same dtypes, fast)
            np.add.at(table, keys, add)
            hot = table[keys] > self.capacity
            np.subtract.at(table, keys, add)
            idx, keys, rows = idx[hot], keys[hot], rows[hot]
        order, k = stable_sort(keys, self.top)  # (each pair's new items in order)
        total = run_cumsum(k, rows[order])
        total += self._carried(k)
        out[idx[order[total > self.capacity]]] = True
        return out

    def add(self, size: np.ndarray, dev: np.ndarray, home: np.ndarray) -> None:
        """Counts the rows of the items kept (encoded on `dev`, text on `home`)."""
        if self.free:
            return
        remote, keys = self._routed(dev, home)
        rows = size[remote] // self.per_row
        if self.dense:
            np.add.at(self._table(), keys, rows.astype(self.dtype))
            return
        new, inv = np.unique(keys, return_inverse=True)
        rows = np.bincount(inv, rows, len(new)).astype(np.int64)
        at, found = self._find(new)
        self.rows[at[found]] += rows[found]  # (exact: integer sums far below 2**53)
        self.pairs = np.insert(self.pairs, at[~found], new[~found])
        self.rows = np.insert(self.rows, at[~found], rows[~found])


def localize(
    group: np.ndarray, dev: np.ndarray, home: np.ndarray, devices: int, per_host: int = 0
) -> np.ndarray:
    """Reassigns devices among the items of each exchange group so that most sit at `home`.

    Every device keeps as many items of each group as before (so about the same load and
    attention cost); within a group, as many items as the device has slots stay home. With
    `per_host` devices a host (devices h * per_host ... on host h; 0 = one host), the items that
    cannot stay home take the group's free slots on their own host first, and only then the
    slots left on other hosts (OrchMLLM's node-aware dispatch: intra-host links are ~10x
    faster). Items of group -1 keep their device. O(items + groups * devices), one sort.
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
    slot_keys = np.repeat(keys, free[keys])  # (group, device) of each free slot, in order
    if 0 < per_host < devices:
        to = _match_hosts(ik[~local], slot_keys, devices, per_host)
    else:
        to = slot_keys % devices
    if idx is None:
        out[stay] = h[stay]
        out[move] = to
    else:
        out[idx[stay]] = h[stay]
        out[idx[move]] = to
    return out


def _match_hosts(
    mover_keys: np.ndarray, slot_keys: np.ndarray, devices: int, per_host: int
) -> np.ndarray:
    """The device each mover (its (group, home) key, in key order) takes among the free slots
    (their (group, device) keys, in key order; as many per group as movers): the slots of its
    home's host first (`match_sub_first`), then those left in its group."""
    hosts = -(-devices // per_host)
    # (group, host) keys: devices of a host are contiguous, so both lists stay sorted by them
    mh = mover_keys // devices * hosts + mover_keys % devices // per_host
    sh = slot_keys // devices * hosts + slot_keys % devices // per_host
    return slot_keys[match_sub_first(mh, sh)] % devices


def keep_capacity(
    group: np.ndarray,
    new: np.ndarray,
    old: np.ndarray,
    size: np.ndarray,
    loads: Loads,
    cap: int,
    costs: np.ndarray | None = None,
) -> np.ndarray:
    """Applies the exchanges `old` -> `new` to the bins' `loads`, undoing those of every group
    that touches a bin they would overfill (sizes differ within a group by up to SIZE_TOL);
    returns each item's device. `costs`: the items' quadratic costs, if at hand."""
    load = loads.units
    nb = len(load)
    new = new.copy()
    m = np.flatnonzero(new != old)
    nm, om, sm = new[m], old[m], size[m]  # (the moves, gathered once per attempt)
    for attempt in range(UNDO_ROUNDS + 1):
        delta = np.bincount(nm, sm, nb) - np.bincount(om, sm, nb)
        over = load + delta > cap
        if not over.any():
            break
        if attempt < UNDO_ROUNDS:
            gm = group[m]
            undo = np.isin(gm, gm[over[nm] | over[om]])
        else:
            undo = np.ones(len(m), bool)
        new[m[undo]] = om[undo]
        m = m[~undo]  # (the moves left: still in order)
        nm, om, sm = new[m], old[m], size[m]
    else:
        delta = np.bincount(nm, sm, nb) - np.bincount(om, sm, nb)
    sq = loads.cost(sm) if costs is None else costs[m]
    load += delta.astype(load.dtype)  # (exact: integer sums far below 2**53)
    loads.quad += np.bincount(nm, sq, nb) - np.bincount(om, sq, nb)
    return new
