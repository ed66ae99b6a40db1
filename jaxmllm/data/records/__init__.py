"""Records: the raw records of a data set, in any of its formats, and their parsing into a `Record`.

One reader per container, each giving `raw(k) -> (object, line)` (the record as the file holds
it, and its line or row), `where(k)` (its place, for messages), `fallback_id(k)` (its id where
the record has none) and `scan()` (what opening the file found: offsets, saved with the index):
`jsonl` (JSON lines), `jsonarray` (one JSON list), `parquet`, `webdataset` (.tar shards),
`arrayrecord`. `formats` says which reader and which schema each `data.format` is, and detects
`auto`; `schemas` makes another tool's record (LLaVA's conversations, OpenAI messages, a Parquet
row, a WebDataset sample) into jaxmllm's, which `record` parses into a `Record` (or raises
RecordError): all the layers above see of the file format. `open_records` opens a data set (a
file, a directory of shards or a glob) as one `Records`, whose `paths` (`MediaPaths`) say where
its records' media paths lead: data.media_root, else the data file's folder, and only inside it
unless data.allow_outside_paths.
"""

from __future__ import annotations

import os
import resource
from collections import Counter, OrderedDict
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np

from jaxmllm.config import ConfigError, DataConfig, printable
from jaxmllm.data import budget
from jaxmllm.data.records.arrayrecord import ArrayRecordRecords
from jaxmllm.data.records.formats import FORMATS, data_files, detect, json_container
from jaxmllm.data.records.jsonl import JsonRecords
from jaxmllm.data.records.parquet import ParquetRecords
from jaxmllm.data.records.record import MediaPaths, Record, parse_record
from jaxmllm.data.records.schemas import to_native
from jaxmllm.data.records.webdataset import TarRecords

READERS = {
    "jsonl": JsonRecords,
    "jsonarray": partial(JsonRecords, array=True),
    "parquet": ParquetRecords,
    "tar": TarRecords,
    "arrayrecord": ArrayRecordRecords,
}
CAPPED = (
    "jsonl",
    "jsonarray",
    "tar",
    "parquet",
)  # readers that take data.max_media_bytes (`max_bytes`)


def _open_readers() -> int:
    """Readers a process keeps open (a file handle each) at most: 64, or an eighth of its file
    descriptor limit; the least recently read are closed, so a data set of 10^5 files never
    runs out of descriptors."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 64 if soft == resource.RLIM_INFINITY else int(np.clip(soft // 8, 4, 64))


class FileScans:
    """What scanning each file found (a reader's `scan()`: offsets of lines, members, row
    groups), in memory: `of(f)` is file f's. (The index keeps them as mapped columns instead:
    `jaxmllm.data.stored.ScanColumns`, which has the same `of`.) `ignored`: .tar members left
    out, by extension."""

    def __init__(self, scans: list[dict], ignored: dict[str, int] | None = None):
        self.scans, self.ignored = list(scans), dict(ignored or {})

    def of(self, f: int) -> dict:
        return self.scans[f]


class Records:
    """The records of a data set's files, one after another: record k of the set is record
    k - starts[f] of file f.

    File f's reader is made when one of its records is first read (from `scans.of(f)`, what
    scanning it found) and kept among the `most_open` most recently read; an older one is
    closed (its file handle, its cached row groups), and made again if read again.
    """

    def __init__(
        self,
        files: Sequence[Path],
        starts: np.ndarray,
        fmt: str,
        paths: MediaPaths,
        scans,
        why: str = "",
        caps: dict | None = None,
    ):
        self.files, self.starts, self.format, self.paths = files, starts, fmt, paths
        self.scans, self.why, self.caps = scans, why, caps or {}
        self.schema = FORMATS[fmt].schema
        self.container = FORMATS[fmt].container
        self._live: OrderedDict[int, object] = OrderedDict()
        self.most_open = _open_readers()
        self._common: str | None = None  # the folder of every file (`place`)

    @property
    def base_dir(self) -> Path:
        return self.paths.base

    def __len__(self) -> int:
        return int(self.starts[-1])

    def reader(self, f: int):
        """File f's reader (made, or the kept one)."""
        reader = self._live.get(f)
        if reader is not None:
            self._live.move_to_end(f)
            return reader
        kind = "jsonl" if self.container == "json" else self.container
        caps = self.caps if kind in CAPPED else {}
        reader = self._live[f] = READERS[kind](self.files[f], self.scans.of(f), **caps)
        while len(self._live) > self.most_open:
            self._live.popitem(last=False)[1].close()
        return reader

    def _at(self, k: int):
        f = int(np.searchsorted(self.starts, k, "right")) - 1
        return self.reader(f), int(k - self.starts[f])

    def raw(self, k: int) -> tuple[object, int]:
        reader, j = self._at(k)
        return reader.raw(j)

    def where(self, k: int) -> str:
        """Record k's place (file, line, member), printable: names come from the data."""
        reader, j = self._at(k)
        return printable(reader.where(j))

    def fallback_id(self, k: int) -> str:
        """Record k's id where it names none: its place in the data set. Within one file the
        reader's (`data.jsonl:12`, a shard's key); among several, the file's path from the
        data set's folder first (`en/data.jsonl:12`, `shards/000.tar:000012`), so two
        folders' `data.jsonl` or two shards whose keys restart at 000000 never share one."""
        f = int(np.searchsorted(self.starts, k, "right")) - 1
        own = self.reader(f).fallback_id(int(k - self.starts[f]))
        if len(self.files) == 1:
            return printable(own)
        place = self.place(f)
        return printable(f"{place}:{own.removeprefix(Path(place).name + ':')}")

    def place(self, f: int) -> str:
        """File f's path from the folder that holds all the data set's files."""
        if self._common is None:  # (files are sorted: the first and last share the most)
            ends = [str(Path(self.files[i]).parent) for i in (0, len(self.files) - 1)]
            self._common = os.path.commonpath(ends)
        return os.path.relpath(str(self.files[f]), self._common)

    def scan(self):
        """What scanning the files found (to open them again without scanning)."""
        return self.scans

    def ignored(self) -> dict[str, int]:
        """Members left out of .tar shards, by extension (none for other formats)."""
        return dict(getattr(self.scans, "ignored", {}))

    def close(self) -> None:
        """Closes every reader's file."""
        while self._live:
            self._live.popitem()[1].close()

    def __getstate__(self):
        return {**self.__dict__, "_live": OrderedDict()}


