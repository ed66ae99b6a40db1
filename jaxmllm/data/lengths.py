"""The lengths index: per-sample counts in model units (text tokens, and per encoder phase the
units of each item: patches per image, frames per clip), what the planner plans from without
touching the media."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxmllm.config.phases import ENCODERS, LLM


@dataclass(frozen=True)
class Items:
    """One encoder phase's items of every sample, as a ragged array: sample i's items are
    `sizes[ptr[i]:ptr[i + 1]]`, each in the phase's units."""

    ptr: np.ndarray  # int64 [samples + 1]
    sizes: np.ndarray  # int64 [items]

    @classmethod
    def from_lists(cls, lists: list[list[int]]) -> Items:
        """Items from one list of sizes per sample (pointers and the sizes flattened)."""
        return cls(
            ptr=np.cumsum([0] + [len(x) for x in lists]).astype(np.int64),
            sizes=np.array([v for x in lists for v in x], np.int64),
        )

    @classmethod
    def none(cls, samples: int) -> Items:
        """No items for any of `samples` samples (a read-only view of one zero: no memory)."""
        return cls(ptr=np.broadcast_to(np.int64(0), (samples + 1,)), sizes=np.zeros(0, np.int64))

    def __len__(self) -> int:
        """Items of every sample together."""
        return len(self.sizes)

    def of(self, i: int) -> np.ndarray:
        """Sample i's item sizes."""
        return self.sizes[self.ptr[i] : self.ptr[i + 1]]

    def count(self) -> np.ndarray:
        """Items per sample."""
        return np.diff(self.ptr)

    def take(self, order: np.ndarray) -> Items:
        """The items of the samples `order` (repeats allowed), in that order."""
        counts = self.count()[order]
        ptr = np.zeros(len(order) + 1, np.int64)
        np.cumsum(counts, out=ptr[1:])
        starts = np.asarray(self.ptr[:-1])[order]
        at = np.repeat(starts - ptr[:-1], counts) + np.arange(ptr[-1])
        return Items(ptr, self.sizes[at] if len(at) else np.zeros(0, np.int64))

    def size(self, samples: np.ndarray, item: np.ndarray) -> np.ndarray:
        """The size of item `item` of each sample in `samples`."""
        return self.sizes[self.ptr[samples] + item]

    def per_sample(self, values: np.ndarray | None = None) -> np.ndarray:
        """Sum within each sample of `values` (one per item; default: the sizes)."""
        values = self.sizes if values is None else values
        if not len(values):
            return np.zeros(len(self.ptr) - 1, np.int64)
        # (the differences of the cumulative sum at each sample's first item: one pass and one
        # gather, exact in integers)
        total = np.empty(len(values) + 1, np.int64)
        total[0] = 0
        np.cumsum(values, out=total[1:])
        return np.diff(total[self.ptr])


@dataclass(frozen=True)
class Mixture:
    """Several data sets in one index, one after another (source s holds samples `starts[s]`
    .. `starts[s + 1] - 1`), each drawn `draws[s]` times in every round of `len(index)` samples
    (`jaxmllm.plan.stream.MixtureStream`): its weight's share, to the nearest sample."""

    names: tuple[str, ...]
    starts: tuple[int, ...]  # [sources + 1]
    draws: tuple[int, ...]  # [sources], summing to the index's length

    @classmethod
    def of(cls, names: list[str], sizes: list[int], weights: list[float]) -> Mixture:
        """Sources of `sizes` samples drawn by `weights` (all 0: in proportion to their sizes),
        apportioned to whole samples a round by largest remainder.

        Raises:
          ValueError: a source with no samples, or one whose weight draws none in a round.
        """
        total = sum(sizes)
        w = np.asarray(sizes if not any(weights) else weights, np.float64)
        quota = w / w.sum() * total
        draws = np.floor(quota).astype(np.int64)
        order = np.argsort(-(quota - draws), kind="stable")
        draws[order[: total - int(draws.sum())]] += 1
        for name, size, n in zip(names, sizes, draws.tolist(), strict=True):
            if not size or not n:
                why = "has no usable samples" if not size else "is drawn 0 times a round"
                raise ValueError(f"source {name!r} {why} (of {total} samples a round)")
        starts = np.cumsum([0, *sizes]).tolist()
        return cls(tuple(names), tuple(int(x) for x in starts), tuple(draws.tolist()))

    def source_of(self, samples: np.ndarray) -> np.ndarray:
        """Which source each sample is from."""
        return np.searchsorted(np.asarray(self.starts), samples, "right") - 1

    def counts(self, samples: np.ndarray) -> dict[str, int]:
        """Samples per source."""
        n = np.bincount(self.source_of(np.asarray(samples, np.int64)), minlength=len(self.names))
        return dict(zip(self.names, n.tolist(), strict=True))

    def to_json(self) -> dict:
        """The mixture as summaries and checkpoints record it: names, first rows and draws."""
        return {"names": list(self.names), "starts": list(self.starts), "draws": list(self.draws)}


