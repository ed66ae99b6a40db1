"""Records: the raw records of a data file and their parsing into a `Record`.

One reader per file format, each giving `raw(k) -> (object, line)` and `base_dir` (where the
record's media paths are relative to): `jsonl` (a JSONL manifest), `arrayrecord` (the same
records with their media embedded). `record` parses an object into a `Record` (or raises
RecordError), which is all the layers above see of the file format.
"""

from __future__ import annotations

from pathlib import Path

from jaxmllm.data.records.arrayrecord import ArrayRecordRecords
from jaxmllm.data.records.jsonl import JsonlRecords
from jaxmllm.data.records.record import Record, parse_record


def open_records(path: str | Path):
    """The raw records of a JSONL manifest or an .array_record file (by suffix)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such data file: {path}")
    if path.suffix == ".array_record":
        return ArrayRecordRecords(path)
    return JsonlRecords(path)


def read_record(records, k: int) -> Record:
    """Parses record k (raises RecordError for a bad one)."""
    obj, line = records.raw(k)
    return parse_record(obj, records.base_dir, line)
