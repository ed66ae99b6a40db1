"""An index folder's columns: what a build's shards found, merged; opened (mapped) and checked.

    <index>/summary.json         counts, percentiles, rejects by reason, the preprocessing
                                 parameters, `index_format`, and `columns`: every column file's
                                 dtype and shape (loading checks each file against it)
    <index>/rejects.jsonl        every rejected record: id, place, reason
    <index>/text.npy             per accepted record (a training sample): text tokens
    <index>/split.npy            (data of preference pairs only) per sample, its first
                                 document's LLM tokens: where the pair splits (0: one document)
    <index>/vision.ptr.npy  .sizes.npy    per encoder phase: sample i's items are
    <index>/audio.ptr.npy   .sizes.npy      sizes[ptr[i]:ptr[i + 1]], in the phase's units
    <index>/row.npy  line.npy    where each sample is: its record number, its line
    <index>/id.offsets.npy  id.bytes.npy  its record id (`columnar.Strings`)
    <index>/image_sizes.ptr.npy  .values.npy   per kind of media, each item's size from its
      (audio_samples, video_sizes)           header ([items, fields])
    <index>/files.path.*  files.size.npy  files.records.npy   the data files, their sizes, the
                                 first record of each
    <index>/scan.<key>.npy  scan.<key>.ptr.npy   what scanning the files found (line offsets,
                                 .tar members), file f's at [ptr[f]:ptr[f + 1]]

A build's shards write parts, which `jaxmllm.data.parts.stream` merges into these columns;
`StoredIndex` maps them and checks them against the summary.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxmllm.config.phases import ENCODERS
from jaxmllm.data.columnar import (
    ColumnError,
    Strings,
    chunks,
    open_column,
    open_strings,
)
from jaxmllm.data.lengths import Items, LengthsIndex
from jaxmllm.data.parts import SIZES, ragged_columns, row_part
from jaxmllm.data.preprocess import MEDIA, Sizes

# summary.json's index_format: a build that reads the data differently (what a record is, its
# id, what a scan finds) writes another, so an index built before it is a start-up error that
# names the rebuild command (`jaxmllm.data.source`), never read on the old rules. 2: a WebDataset
# key that comes back later and a cut shard are rejects, ids carry the file's place among
# several, records over the memory budget are rejects (issue 50)
FORMAT = "jaxmllm-columnar-2"


# ----------------------------------------------------------------------------- opening


class StoredIndex:
    """An index folder's columns, mapped and checked against its summary: each column file
    is the dtype and shape the summary's table says, every row count is the summary's, each
    pointer column spans its values. `lengths_only`: the planner's columns alone (a lengths
    index: `open_lengths`)."""

    def __init__(self, folder: Path, summary: dict, lengths_only: bool = False):
        self.folder, self.summary, self.lengths_only = Path(folder), summary, lengths_only
        table = summary.get("columns")
        if not isinstance(table, dict):
            raise ColumnError(f"{self.folder}/summary.json has no column table")
        self.table = table
        n = summary.get("accepted")
        if not isinstance(n, int) or n < 0:
            raise ColumnError(f"{self.folder}/summary.json: 'accepted' is not a count")
        self.n = n
        self.text = self._ints("text.npy", (n,))
        # (an index of pairs: where each splits; none, as every index built before it, else)
        self.split = self._ints("split.npy", (n,)) if "split.npy" in table else None
        if lengths_only:
            self.items = {p.name: Items(*self._ragged(p.name, f"{p.name}.sizes")) for p in ENCODERS}
            return
        self.row = self._ints("row.npy", (n,))
        self.line = self._ints("line.npy", (n,))
        self.ids = open_strings(self.folder, "id", table)
        self._shape("id.offsets.npy", (n + 1,))
        ragged = {name: self._ragged(name, values) for name, values, _, _ in ragged_columns()}
        self.items = {p.name: Items(*ragged[p.name]) for p in ENCODERS}
        self.sizes = {kind: ragged[key] for kind, key in SIZES.items()}
        self.files = open_strings(self.folder, "files.path", table)
        f = len(self.files)
        self.file_sizes = self._ints("files.size.npy", (f,))
        self.file_starts = self._ints("files.records.npy", (f + 1,))
        self.scans = ScanColumns(self.folder, table, summary.get("scan_keys", []), f)

    def __reduce__(self):
        # Sent to a worker process as its folder, mapped again there: pickling the mapped
        # arrays would copy every column into each worker.
        if not self.table:  # (held in memory: `of_rows`)
            return object.__reduce__(self)
        return StoredIndex, (self.folder, self.summary, self.lengths_only)

    @classmethod
    def of_rows(cls, rows: list[dict]) -> StoredIndex:
        """An index held in memory, of accepted rows (the build's measure() dicts): what the
        fuzz harness and small tools load samples through without writing a folder."""
        part = row_part(rows)
        out = cls.__new__(cls)
        out.folder, out.summary, out.table, out.n = Path("."), {}, {}, len(rows)
        out.lengths_only = False
        out.text, out.row, out.line = part["text"], part["row"], part["line"]
        out.split = part["split"] if part["split"].any() else None
        out.ids = Strings(part["id.offsets"], part["id.bytes"])
        ragged = {
            name: (np.concatenate([[0], np.cumsum(part[f"{name}.count"])]), part[values])
            for name, values, _, _ in ragged_columns()
        }
        out.items = {p.name: Items(*ragged[p.name]) for p in ENCODERS}
        out.sizes = {kind: ragged[key] for kind, key in SIZES.items()}
        return out

    def _ints(self, file: str, shape: tuple) -> np.ndarray:
        """Column `file`, mapped, checked to be int64 counts of `shape`'s leading dimensions."""
        array = open_column(self.folder, file, self.table)
        if array.dtype != np.int64:
            raise ColumnError(f"{self.folder / file} holds {array.dtype}, not int64 counts")
        return self._shape(file, shape, array)

    def _shape(self, file: str, shape: tuple, array=None) -> np.ndarray:
        """Column `file` (or the `array` already mapped), checked to have `shape`'s leading
        dimensions: a half-written or mixed-up index has other row counts."""
        array = open_column(self.folder, file, self.table) if array is None else array
        if array.shape[: len(shape)] != shape:
            raise ColumnError(
                f"{self.folder / file} has {array.shape[0]} rows, the summary's "
                f"{self.n} samples need {shape[0]} (a half-written or mixed-up index)"
            )
        return array

    def _ragged(self, name: str, values: str) -> tuple[np.ndarray, np.ndarray]:
        """A ragged column's row pointers and values, the pointers checked to span the values."""
        ptr = self._ints(f"{name}.ptr.npy", (self.n + 1,))
        data = open_column(self.folder, f"{values}.npy", self.table)
        if len(ptr) and (int(ptr[0]) != 0 or int(ptr[-1]) != len(data)):
            raise ColumnError(
                f"{self.folder / name}.ptr.npy: its ends ({int(ptr[0])}, {int(ptr[-1])}) do "
                f"not span the {len(data)} values"
            )
        return ptr, data

    def lengths(self) -> LengthsIndex:
        """The planner's index: views of the mapped counts, drawn by the index shuffle."""
        return LengthsIndex(self.text, dict(self.items), shuffle="index", split=self.split)

    def media_sizes(self, i: int) -> Sizes:
        """Sample i's media sizes, as its record's header gave them."""
        out = {}
        for kind, (ptr, values) in self.sizes.items():
            types = MEDIA[kind].size_types
            rows = values[int(ptr[i]) : int(ptr[i + 1])].tolist()
            out[kind] = [tuple(t(v) for t, v in zip(types, r, strict=True)) for r in rows]
        return Sizes(out)


def open_lengths(folder: Path) -> LengthsIndex:
    """The planner's lengths of the index in `folder` (built, or `bench.lengths_synth`'s),
    mapped and checked; ColumnError naming what is wrong."""
    folder = Path(folder)
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError) as e:
        raise ColumnError(f"{folder}/summary.json: not an index's summary ({e})") from None
    if not isinstance(summary, dict) or summary.get("index_format") != FORMAT:
        raise ColumnError(f"{folder}: not a {FORMAT} index")
    return StoredIndex(folder, summary, lengths_only=True).lengths()


