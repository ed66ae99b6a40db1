"""The converter from a JSONL manifest to ArrayRecord (grain's native format), for large datasets.

    python -m jaxmllm.data.arrayrecord --manifest data/train.jsonl --out data/train.array_record

Each JSONL record becomes one ArrayRecord record with its media bytes embedded, in the same order,
so the index, the rejects and the samples are the same for both. The record format and its reader
are in `jaxmllm.data.records.arrayrecord` (`encode_record`, `decode_record`, `ArrayRecordRecords`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxmllm.data.records.arrayrecord import encode_record
from jaxmllm.data.records.jsonl import JsonlRecords


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
