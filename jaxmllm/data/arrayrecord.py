"""The converter from any data set to ArrayRecord (grain's native format), for large datasets.

    python -m jaxmllm.data.arrayrecord --manifest data/train.jsonl --out data/train.array_record

Each record (of any data.format: `--format`, default auto; `--media-root` as data.media_root)
becomes one ArrayRecord record in jaxmllm's schema with its media bytes embedded, in the same
order, so the index, the rejects and the samples are the same for both. The record format and
its reader are in `jaxmllm.data.records.arrayrecord` (`encode_record`, `decode_record`,
`ArrayRecordRecords`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxmllm.config import ConfigError, DataConfig, load_config
from jaxmllm.config.command import add_config_args
from jaxmllm.data.records import open_records
from jaxmllm.data.records.arrayrecord import encode_record
from jaxmllm.data.records.schemas import to_native
from jaxmllm.data.rejects import RecordError


def convert(
    manifest: str | Path,
    out: str | Path,
    fmt: str = "auto",
    media_root: str = "",
    data: DataConfig | None = None,
) -> int:
    """Writes every record of the data set at `manifest` to the ArrayRecord file `out`;
    returns the count.

    `data` (default settings without it): relative media paths start from `media_root` (else
    data.media_root, else the data file's folder) and are read only inside
    data.confine_media_to (else that folder) unless data.allow_outside_paths, and
    only files of at most data.max_media_bytes; what is not embedded is recorded with the
    reason (see `encode_record`), never its contents.
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    data = data or DataConfig()
    root, confine = media_root or data.media_root, data.confine_media_to
    records = open_records(manifest, fmt, root, data=data, confine=confine)
    writer = ArrayRecordWriter(str(out), "group_size:1")
    try:
        for k in range(len(records)):
            obj, line = records.raw(k)
            try:
                obj = to_native(obj, records.schema, records.fallback_id(k))
            except RecordError as e:  # (the index rejects the record, naming why)
                obj = {"__malformed__": f"{e.reason}: {e.detail}"}
            writer.write(encode_record(obj, records.paths, line, data.max_media_bytes))
    finally:
        writer.close()
    return len(records)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxmllm.data.arrayrecord", description=__doc__)
    p.add_argument("--manifest", required=True, help="the data: a file, a directory or a glob")
    p.add_argument("--format", default="auto", help="its data.format (default: detected)")
    p.add_argument(
        "--media-root",
        default="",
        help="as data.media_root (default: the config's, else the data file's folder)",
    )
    p.add_argument("--out", required=True, help="the .array_record file to write")
    add_config_args(
        p,
        required=False,
        config_help="a config whose data.media_root, data.confine_media_to, "
        "data.allow_outside_paths and data.max_media_bytes apply (default: their defaults)",
        set_help="override them, e.g. --set data.media_root=images/",
    )
    args = p.parse_args(argv)
    if not args.out.endswith(".array_record"):
        print("error: --out must end in .array_record", file=sys.stderr)
        return 2
    try:
        data = load_config(args.config, args.set).data
        n = convert(args.manifest, args.out, args.format, args.media_root, data)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} records to {args.out}")
    print(
        f"next: set data.path: {args.out} in your config, then python -m jaxmllm.data.index "
        "--config <your config>"
    )
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
