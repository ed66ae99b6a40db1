"""Records: the raw records of a data file and their parsing into a `Record`.

One reader per file format, each giving `raw(k) -> (object, line)` and `paths` (the folder the
record's media paths are relative to and confined to: `MediaPaths`): `jsonl` (a JSONL
manifest), `arrayrecord` (the same records with their media embedded). `record` parses an
object into a `Record` (or raises RecordError), which is all the layers above see of the file
format.
"""

from __future__ import annotations

from pathlib import Path

from jaxmllm.config import DataConfig
from jaxmllm.data.records.arrayrecord import ArrayRecordRecords
from jaxmllm.data.records.jsonl import JsonlRecords
from jaxmllm.data.records.record import MediaPaths, Record, parse_record


def media_paths(path: str | Path, data: DataConfig | None = None) -> MediaPaths:
    """Where the media paths of the data file at `path` lead: data.media_root, else the file's
    folder; confined there unless data.allow_outside_paths."""
    data = data or DataConfig()
    base = Path(data.media_root) if data.media_root else Path(path).parent
    return MediaPaths(base, anywhere=data.allow_outside_paths)


def open_records(path: str | Path, data: DataConfig | None = None):
    """The raw records of a JSONL manifest or an .array_record file (by suffix); `data` (the
    run's data section: default settings without it) says where media paths may lead and how
    long a manifest line may be (data.max_media_bytes)."""
    path = Path(path)
    data = data or DataConfig()
    if not path.exists():
        raise FileNotFoundError(f"no such data file: {path}")
    if path.suffix == ".array_record":
        return ArrayRecordRecords(path, media_paths(path, data))
    return JsonlRecords(path, media_paths(path, data), data.max_media_bytes)


def read_record(records, k: int) -> Record:
    """Parses record k (raises RecordError for a bad one)."""
    obj, line = records.raw(k)
    return parse_record(obj, records.paths, line)