@dataclass
class LengthsIndex:
    """Per-sample counts in model units, as ragged numpy arrays (vectorised planning needs them).

    text[i] = text tokens of sample i (placeholders excluded); items[phase] = the units of each
    item of every sample in that encoder phase (patches per image, log-mel frames per clip),
    for every phase of the table (empty where the data has none).

    split[i] = where a sample of several documents sharing its media (a preference pair: its
    chosen document, then its rejected one; a GRPO group: its prompt's completions, each after
    the prompt) splits, in one row: the LLM tokens of each of its documents but the last, in
    order, 0 past them (a sample of one document: all 0) [samples, most documents - 1]; None
    (every index without the column: SFT data, indexes built before it) is all zeros. The
    column on disk is a pair's one cut (`data.parts`): [samples] there, read as [samples, 1].
    Such a sample's `text` counts every document's text and one copy of its placeholder rows
    (its media are encoded once), so its `llm_tokens` are all its documents' tokens: what its
    row holds (its linear work); its attention is its documents', the cuts then llm_tokens -
    their sum (`llm_documents`), as bucketize writes them (a segment each).
    """

    text: np.ndarray
    items: dict[str, Items]
    mixture: Mixture | None = None  # several data sets drawn by weight (data.sources)
    # The epoch order (`jaxmllm.plan.stream`): "permutation", a stored permutation (indexes
    # held in memory: synthetic, benchmark mixes), or "index", a bijective index shuffle that
    # stores nothing (a mapped index, `jaxmllm.data.columnar`, of any size)
    shuffle: str = "permutation"
    # int64 [samples, most documents - 1]: each document's LLM tokens but the last's
    split: np.ndarray | None = None

    def __post_init__(self):
        """Every encoder phase has its items (none where not given); a split per row, if any."""
        empty = Items.none(len(self.text))
        self.items = {p.name: self.items.get(p.name, empty) for p in ENCODERS}
        if self.split is not None and self.split.ndim == 1:  # (a pair's cut, as on disk: a view)
            self.split = self.split.reshape(-1, 1)
        if self.split is not None and len(self.split) != len(self.text):
            raise ValueError(f"split has {len(self.split)} rows, text {len(self.text)}")

    def __len__(self) -> int:
        """The samples."""
        return len(self.text)

    @classmethod
    def from_records(cls, records: list[dict]) -> LengthsIndex:
        """Builds the index from dicts like {"text": 312, "images": [1024], "audio": [850]};
        a sample of several documents (a preference pair, a GRPO group) says where it splits,
        `"split": n1` (its first document's LLM tokens; [n1, n2, ...]: each one's but the
        last) or `"documents": [n1, n2, ...]` (each one's)."""
        split = cuts_matrix([_split_of(r) for r in records])
        return cls(
            text=np.array([r.get("text", 0) for r in records], np.int64),
            items={
                p.name: Items.from_lists([list(r.get(p.items, [])) for r in records])
                for p in ENCODERS
            },
            split=split if split.any() else None,
        )

    @classmethod
    def concat(cls, parts: list[LengthsIndex], mixture: Mixture | None = None) -> LengthsIndex:
        """The samples of `parts`, one after another."""
        items = {}
        for p in ENCODERS:
            sizes = [part.items[p.name].sizes for part in parts]
            counts = [part.items[p.name].count() for part in parts]
            items[p.name] = Items(
                ptr=np.cumsum([0, *np.concatenate(counts)]).astype(np.int64),
                sizes=np.concatenate(sizes).astype(np.int64),
            )
        text = np.concatenate([part.text for part in parts]).astype(np.int64)
        mapped = any(part.shuffle == "index" for part in parts)
        split = None
        if any(part.split is not None for part in parts):
            cols = [part.split_of() for part in parts]
            k = max(c.shape[1] for c in cols)
            split = np.concatenate([np.pad(c, ((0, 0), (0, k - c.shape[1]))) for c in cols])
        return cls(text, items, mixture, "index" if mapped else "permutation", split)

    def split_rows(self, ids) -> np.ndarray | None:
        """The split column of the samples `ids` (an index array or a slice; None where the
        index has none): what an index made of some of this one's samples carries."""
        return None if self.split is None else np.asarray(self.split[ids], np.int64)

    def split_of(self, samples: np.ndarray | None = None) -> np.ndarray:
        """Where each of `samples` (default: all) splits: each of its documents' LLM tokens but
        the last's, 0 past them, all 0 for a sample of one document (int64 [samples, K])."""
        n = len(self) if samples is None else len(samples)
        if self.split is None:
            return np.zeros((n, 1), np.int64)
        rows = self.split if samples is None else self.split[np.asarray(samples, np.int64)]
        return np.asarray(rows, np.int64)

    def record(self, i: int) -> dict:
        """Sample i in the lengths-file format (`split` only for a sample of several
        documents: a pair's one cut, a number; more, a list)."""
        out = {"text": int(self.text[i])}
        out.update({p.items: self.items[p.name].of(i).tolist() for p in ENCODERS})
        cuts = [] if self.split is None else [int(c) for c in self.split[i] if c]
        if cuts:
            out["split"] = cuts[0] if len(cuts) == 1 else cuts
        return out

    def write_jsonl(self, path: str | Path) -> None:
        """Writes the lengths file (one JSON object a line)."""
        with open(path, "w") as f:
            for i in range(len(self)):
                f.write(json.dumps(self.record(i)) + "\n")

    def units(self) -> dict[str, np.ndarray]:
        """Each encoder phase's units per sample."""
        return {name: items.per_sample() for name, items in self.items.items()}

    def work(self, per_token: Mapping[str, int]) -> np.ndarray:
        """Each sample's work per phase [sample, (LLM tokens, then each encoder phase's units,
        in the table's order)]."""
        return np.stack([self.llm_tokens(per_token), *self.units().values()], 1)

    def llm_tokens(self, per_token: Mapping[str, int]) -> np.ndarray:
        """LLM sequence length of each sample: text + one token per encoder output row
        (`per_token[phase]` units each)."""
        out = self.text.copy()
        for name, items in self.items.items():
            out = out + items.per_sample(items.sizes // per_token[name])
        return out

    def llm_documents(self, per_token: Mapping[str, int]) -> np.ndarray:
        """The LLM tokens of every document attention sees, sample by sample: a sample's
        `llm_tokens`, or its documents' (the cuts, then the rest) one after the other
        (`llm_tokens` itself when the index has no split)."""
        llm = self.llm_tokens(per_token)
        if self.split is None:
            return llm
        return split_documents(llm, np.asarray(self.split, np.int64))

    def phases_of(self) -> tuple[str, ...]:
        """The phases the data has: the LLM's, and each encoder phase with any item."""
        return (LLM, *(name for name, items in self.items.items() if len(items)))


def cuts_matrix(rows: list) -> np.ndarray:
    """The split column [samples, K] of each sample's cuts (an int, 0: none; or a list), 0
    past a sample's own (K: the most cuts, at least 1)."""
    rows = [np.atleast_1d(np.asarray(r, np.int64)) for r in rows]
    k = max((len(r) for r in rows), default=1)
    out = np.zeros((len(rows), max(k, 1)), np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def document_table(llm: np.ndarray, split: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sizes, real) [samples, K + 1]: each sample's documents' LLM tokens (its cuts, then
    the rest of its `llm` tokens), and which are documents (a sample's cuts > 0 and its last;
    the rest 0), for samples split at `split` [samples, K] (`LengthsIndex.split`)."""
    split = _as_cuts(split)
    rest = np.asarray(llm, np.int64) - split.sum(1)
    sizes = np.concatenate([split, rest[:, None]], 1)
    real = np.concatenate([split > 0, np.ones((len(llm), 1), bool)], 1)
    return sizes, real


def document_counts(split: np.ndarray) -> np.ndarray:
    """Each sample's documents (its cuts + 1) for samples split at `split` [samples, K]."""
    return 1 + (_as_cuts(split) > 0).sum(1).astype(np.int64)


def _as_cuts(split: np.ndarray) -> np.ndarray:
    """A split column as [samples, K] (a pair's column, [samples]: K = 1)."""
    split = np.asarray(split, np.int64)
    return split[:, None] if split.ndim == 1 else split


def split_documents(llm: np.ndarray, split: np.ndarray) -> np.ndarray:
    """The documents of samples of `llm` tokens split at `split` [samples, K] (all 0: one
    document), in sample order: each sample's in order."""
    sizes, real = document_table(llm, split)
    return sizes[real]


def _split_of(record: Mapping) -> int | list[int]:
    """A lengths-file row's split: `split` (its cuts: a number, or a list), or its
    `documents`' lengths but the last."""
    if "split" in record:
        cut = record["split"]
        return [int(c) for c in cut] if isinstance(cut, list | tuple) else int(cut)
    docs = record.get("documents")
    if isinstance(docs, list | tuple) and len(docs) > 1:
        return [int(d) for d in docs[:-1]]
    return 0
