"""Sort and ragged-array primitives of the planners: stable integer sorts, per-run sums,
items of ragged per-sample arrays, offsets of items laid out in bins.

Every sort is stable, so every host computes the same plan from the same inputs.
"""

from __future__ import annotations

import functools
import time

import numpy as np


def gather_items(ptr: np.ndarray, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Items of `samples` in a ragged array: (owner position, item number, flat index)."""
    first = ptr[samples]
    cnt = ptr[1:][samples] - first  # (no samples + 1 to build, ptr[samples] taken once)
    owner = np.repeat(np.arange(len(samples)), cnt)
    start = np.cumsum(cnt)
    start -= cnt
    j = np.arange(len(owner)) - start[owner]
    return owner, j, first[owner] + j


def offsets_in_bins(bins: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """First unit of each item when the items of a bin are laid out in their given order."""
    order = argsort_stable(bins, int(bins.max(initial=0)) + 1)
    s = sizes[order]
    cum = np.cumsum(s)
    cum -= s
    cnt = np.bincount(bins) if len(bins) else np.zeros(0, np.int64)
    first = np.cumsum(cnt)
    first -= cnt  # (each bin's first position in the order; empty bins take none)
    cum -= np.repeat(cum[np.minimum(first, max(len(cum) - 1, 0))], cnt)
    out = np.empty(len(bins), np.int64)
    out[order] = cum
    return out


def argsort_stable(keys: np.ndarray, top: int) -> np.ndarray:
    """Stable argsort of non-negative integer keys below `top` (see stable_sort)."""
    return stable_sort(keys, top, want_keys=False)[0]


def stable_sort(
    keys: np.ndarray, top: int, want_keys: bool = True
) -> tuple[np.ndarray, np.ndarray | None]:
    """(stable argsort, sorted keys) of non-negative integer keys below `top`.

    A stable order is unique, so any way of finding it gives every host the same plan; this
    takes the cheaper of two on the machine it runs on (`radix_sorts_faster`): numpy's radix
    sort of 16-bit keys (one pass per 16 bits of `top`, least significant first), or one
    sort of the unique values key * 2**b + position (2**b >= n), in 32 bits where they fit
    (numpy's SIMD sort, faster than the same sort in 64 bits, whose temporaries cost twice
    the fresh memory), split again by shifts and masks. See plan/README.md."""
    n = len(keys)
    if top <= 1 << 16 and (n < 2048 or radix_sorts_faster()):  # (few keys: radix costs least)
        order = np.argsort(keys.astype(np.uint16), kind="stable")
        return order, keys[order] if want_keys else None
    if top <= 1 << 32 and radix_sorts_faster():
        order = np.argsort((keys & 0xFFFF).astype(np.uint16), kind="stable")
        k = keys[order]
        order = order[np.argsort((k >> 16).astype(np.uint16), kind="stable")]
        return order, keys[order] if want_keys else None
    b = max(n - 1, 1).bit_length()
    if top <= 1 << (32 - b):
        dtype = np.int32 if top <= 1 << (31 - b) else np.uint32
    elif top < 1 << (62 - b):
        dtype = np.int64
    else:
        order = np.argsort(keys, kind="stable")
        return order, keys[order] if want_keys else None
    v = keys.astype(dtype)
    v <<= b
    v |= np.arange(n, dtype=dtype)
    v.sort()
    k = (v >> b).astype(np.int64) if want_keys else None
    v &= (1 << b) - 1
    return v.astype(np.int64), k


@functools.cache
def radix_sorts_faster() -> bool:
    """Whether numpy's radix sort of 16-bit keys beats its sort of packed 32-bit values on
    this machine (timed once, on 32k keys): the SIMD sort is ~3x faster on most x86 CPUs
    with AVX-512, and 2-3x slower than the radix sort on AMD Zen 4, whose AVX-512 compress
    store is microcoded (numpy/x86-simd-sort#6)."""
    keys = np.random.default_rng(0).integers(0, 1 << 9, 1 << 15)

    def best(sort) -> float:
        times = []
        for _ in range(5):
            t = time.process_time()
            sort()
            times.append(time.process_time() - t)
        return min(times)

    packed = (keys << 15 | np.arange(len(keys))).astype(np.int32)
    return best(lambda: np.argsort(keys.astype(np.uint16), kind="stable")) < best(
        lambda: np.sort(packed)
    )


def run_cumsum(
    keys: np.ndarray | None,
    values: np.ndarray,
    runs: tuple[np.ndarray, np.ndarray] | None = None,
    base: np.ndarray | None = None,
) -> np.ndarray:
    """For sorted `keys`, the running sum of integer `values` within each run of equal keys
    (each element's own value included), from `base` (per run; 0 if None). `runs`:
    `run_lengths(keys)`, if at hand (then `keys` is not needed)."""
    starts, lengths = run_lengths(keys) if runs is None else runs
    cum = np.cumsum(values)
    before = np.zeros(len(lengths), cum.dtype)  # (the sum before each run, less its base)
    before[1:] = cum[starts - 1]
    if base is not None:
        before -= base
    cum -= np.repeat(before, lengths)
    return cum


def run_lengths(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For sorted `keys`, (where each run of equal keys but the first starts, each run's
    length)."""
    starts = np.flatnonzero(keys[1:] != keys[:-1])
    starts += 1
    return starts, np.diff(starts, prepend=0, append=len(keys)) if len(keys) else starts


def run_positions(first: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The positions first[r] .. first[r] + lengths[r] - 1 of each run r, concatenated."""
    ends = np.cumsum(lengths)
    return np.repeat(first - ends + lengths, lengths) + np.arange(int(ends[-1]) if len(ends) else 0)


def compact_keys(keys: np.ndarray) -> np.ndarray:
    """The same non-negative keys in a 16-bit type when they fit (numpy radix-sorts those)."""
    if len(keys) and 0 <= keys.min() and keys.max() < 1 << 16:
        return keys.astype(np.uint16)
    return keys


def desc_order(sizes: np.ndarray, first: np.ndarray | None = None) -> np.ndarray:
    """Positions by size, largest first, the `first` ones before all others (stable)."""
    top = int(sizes.max(initial=0))
    key = top - sizes
    if first is not None and first.any():
        key += np.where(first, 0, top + 1)  # (the first ones ahead, as one sort)
        top = 2 * top + 1
    return argsort_stable(key, top + 1)


def smallest(key: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k smallest keys (no NaN) in stable order: the first k of a stable
    argsort, without sorting all of them when k is small (np.partition only finds the k-th
    value, which is the same on every machine). Many keys may tie, as Selector.swap's ratios
    (most samples have none of the short phase: 0): when k of them tie at the smallest value,
    the first k of those (in index order); else the ones below the k-th value sorted, then
    the first of the ones tied at it, instead of sorting all the tied ones."""
    if not len(key) or 2 * k >= len(key):
        return np.argsort(key, kind="stable")[:k]
    low = np.flatnonzero(key == key.min())
    if len(low) >= k:
        return low[:k]
    kth = np.partition(key, k - 1)[k - 1]
    below = np.flatnonzero(key < kth)
    below = below[np.argsort(key[below], kind="stable")]
    return np.concatenate([below, np.flatnonzero(key == kth)[: k - len(below)]])


def match_sub_first(a_keys: np.ndarray, b_keys: np.ndarray) -> np.ndarray:
    """Matches two lists of (group, sub) keys (key = group * subs + sub, each list sorted by
    key, as many of each group in both): per element of `a`, its partner's index in `b`.
    Within each (group, sub) the first elements of both lists pair in order, as many as both
    have; the rest pair in order within their group."""
    top = int(max(a_keys.max(initial=0), b_keys.max(initial=0))) + 1
    a_cnt, b_cnt = np.bincount(a_keys, minlength=top), np.bincount(b_keys, minlength=top)
    both = np.minimum(a_cnt, b_cnt)
    a_in = _rank_in_runs(a_keys, a_cnt) < both[a_keys]
    b_in = _rank_in_runs(b_keys, b_cnt) < both[b_keys]
    out = np.empty(len(a_keys), np.int64)
    out[a_in] = np.flatnonzero(b_in)  # (the runs of a (group, sub): in order, equally long)
    out[~a_in] = np.flatnonzero(~b_in)  # (the rest: as many per group, in group order)
    return out


def _rank_in_runs(keys: np.ndarray, cnt: np.ndarray) -> np.ndarray:
    """Each element's position within its run of equal keys (`keys` sorted, `cnt` per key)."""
    first = np.cumsum(cnt)
    first -= cnt
    return np.arange(len(keys)) - first[keys]
