"""ArrayRecord files (grain's native format): the records of a manifest with their media embedded.

`python -m jaxmllm.data.arrayrecord` writes one from a manifest, in the same order. Each record
is `MAGIC | u32 header length | JSON header | media blobs`: the header is the manifest object
with each media entry replaced by {"blob": [offset, length], "name": ...}; a file it could not
embed is kept as {"missing": "images[0]", "reason": why} (a path outside the media folder, a
file missing, over data.max_media_bytes or not a regular file; not its name, which may be a path
outside), which the index rejects for that reason, as it would the JSONL record, opening nothing.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from jaxmllm.config.phases import KINDS
from jaxmllm.data.records.handles import FILES
from jaxmllm.data.records.record import MediaPaths, valid_unicode
from jaxmllm.data.rejects import MAX_MEDIA_BYTES, RecordError, check_media_file

MEDIA_KEYS = tuple(k.items for k in KINDS)  # a record's lists of media entries

MAGIC = b"JMLR1"


def encode_record(
    obj: object, paths: MediaPaths | Path, line: int, max_bytes: int = MAX_MEDIA_BYTES
) -> bytes:
    """One manifest object (media files read and embedded) as ArrayRecord bytes; a path is
    read only inside `paths` (a bare Path: that folder) and only up to `max_bytes`."""
    paths = paths if isinstance(paths, MediaPaths) else MediaPaths(Path(paths))
    blobs: list[bytes] = []
    offset = 0

    def embed(entry, where):
        nonlocal offset
        if isinstance(entry, dict) and isinstance(entry.get("bytes"), bytes):
            data = entry["bytes"]  # (a Parquet or WebDataset record's media, read already)
            if len(data) > max_bytes:
                return {"missing": where, "reason": "media_too_large"}
        elif not isinstance(entry, str) or not entry or not valid_unicode(entry):
            return entry  # odd entries stay as they are (the parser judges them)
        elif entry.startswith("data:"):
            return entry  # inline data is in the header already
        else:
            try:  # only regular files inside the folder, size checked before a byte is read
                path = paths.resolve(entry, where, "?")
                check_media_file(path, max_bytes=max_bytes)
                with open(path, "rb") as f:
                    data = f.read(max_bytes + 1)
                if len(data) > max_bytes:  # (grown since the check)
                    raise RecordError("media_too_large", "", "?")
            # Kept: where the entry was and why it is not here (the index rejects the record
            # for that reason, opening nothing); not its name, which may be a path outside.
            except RecordError as e:
                return {"missing": where, "reason": e.reason}
            except (OSError, ValueError):  # unreadable (permissions, I/O error, a NUL byte)
                return {"missing": where, "reason": "missing_media"}
        blobs.append(data)
        offset += len(data)
        name = entry if isinstance(entry, str) else entry.get("path")
        return {"blob": [offset - len(data), len(data)], "name": name}

    if isinstance(obj, dict) and "__malformed__" not in obj:
        obj = dict(obj)
        for key in MEDIA_KEYS:
            if isinstance(obj.get(key), list):
                obj[key] = [embed(e, f"{key}[{j}]") for j, e in enumerate(obj[key])]
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
        with self._open() as source:
            self._len = len(source)

    def scan(self) -> dict:
        return {}  # (the file's own index: nothing to keep)

    def _open(self):
        """grain's source of the file (a context: held open in `handles.FILES`, bounded)."""
        from grain.sources import ArrayRecordDataSource

        opener = lambda: ArrayRecordDataSource(str(self.path))  # noqa: E731
        closer = lambda source: source.__exit__(None, None, None)  # noqa: E731
        return FILES.use(("arrayrecord", str(self.path)), opener, closer)

    def __len__(self) -> int:
        return self._len

    def raw(self, k: int) -> tuple[object, int]:
        with self._open() as source:
            data = source[int(k)]
        return decode_record(data)

    def where(self, k: int) -> str:
        return f"{self.path.name} record {int(k)}"

    def fallback_id(self, k: int) -> str:
        return f"{self.path.name}:{int(k)}"

    def close(self) -> None:
        """Nothing to close: the file is held in the process's bounded table (`handles`)."""