def scan_file(path: Path, fmt: str, data: DataConfig | None = None) -> tuple[dict, dict]:
    """(what scanning file `path` of data.format `fmt` finds: its reader's `scan()`; members
    of a .tar shard left out, by extension)."""
    data = data or DataConfig()
    kind = FORMATS[fmt].container
    if kind == "json":
        kind = "jsonarray" if json_container(path) == "array" else "jsonl"
    caps = {"max_bytes": data.max_media_bytes} if kind in CAPPED else {}
    reader = READERS[kind](path, None, **caps)
    try:
        return {**reader.scan(), "records": np.asarray([len(reader)], np.int64)}, dict(
            getattr(reader, "ignored", {})
        )
    finally:
        reader.close()


def media_paths(
    path: str | Path,
    files: list[Path],
    media_root: str | Path = "",
    data: DataConfig | None = None,
    confine: str | Path = "",
) -> MediaPaths:
    """Where the media paths of the data set at `path` (its `files`) lead: relative ones start
    from `media_root`, else the data file's folder (a directory's self); all must stay inside
    `confine` (default: that folder) unless data.allow_outside_paths.

    Raises:
      ConfigError: a `confine` folder that does not hold the folder paths start from.
    """
    if media_root:
        base = Path(media_root)
    else:
        base = Path(path) if Path(path).is_dir() else files[0].parent
    inside = Path(confine) if confine else None
    if inside is not None and not Path(os.path.realpath(base)).is_relative_to(
        os.path.realpath(inside)
    ):
        raise ConfigError(
            f"data.confine_media_to={confine} does not hold {base}, the folder relative media "
            "paths start from (data.media_root, else the data file's folder): every relative "
            "path would be rejected; set it to a folder that holds both"
        )
    return MediaPaths(base, anywhere=(data or DataConfig()).allow_outside_paths, inside=inside)


def open_records(
    path: str | Path,
    fmt: str = "auto",
    media_root: str | Path = "",
    scan: dict | None = None,
    data: DataConfig | None = None,
    confine: str | Path = "",
) -> Records:
    """The records of the data set at `path` (a file, a directory of shards or a glob) in
    data.format `fmt` (`auto`: detected; `why` says how); media paths relative to `media_root`
    ("" = the data file's folder, a directory's self). `scan`: what scanning these files found
    (`FileScans` of `scan_file`'s, or the index's mapped columns), so they are not scanned
    again. `data` (the run's data section:
    default settings without it) says whether media paths may lead out of that folder and how
    large a record or a .tar member may be (data.max_media_bytes); `confine`, the folder they
    must stay inside instead (data.confine_media_to)."""
    data = data or DataConfig()
    files = data_files(path)
    why = ""
    if fmt == "auto":
        fmt, why = detect(files)
    if scan is None:
        scanned = [scan_file(f, fmt, data) for f in files]
        ignored: Counter[str] = Counter()
        for _, left_out in scanned:
            ignored.update(left_out)
        scan = FileScans([found for found, _ in scanned], dict(ignored))
    counts = [int(scan.of(f)["records"][0]) for f in range(len(files))]
    starts = np.cumsum([0, *counts]).astype(np.int64)
    memory = budget.resolve(data.worker_memory, max(1, data.workers))
    caps = {"max_bytes": data.max_media_bytes, "max_memory": memory}
    return Records(
        files, starts, fmt, media_paths(path, files, media_root, data, confine), scan, why, caps
    )


def read_record(records, k: int) -> Record:
    """Parses record k (raises RecordError for a bad one)."""
    obj, line = records.raw(k)
    schema = getattr(records, "schema", "jaxmllm")
    fallback = records.fallback_id(k) if hasattr(records, "fallback_id") else None
    if schema != "jaxmllm":
        obj = to_native(obj, schema, fallback)
    return parse_record(obj, records.paths, line, fallback)
