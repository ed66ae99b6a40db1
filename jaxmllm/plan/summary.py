"""A fixed-size summary of a lengths index, what start-up reads instead of the whole index.

Sizing the buckets (`capacity`, `sizing`) and setting up a planner (`work.Phases`) need the
data's proportions (units per phase, attention tiles per unit) and its extremes (the longest
document, the largest item, the smallest document), never every sample. At 10^8 samples a
pass of Python-level work per sample, or an array of every sample's work per phase, is minutes
and gigabytes a host; the summary is bounded:

- `body`: a uniform sample of `SAMPLE` samples (the whole index when it holds no more: every
  figure is then exactly the index's, so plans on small indexes are what they were), for the
  proportions;
- `tail`: the `TAIL` samples with the longest LLM sequences and, per encoder phase, those with
  the most units and the largest items, for the extremes a capacity must hold (a sample of the
  body alone would miss them: one document in 10^6 is what sets a tile capacity);
- the exact maxima and minima per phase.

The tail and the extremes come from one vectorised pass over the index in chunks of `CHUNK`
samples (an LLM sequence per sample, a segment maximum per phase), so memory stays bounded and
the pass is numpy's speed over the index's arrays (memory-mapped ones included). The summary is
computed once per (index, units per LLM token) and kept while the index lives.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from jaxmllm.config.phases import LLM, NAMES
from jaxmllm.data.lengths import Items, LengthsIndex

SAMPLE = 1 << 16  # samples of the body (a uniform sample); the whole index below it
TAIL = 256  # samples of the tail per measure (longest LLM sequence, most units, largest item)
CHUNK = 1 << 22  # samples a chunk of the pass over the index
SEED = 20240906  # the body's draw (a summary is a function of the index alone)


@dataclass(frozen=True)
class IndexSummary:
    """A bounded view of a lengths index (module docstring). Per phase (the LLM's tokens, each
    encoder phase's item units): `most` the largest document, `least` the smallest non-zero
    one (0 for a phase without data); `most_units` per encoder phase the most units of one
    sample."""

    samples: int  # samples of the index
    body: LengthsIndex  # a uniform sample (the index itself when small)
    body_ids: np.ndarray  # its samples' ids in the index (ascending)
    tail: LengthsIndex  # the tail samples
    tail_ids: np.ndarray  # their ids in the index (ascending)
    most: Mapping[str, int]
    least: Mapping[str, int]
    most_units: Mapping[str, int]

    @property
    def whole(self) -> bool:
        """Whether the body is the whole index (every figure exact)."""
        return len(self.body) == self.samples

    @property
    def scale(self) -> float:
        """Samples of the index per sample of the body (totals of the body times this)."""
        return self.samples / max(len(self.body), 1)


_CACHE: dict[tuple[int, tuple], IndexSummary] = {}


def summary_of(index: LengthsIndex, per_token: Mapping[str, int]) -> IndexSummary:
    """The summary of `index` with `per_token` encoder units per LLM token, computed once and
    kept while the index lives."""
    key = (id(index), tuple(sorted(per_token.items())))
    got = _CACHE.get(key)
    if got is None:
        got = _CACHE[key] = summarize(index, per_token)
        weakref.finalize(index, _CACHE.pop, key, None)
    return got


def summarize(index: LengthsIndex, per_token: Mapping[str, int]) -> IndexSummary:
    """The summary of `index` (module docstring), computed afresh."""
    n = len(index)
    most = dict.fromkeys([LLM, *NAMES], 0)
    least = dict.fromkeys([LLM, *NAMES], 0)
    most_units = dict.fromkeys(NAMES, 0)
    tails = []  # (score, id) of each chunk's tail candidates per measure
    for start in range(0, n, CHUNK):
        ids = np.arange(start, min(n, start + CHUNK), dtype=np.int64)
        llm, units, largest = chunk_work(index, ids, per_token)
        measures = [llm, *units.values(), *largest.values()]
        tails += [_top(ids, m) for m in measures]
        _extremes(most, least, LLM, llm)
        for p in NAMES:
            sizes = index.items[p].sizes[
                index.items[p].ptr[ids[0]] : index.items[p].ptr[ids[-1] + 1]
            ]
            _extremes(most, least, p, sizes)
            most_units[p] = max(most_units[p], int(units[p].max(initial=0)))
    tail_ids = np.unique(np.concatenate([t for t in tails] or [np.zeros(0, np.int64)]))
    if n <= SAMPLE:
        body, body_ids = index, np.arange(n, dtype=np.int64)
    else:
        body_ids = np.sort(np.random.default_rng(SEED).choice(n, SAMPLE, replace=False))
        body = subset(index, body_ids)
    return IndexSummary(
        n, body, body_ids, subset(index, tail_ids), tail_ids, most, least, most_units
    )


def chunk_work(index: LengthsIndex, ids: np.ndarray, per_token: Mapping[str, int]):
    """For a contiguous run of sample `ids`: (LLM tokens of each, per encoder phase its units
    of each, per encoder phase its largest item of each)."""
    lo, hi = int(ids[0]), int(ids[-1]) + 1
    llm = np.asarray(index.text[lo:hi], np.int64).copy()
    units, largest = {}, {}
    for p in NAMES:
        items = index.items[p]
        ptr = np.asarray(items.ptr[lo : hi + 1], np.int64)
        sizes = np.asarray(items.sizes[ptr[0] : ptr[-1]], np.int64)
        starts = ptr[:-1] - ptr[0]
        units[p] = _segment(np.add, sizes, starts, len(ids))
        largest[p] = _segment(np.maximum, sizes, starts, len(ids))
        llm += _segment(np.add, sizes // per_token[p], starts, len(ids))
    return llm, units, largest


def _segment(ufunc, values: np.ndarray, starts: np.ndarray, n: int) -> np.ndarray:
    """`ufunc`'s reduction of each sample's run of `values` (runs starting at `starts`, in
    order; 0 for an empty run)."""
    out = np.zeros(n, np.int64)
    if not len(values):
        return out
    full = starts < len(values)
    full[:-1] &= starts[1:] > starts[:-1]  # (an empty run: its start is the next one's)
    full[-1] &= starts[-1] < len(values)
    if full.any():
        out[full] = ufunc.reduceat(values, starts[full])
    return out


def _top(ids: np.ndarray, score: np.ndarray) -> np.ndarray:
    """The ids of the TAIL highest scores (any order), none of them 0."""
    k = min(TAIL, len(score))
    top = np.argpartition(score, len(score) - k)[len(score) - k :]
    return ids[top[score[top] > 0]]


def _extremes(most: dict, least: dict, phase: str, values: np.ndarray) -> None:
    """Folds `values` (a chunk's documents of `phase`) into `most` and `least` (non-zero)."""
    pos = values[values > 0]
    if not len(pos):
        return
    most[phase] = max(most[phase], int(pos.max()))
    low = int(pos.min())
    least[phase] = low if not least[phase] else min(least[phase], low)


def subset(index: LengthsIndex, ids: np.ndarray) -> LengthsIndex:
    """The samples `ids` of `index` (ascending) as an index of their own."""
    items = {}
    for p in NAMES:
        ptr = np.asarray(index.items[p].ptr)
        first, count = ptr[ids], ptr[ids + 1] - ptr[ids]
        flat = np.repeat(first - np.concatenate([[0], np.cumsum(count)[:-1]]), count)
        flat += np.arange(int(count.sum()), dtype=np.int64)
        new_ptr = np.concatenate([[0], np.cumsum(count)]).astype(np.int64)
        items[p] = Items(new_ptr, np.asarray(index.items[p].sizes, np.int64)[flat])
    return LengthsIndex(text=np.asarray(index.text, np.int64)[ids], items=items)
