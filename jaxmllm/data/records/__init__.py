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
from collections import Counter
from functools import partial
from pathlib import Path

import numpy as np

from jaxmllm.config import ConfigError, DataConfig, printable
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


class Records:
    """The records of a data set's files, one after another: record k of the set is record
    k - start[f] of file f."""

    def __init__(self, readers: list, fmt: str, paths: MediaPaths, why: str = ""):
        self.readers, self.format, self.paths, self.why = readers, fmt, paths, why
        self.schema = FORMATS[fmt].schema
        self.starts = np.cumsum([0, *(len(r) for r in readers)]).astype(np.int64)

    @property
    def base_dir(self) -> Path:
        return self.paths.base

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _at(self, k: int):
        f = int(np.searchsorted(self.starts, k, "right")) - 1
        return self.readers[f], int(k - self.starts[f])

    def raw(self, k: int) -> tuple[object, int]:
        reader, j = self._at(k)
        return reader.raw(j)

    def where(self, k: int) -> str:
        """Record k's place (file, line, member), printable: names come from the data."""
        reader, j = self._at(k)
        return printable(reader.where(j))

    def fallback_id(self, k: int) -> str:
        reader, j = self._at(k)
        return printable(reader.fallback_id(j))

    @property
    def files(self) -> list[Path]:
        return [r.path for r in self.readers]

    def scan(self) -> dict[str, np.ndarray]:
        """Every file's scan, keyed `<file number>/<name>` (an .npz's arrays)."""
        return {f"{i}/{k}": v for i, r in enumerate(self.readers) for k, v in r.scan().items()}

    def ignored(self) -> dict[str, int]:
        """Members left out of .tar shards, by extension (none for other formats)."""
        out: Counter[str] = Counter()
        for r in self.readers:
            out.update(getattr(r, "ignored", {}))
        return dict(out)


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
    ("" = the data file's folder, a directory's self). `scan`: the saved `Records.scan()` of
    these files (the index's), so they are not scanned again. `data` (the run's data section:
    default settings without it) says whether media paths may lead out of that folder and how
    large a record or a .tar member may be (data.max_media_bytes); `confine`, the folder they
    must stay inside instead (data.confine_media_to)."""
    data = data or DataConfig()
    files = data_files(path)
    why = ""
    if fmt == "auto":
        fmt, why = detect(files)
    container = FORMATS[fmt].container
    readers = []
    for i, f in enumerate(files):
        kind = container
        if container == "json":
            kind = "jsonarray" if json_container(f) == "array" else "jsonl"
        saved = (
            None
            if scan is None
            else {k.partition("/")[2]: v for k, v in scan.items() if k.partition("/")[0] == str(i)}
        )
        caps = {"max_bytes": data.max_media_bytes} if kind in CAPPED else {}
        readers.append(READERS[kind](f, saved or None, **caps))
    return Records(readers, fmt, media_paths(path, files, media_root, data, confine), why)


def read_record(records, k: int) -> Record:
    """Parses record k (raises RecordError for a bad one)."""
    obj, line = records.raw(k)
    schema = getattr(records, "schema", "jaxmllm")
    if schema != "jaxmllm":
        obj = to_native(obj, schema, records.fallback_id(k))
    return parse_record(obj, records.paths, line)
