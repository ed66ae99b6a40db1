"""ArrayRecord (grain's native format) for large datasets, and the converter from a JSONL manifest.

    python -m jaxmllm.data.arrayrecord --manifest data/train.jsonl --out data/train.array_record

Each JSONL record becomes one ArrayRecord record with its media bytes embedded, in the same order,
so the index, the rejects and the samples are the same for both. A record is
`MAGIC | u32 header length | JSON header | media blobs`; the header is the manifest object with
each media entry replaced by {"blob": [offset, length], "name": ...}. Lines that are not JSON and
missing files are kept as markers, so the index rejects them for the same reason as the JSONL path.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

from jaxmllm.data.manifest import JsonlRecords
from jaxmllm.data.rejects import RecordError, check_media_file

MAGIC = b"JMLR1"


def encode_record(obj: object, base_dir: Path, line: int) -> bytes:
    """One manifest object (media files read and embedded) as ArrayRecord bytes."""
    blobs: list[bytes] = []
    offset = 0

    def embed(entry):
        nonlocal offset
        if not isinstance(entry, str) or entry.startswith("data:"):
            return entry  # inline data and odd entries stay as they are
        path = base_dir / entry
        try:  # only regular files: reading a FIFO or a device would block or never end
            check_media_file(path)
            data = path.read_bytes()
        except (RecordError, OSError):  # the index reads the path again and names the reason
            return {"missing": str(path.absolute())}
        blobs.append(data)
        offset += len(data)
        return {"blob": [offset - len(data), len(data)], "name": entry}

    if isinstance(obj, dict) and "__malformed__" not in obj:
        obj = dict(obj)
        for key in ("images", "audio"):
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
        for key in ("images", "audio"):
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

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.base_dir = self.path.parent
        self._source = None
        self._len = len(self._open())

    def _open(self):
        if self._source is None:
            from grain.sources import ArrayRecordDataSource

            self._source = ArrayRecordDataSource(str(self.path))
        return self._source

    def __len__(self) -> int:
        return self._len

    def raw(self, k: int) -> tuple[object, int]:
        return decode_record(self._open()[int(k)])

    def __getstate__(self):
        return {**self.__dict__, "_source": None}


def convert(manifest: str | Path, out: str | Path) -> int:
    """Writes every record of `manifest` to the ArrayRecord file `out`; returns the count."""
    from array_record.python.array_record_module import ArrayRecordWriter

    records = JsonlRecords(manifest)
    writer = ArrayRecordWriter(str(out), "group_size:1")
    try:
        for k in range(len(records)):
            obj, line = records.raw(k)
            writer.write(encode_record(obj, records.base_dir, line))
    finally:
        writer.close()
    return len(records)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxmllm.data.arrayrecord", description=__doc__)
    p.add_argument("--manifest", required=True, help="the JSONL manifest")
    p.add_argument("--out", required=True, help="the .array_record file to write")
    args = p.parse_args(argv)
    if not args.out.endswith(".array_record"):
        print("error: --out must end in .array_record", file=sys.stderr)
        return 2
    n = convert(args.manifest, args.out)
    print(f"wrote {n} records to {args.out}")
    print(f"next: python -m jaxmllm.data.index --manifest {args.out} --config <your config>")
    return 0


if __name__ == "__main__":
    sys.exit(main())