class ScanColumns:
    """What scanning the data files found, as mapped columns: `of(f)` is file f's scan (views),
    as its reader takes it."""

    def __init__(self, folder: Path, table: dict, keys: list[str], files: int):
        """Each data file's scan columns (`keys`), mapped from `folder`: a pointer per file into its
        values (what a record reader needs to seek without scanning the file again)."""
        self.args = (folder, table, keys, files)  # (a worker process maps them again)
        self.columns = {}
        for key in keys:
            ptr = open_column(folder, f"scan.{key}.ptr.npy", table)
            if ptr.shape != (files + 1,):
                raise ColumnError(f"{folder}/scan.{key}.ptr.npy: not one entry per data file")
            if f"scan.{key}.npy" in table:
                values = open_column(folder, f"scan.{key}.npy", table)
            else:
                values = open_strings(folder, f"scan.{key}", table)
            if int(ptr[-1]) != len(values) or int(ptr[0]) != 0:
                raise ColumnError(f"{folder}/scan.{key}.ptr.npy does not span scan.{key}")
            self.columns[key] = (ptr, values)

    def of(self, f: int) -> dict:
        """Data file f's scan values, by key."""
        return {k: v[int(p[f]) : int(p[f + 1])] for k, (p, v) in self.columns.items()}

    def __reduce__(self):
        """Sent to a worker process as its files, mapped again there."""
        return ScanColumns, self.args


