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

from jaxmllm.config import ConfigError, DataConfig, load_config
from jaxmllm.data.records import media_paths
from jaxmllm.data.records.arrayrecord import encode_record
from jaxmllm.data.records.jsonl import JsonlRecords


def convert(manifest: str | Path, out: str | Path, data: DataConfig | None = None) -> int:
    """Writes every record of `manifest` to the ArrayRecord file `out`; returns the count.

    `data` (default settings without it): media paths are read only inside data.media_root
    (else the manifest's folder) unless data.allow_outside_paths, and only files of at most
    data.max_media_bytes; what is not embedded is recorded with the reason (see
    `encode_record`), never its contents.
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    data = data or DataConfig()
    records = JsonlRecords(manifest, media_paths(manifest, data), data.max_media_bytes)
    writer = ArrayRecordWriter(str(out), "group_size:1")
    try:
        for k in range(len(records)):
            obj, line = records.raw(k)
            writer.write(encode_record(obj, records.paths, line, data.max_media_bytes))
    finally:
        writer.close()
    return len(records)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxmllm.data.arrayrecord", description=__doc__)
    p.add_argument("--manifest", required=True, help="the JSONL manifest")
    p.add_argument("--out", required=True, help="the .array_record file to write")
    p.add_argument("--config", help="a config whose data.media_root, data.allow_outside_paths "
                   "and data.max_media_bytes apply (default: their defaults)")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override them, e.g. --set data.media_root=images/")  # fmt: skip
    args = p.parse_args(argv)
    if not args.out.endswith(".array_record"):
        print("error: --out must end in .array_record", file=sys.stderr)
        return 2
    try:
        data = load_config(args.config, args.set).data
        n = convert(args.manifest, args.out, data)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} records to {args.out}")
    print(f"next: python -m jaxmllm.data.index --manifest {args.out} --config <your config>")
    return 0


if __name__ == "__main__":
    sys.exit(main())
