"""ArrayRecord files (grain's native format): the records of a manifest with their media embedded.

`python -m jaxmllm.data.arrayrecord` writes one from a manifest, in the same order. Each record
is `MAGIC | u32 header length | JSON header | media blobs`: the header is the manifest object
with each media entry replaced by {"blob": [offset, length], "name": ...}; a file it could not
read is kept as {"missing": path}, so the index rejects it for the same reason as the JSONL path.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from jaxmllm.config.phases import ENCODERS
from jaxmllm.data.rejects import RecordError, check_media_file

MEDIA_KEYS = tuple(p.items for p in ENCODERS)  # a record's lists of media entries

MAGIC = b"JMLR1"


def encode_record(obj: object, base_dir: Path, line: int) -> bytes:
    """One manifest object (media files read and embedded) as ArrayRecord bytes."""
    blobs: list[bytes] = []
    offset = 0

    def embed(entry):
        nonlocal offset
        if isinstance(entry, dict) and isinstance(entry.get("bytes"), bytes):
            data = entry["bytes"]  # (a Parquet or WebDataset record's media)
        elif not isinstance(entry, str) or entry.startswith("data:"):
            return entry  # inline data and odd entries stay as they are
        else:
            path = base_dir / entry
            try:  # only regular files: reading a FIFO or a device would block or never end
                check_media_file(path)
                data = path.read_bytes()
            except (RecordError, OSError):  # the index reads the path again and names the reason
                return {"missing": str(path.absolute())}
        blobs.append(data)
        offset += len(data)
        name = entry if isinstance(entry, str) else entry.get("path")
        return {"blob": [offset - len(data), len(data)], "name": name}

    if isinstance(obj, dict) and "__malformed__" not in obj:
        obj = dict(obj)
        for key in MEDIA_KEYS:
            if isinstance(obj.get(key), list):
                obj[key] = [embed(e) for e in obj[key]]
    header = json.dumps({"record": obj, "line": line}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + b"".join(blobs)


def decode_record(data: bytes) -> tuple[object, int]:
    """(manifest object with media as {"bytes": ...}, line) of one ArrayRecord record; a marker
    the parser rejects as malformed_line when the bytes are not such a record (a corrupt file)."""
    if not data.startswith(MAGIC):
        return {"__malformed__": "not a jaxmllm ArrayRecord record"}, 0
    try:
        return _decode(data)
    except (struct.error, ValueError, ArithmeticError, RecursionError, LookupError, TypeError) as e:
        return {"__malformed__": f"corrupt ArrayRecord record: {type(e).__name__}: {e}"[:300]}, 0


def _decode(data: bytes) -> tuple[object, int]:
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    head = json.loads(data[start : start + n])
    body = memoryview(data)[start + n :]
    obj = head["record"]
    if isinstance(obj, dict):
        for key in MEDIA_KEYS:
            if isinstance(obj.get(key), list):
                obj[key] = [
                    {"bytes": bytes(body[e["blob"][0] : e["blob"][0] + e["blob"][1]])}
                    if isinstance(e, dict) and "blob" in e
                    else e
                    for e in obj[key]
                ]
    return obj, int(head["line"])


class ArrayRecordRecords:
    """Random access to the records of an .array_record file, through grain's data source."""

    def __init__(self, path: str | Path, scan: dict | None = None):
        self.path = Path(path)
        self._source = None
        self._len = len(self._open())

    def scan(self) -> dict:
        return {}  # (the file's own index: nothing to keep)

    def _open(self):
        if self._source is None:
            from grain.sources import ArrayRecordDataSource

            self._source = ArrayRecordDataSource(str(self.path))
        return self._source

    def __len__(self) -> int:
        return self._len

    def raw(self, k: int) -> tuple[object, int]:
        return decode_record(self._open()[int(k)])

    def where(self, k: int) -> str:
        return f"{self.path.name} record {int(k)}"

    def fallback_id(self, k: int) -> str:
        return f"{self.path.name}:{int(k)}"

    def __getstate__(self):
        return {**self.__dict__, "_source": None}
