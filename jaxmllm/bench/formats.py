"""Data as people have it: the index and load rates of each data.format, on the same records.

    python -m jaxmllm.bench.formats --records 20000 --workers 0,1,2 --json formats.json

Writes one data set of real image and audio files (PNG, JPEG, WAV; captions, chats with an
image, two images, a clip) in every format (`write_formats`: jaxmllm JSONL, LLaVA JSON, ShareGPT
JSONL, OpenAI messages JSONL, Parquet as HF datasets writes it, WebDataset .tar shards,
ArrayRecord), indexes each with 1 and 2 processes (records/s, headers only), then loads every
sample through the trainer's loader with each `data.workers` count (samples/s: decode,
resize, patchify, log-mel), and prints each format's load rate against ArrayRecord's.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxmllm.bench.data import COLOURS, PITCHES, write_audio, write_image
from jaxmllm.config.phases import ENCODERS

FORMATS = ("jsonl", "llava", "sharegpt", "messages", "parquet", "webdataset", "arrayrecord")
FILES = {  # each format's data path in the folder `write_formats` writes
    "jsonl": "data.jsonl",
    "llava": "llava.json",
    "sharegpt": "sharegpt.jsonl",
    "messages": "messages.jsonl",
    "parquet": "parquet",
    "webdataset": "shards",
    "arrayrecord": "data.array_record",
}
SHARDS = 2  # Parquet files and .tar shards a data set is split into


def make_records(folder: Path, n: int, seed: int = 0) -> list[dict]:
    """`n` chat records in jaxmllm's schema with real media files under `folder`/media: an
    image (PNG or JPEG), two images, a clip (WAV), or text alone; media paths relative to
    `folder`, placeholders first in the user turn."""
    (folder / "media").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        kind = k % 4
        colour, pitch = str(rng.choice(list(COLOURS))), str(rng.choice(list(PITCHES)))
        images, audio, lead, answer = [], [], "", "nothing"
        if kind in (0, 1):  # one image, or two
            for j in range(kind + 1):
                ext, fmt = (("png", "PNG"), ("jpg", "JPEG"))[(k + j) % 2]
                write_image(folder / f"media/{k}_{j}.{ext}", rng, colour, fmt)
                images.append(f"media/{k}_{j}.{ext}")
            lead, answer = "<image>" * len(images), f"a {colour} box"
        elif kind == 2:
            write_audio(folder / f"media/{k}.wav", rng, pitch, "WAV", 16000, 0.5)
            audio.append(f"media/{k}.wav")
            lead, answer = "<audio>", f"a {pitch} tone"
        question = "what is this?" if kind < 3 else f"count from {k % 10}"
        rec = {
            "id": f"r{k}",
            "messages": [
                {"role": "user", "content": lead + question},
                {"role": "assistant", "content": answer},
            ],
        }
        if images:
            rec["images"] = images
        if audio:
            rec["audio"] = audio
        out.append(rec)
    return out


def write_formats(folder: str | Path, records: list[dict]) -> dict[str, Path]:
    """Writes `records` (jaxmllm's schema, media under `folder`) in every format; returns each
    format's data path."""
    folder = Path(folder)
    paths = {f: folder / FILES[f] for f in FORMATS}
    _lines(paths["jsonl"], records)
    paths["llava"].write_text(json.dumps([_llava(r, k) for k, r in enumerate(records)], indent=1))
    _lines(paths["sharegpt"], [_sharegpt(r) for r in records])
    _lines(paths["messages"], [_messages(r) for r in records])
    write_parquet(paths["parquet"], records, folder)
    write_shards(paths["webdataset"], records, folder)
    from jaxmllm.data.arrayrecord import convert

    convert(paths["jsonl"], paths["arrayrecord"])
    return paths


def _lines(path: Path, records: list[dict]) -> None:
    """Writes `records` to `path` as JSON lines."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _turns(r: dict) -> list[dict]:
    """A record's OpenAI-style messages as ShareGPT turns (`from` human / gpt, `value`), for the
    LLaVA and ShareGPT formats."""
    return [
        {
            "from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
            "value": m["content"],
        }
        for m in r["messages"]
    ]


def _llava(r: dict, k: int) -> dict:
    """LLaVA: `image` a string (or a list), the placeholders left out of every other record."""
    out = {"id": r["id"], "conversations": _turns(r)}
    if k % 2 and not r.get("audio"):
        for t in out["conversations"]:
            t["value"] = t["value"].replace("<image>", "")
    images = r.get("images", [])
    if images:
        out["image"] = images[0] if len(images) == 1 else images
    if r.get("audio"):
        out["audio"] = r["audio"]
    return out


def _sharegpt(r: dict) -> dict:
    """LLaMA-Factory's sharegpt: `conversations`, `images`, `audios` lists, no id."""
    out = {"conversations": _turns(r)}
    if r.get("images"):
        out["images"] = r["images"]
    if r.get("audio"):
        out["audios"] = r["audio"]
    return out


def _messages(r: dict) -> dict:
    """OpenAI-style: each placeholder a content part naming its file."""
    sources = {p.name: list(r.get(p.items, [])) for p in ENCODERS}
    messages = []
    for m in r["messages"]:
        parts, text = [], m["content"]
        while text:
            at = [(text.find(p.placeholder), p) for p in ENCODERS if p.placeholder in text]
            if not at:
                parts.append({"type": "text", "text": text})
                break
            i, p = min(at, key=lambda x: x[0])
            if i:
                parts.append({"type": "text", "text": text[:i]})
            parts.append({"type": p.item, p.item: sources[p.name].pop(0)})
            text = text[i + len(p.placeholder) :]
        messages.append({"role": m["role"], "content": parts})
    return {"id": r["id"], "messages": messages}


def write_parquet(folder: Path, records: list[dict], root: Path, shards: int = SHARDS) -> None:
    """Parquet files as HF datasets writes them: media as {"bytes", "path"} structs (bytes
    embedded), messages as a list of {"role", "content"} structs, row groups of 100 rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    blob = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            *[(p.items, pa.list_(blob)) for p in ENCODERS],
        ]
    )
    for s, part in enumerate(np.array_split(np.arange(len(records)), shards)):
        rows = [records[int(k)] for k in part]
        table = pa.Table.from_pylist(
            [
                {
                    "id": r["id"],
                    "messages": r["messages"],
                    **{
                        p.items: [
                            {"bytes": (root / f).read_bytes(), "path": Path(f).name}
                            for f in r.get(p.items, [])
                        ]
                        for p in ENCODERS
                    },
                }
                for r in rows
            ],
            schema=schema,
        )
        pq.write_table(table, folder / f"train-{s:05d}-of-{shards:05d}.parquet", row_group_size=100)


def write_shards(folder: Path, records: list[dict], root: Path, shards: int = SHARDS) -> None:
    """WebDataset .tar shards: per sample `<key>.<j>.<ext>` media members and `<key>.json` (the
    record without its media lists)."""
    folder.mkdir(parents=True, exist_ok=True)
    for s, part in enumerate(np.array_split(np.arange(len(records)), shards)):
        with tarfile.open(folder / f"shard-{s:05d}.tar", "w") as tar:
            for k in part:
                r = records[int(k)]
                key = f"{int(k):08d}"
                _add(
                    tar,
                    f"{key}.json",
                    json.dumps(
                        {x: v for x, v in r.items() if x not in ("images", "audio")}
                    ).encode(),
                )
                for p in ENCODERS:
                    for j, f in enumerate(r.get(p.items, [])):
                        _add(
                            tar, f"{key}.{p.name}{j}.{Path(f).suffix[1:]}", (root / f).read_bytes()
                        )


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """Adds a member of these bytes to an open tar file (a WebDataset shard)."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


# ----------------------------------------------------------------------------- the benchmark


def bench(
    cfg, paths: dict[str, Path], workers: list[int], index_workers: list[int], samples: int = 0
) -> list[dict]:
    """Per format: index rate with each process count, load rate with each worker count (over
    `samples` samples at random, 0: all)."""
    import dataclasses

    from jaxmllm.data.datasets import data_sets
    from jaxmllm.data.index import index_data_set
    from jaxmllm.data.loader import Loader
    from jaxmllm.data.source import open_source

    rows = []
    for fmt, path in paths.items():
        row = {"format": fmt}
        data = dataclasses.replace(cfg.data, source="files", path=str(path), format=fmt)
        fcfg = dataclasses.replace(cfg, data=data)
        (ds,) = data_sets(fcfg)
        for w in index_workers:
            t0 = time.perf_counter()
            summary = index_data_set(fcfg, ds, workers=w if w > 1 else 0, progress=False)
            row[f"index_{w}p"] = round(summary["records"] / (time.perf_counter() - t0), 1)
        row["accepted"] = summary["accepted"]
        source = open_source(fcfg)
        for w in workers:
            wcfg = dataclasses.replace(fcfg, data=dataclasses.replace(fcfg.data, workers=w))
            loader = Loader(wcfg, source)
            loader.load(np.arange(min(8, len(source))), step=1)  # (starts the workers)
            order = np.random.default_rng(0).permutation(len(source))  # as the planner reads
            order = order[: samples or len(order)]
            t0 = time.perf_counter()
            for chunk in np.array_split(order, max(1, len(order) // 256)):
                loader.load(chunk, step=1)
            row[f"load_{w}w"] = round(len(order) / (time.perf_counter() - t0), 1)
            if loader.pool is not None:
                loader.pool.terminate()
        rows.append(row)
    base = next((r for r in rows if r["format"] == "arrayrecord"), None)
    for r in rows:
        for w in workers:
            if base:
                r[f"vs_arrayrecord_{w}w"] = round(r[f"load_{w}w"] / base[f"load_{w}w"], 2)
    return rows


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxmllm.bench.formats`: writes one data set of --records records in each record
    format, and times indexing each (per --index-processes) and loading samples (per --workers);
    prints the table."""
    from jaxmllm.config import load_config

    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.formats",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default="configs/manifest_example.yaml")
    p.add_argument("--records", type=int, default=20000)
    p.add_argument("--workers", default="0,1,2", help="data.workers counts for the load rate")
    p.add_argument("--index-processes", default="1,2")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument(
        "--load-samples",
        type=int,
        default=0,
        help="samples loaded at random per format and worker count (0: every one)",
    )
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    procs = [int(w) for w in args.index_processes.split(",")]
    cfg = load_config(args.config, ["data.source=files", "data.path=x", "data.workers=0"])
    with tempfile.TemporaryDirectory() as tmp:  # (the config first: a typo stops at once)
        records = make_records(Path(tmp), args.records)
        paths = write_formats(tmp, records)
        paths = {f: paths[f] for f in args.formats.split(",")}
        rows = bench(cfg, paths, workers, procs, args.load_samples)
    cols = [
        "format",
        "accepted",
        *(f"index_{w}p" for w in procs),
        *(f"load_{w}w" for w in workers),
        *(f"vs_arrayrecord_{w}w" for w in workers),
    ]
    print(
        f"{args.records} records; index: records/s with N processes; load: samples/s with "
        "N data.workers; vs_arrayrecord: load rate over ArrayRecord's"
    )
    print(" ".join(f"{c:>16}" for c in cols))
    for r in rows:
        print(" ".join(f"{r.get(c, ''):>16}" for c in cols))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