def check_lengths(index: StoredIndex, largest: dict[str, int]) -> None:
    """Raises ColumnError, naming the file, for counts no build writes: negative text, items
    of no units or more than `largest[phase]` (what the preprocessing settings allow), item
    pointers that go back. One pass in windows, none of it kept resident."""
    _within(index.folder, "text.npy", index.text, 0, None)
    if index.split is not None:
        _within(index.folder, "split.npy", index.split, 0, None)
    for name, items in index.items.items():
        _ascending(index.folder, f"{name}.ptr.npy", items.ptr)
        _within(index.folder, f"{name}.sizes.npy", items.sizes, 1, largest.get(name))


def check_places(index: StoredIndex) -> None:
    """Raises ColumnError, naming the file, for places no build writes: record numbers out of
    order or past the data, negative lines or media sizes, pointers that go back, scan
    offsets outside the files. One pass in windows, none of it kept resident."""
    records = int(index.file_starts[-1]) if len(index.file_starts) else 0
    _ascending(index.folder, "row.npy", index.row, strict=True)
    _within(index.folder, "row.npy", index.row, 0, records - 1)
    _within(index.folder, "line.npy", index.line, 0, None)
    for kind, (ptr, values) in index.sizes.items():
        _ascending(index.folder, f"{SIZES[kind]}.ptr.npy", ptr)
        _within(index.folder, f"{SIZES[kind]}.values.npy", values, 0, None)
    biggest = int(index.file_sizes.max(initial=0))
    for key, (ptr, values) in index.scans.columns.items():
        if not isinstance(values, Strings):
            _within(index.folder, f"scan.{key}.npy", values, 0, biggest)
        _ascending(index.folder, f"scan.{key}.ptr.npy", ptr)


def _within(folder: Path, file: str, column: np.ndarray, low, high) -> None:
    """Refuses (ColumnError, naming the file and the first row) a column with a value below
    `low` or above `high` (None: no upper bound), read a chunk at a time."""
    for start, part in chunks(column):
        outside = part < low
        if high is not None:
            outside |= part > high
        if outside.any():
            bad = int(np.flatnonzero(outside.reshape(len(part), -1).any(1))[0])
            most = "..." if high is None else high
            raise ColumnError(
                f"{folder / file}: row {start + bad} holds {part[bad].tolist()}, outside "
                f"[{low}, {most}]"
            )


def _ascending(folder: Path, file: str, column: np.ndarray, strict: bool = False) -> None:
    """Refuses a column that goes back anywhere (`strict`: or repeats), read a chunk at a time."""
    last = None
    for start, part in chunks(column):
        if not len(part):
            continue
        steps = np.diff(part) if last is None else np.diff(np.concatenate([[last], part]))
        if (steps <= 0).any() if strict else (steps < 0).any():
            raise ColumnError(f"{folder / file} goes back (or repeats) near row {start}")
        last = part[-1]
