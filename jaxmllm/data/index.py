"""The lengths index of a data set: one offline pass, then training plans from it.

    python -m jaxmllm.data.index --config configs/manifest_example.yaml

reads every record of every data set the config names (data.path, or each of data.sources, and
a held-out data.eval.path) once,
in whatever format it is stored (data.format; `auto` says what it detected and why), media sizes
from file headers (PIL reads the size without decoding, soundfile the duration), in parallel,
and writes to each data set's index folder (data.index_dir, default `<path>.index/<key>`, the key
naming the tokenizer and the preprocessing settings, so configs that differ keep their own):

- `lengths.jsonl`: one line per accepted record, in the DESIGN lengths format (a video's temporal
  patches are vision items among its `images`, in placeholder order) plus where the record is
  (`id`, `row`, `line`) and its media sizes (`image_sizes`, `audio_samples`, `video_sizes`:
  frames, frame rate, height, width from the container's header), which let the oversize policy
  repair a sample at start-up without touching the media;
- `summary.json`: counts, per-modality percentiles, the format and the files read, the
  preprocessing parameters the counts depend on (training checks them), rejects by reason with
  an example of each;
- `rejects.jsonl`: every rejected record with its id, place and reason;
- `scan.npz`: what opening the files found (line offsets, .tar member offsets), so training
  does not scan them again.

It prints the rejects by reason, one example each, and exits 1 when it accepted nothing or
less than data.min_accept of the records (naming the most common reason and, where the records
look like another format, the data.format to use); 2 for a config or a file it cannot read.
Training's row i is the i-th accepted record; rejected records are never planned. Training reads
the index back with `jaxmllm.data.source.open_source`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from jaxmllm.config import Config, ConfigError, load_config
from jaxmllm.config.phases import ENCODERS, KINDS
from jaxmllm.config.sections import files_format
from jaxmllm.data.datasets import (
    DataSet,
    acceptance_problem,
    data_sets,
    eval_set,
    index_dir,
    stem,
)
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.data.preprocess import MEDIA, Limits, Params, Preprocessor
from jaxmllm.data.records import open_records, read_record
from jaxmllm.data.records.formats import FORMATS, detect
from jaxmllm.data.rejects import RecordError, failed, media_hint, wrapped

# ----------------------------------------------------------------------------- building


def measure(records, pre: Preprocessor, k: int, decode: bool = False) -> dict:
    """Record k's index row ({"ok": True, ...counts}) or its reject ({"ok": False, ...}).

    Whatever one record does, the index goes on: an exception other than a RecordError
    (MemoryError included) is the record's reject too (`record_failed`, naming it).
    """
    line, rid = 0, None
    try:
        obj, line = records.raw(k)
        record = read_record(records, k)
        rid = record.id
        check_encoders(record, pre.p)
        sizes = pre.sizes(record)
        pre.check(record, sizes)
        if decode:  # full decode: catches files whose header is fine but whose data is not
            pre.sample(k, record, sizes, Limits())
        counts = pre.layout(record, sizes).counts()
    except RecordError as e:
        where = records.where(k) if hasattr(records, "where") else f"record {k}"
        return {"ok": False, **e.to_json(line=line, row=k, where=where)}
    except Exception as e:  # noqa: BLE001  one record never takes the index down
        err = failed(e, rid or (f"line:{line}" if line else f"row:{k}"))
        where = records.where(k) if hasattr(records, "where") else f"record {k}"
        return {"ok": False, **err.to_json(line=line, row=k, where=where)}
    return {
        "ok": True,
        **counts,
        "id": record.id,
        "row": k,
        "line": line,
        **{media.size_key: [list(s) for s in sizes.media[k]] for k, media in MEDIA.items()},
    }


def check_encoders(record, p: Params) -> None:
    """Raises RecordError for a record with items of a kind whose phase the model has no
    encoder for (videos: vision)."""
    for kind in KINDS:
        if record.media[kind.name] and kind.phase not in p.encoders.split(","):
            raise RecordError(
                "no_encoder",
                f"{len(record.media[kind.name])} {kind.item} item(s), but the model has no "
                f"{kind.phase} encoder (model.{kind.phase}.enabled: false): enable it, or "
                "leave such records out",
                record.id,
            )


_worker: dict = {}


def _init_worker(records, params: Params, decode: bool) -> None:
    _worker.update(records=records, pre=Preprocessor(params), decode=decode)


def _measure_chunk(ks: list[int]) -> list[dict]:
    return [measure(_worker["records"], _worker["pre"], k, _worker["decode"]) for k in ks]


def build_index(
    cfg: Config,
    path: str | Path | None = None,
    out: str | Path | None = None,
    *,
    workers: int = 0,
    decode: bool = False,
    progress: bool = True,
) -> dict:
    """Indexes one data set: `path` (in data.format, media under data.media_root), else the
    config's only one; into `out`, else its index folder. Returns the summary."""
    ds = data_set(cfg, path)
    if out is not None:
        ds = dataclasses.replace(ds, index_dir=str(out))
    return index_data_set(cfg, ds, workers=workers, decode=decode, progress=progress)


def data_set(cfg: Config, path: str | Path | None) -> DataSet:
    """The config's data set at `path` (one of data.sources, or data.path's settings for
    another file); without `path`, its only one."""
    sets = data_sets(cfg)
    if path is None:
        if len(sets) != 1:
            raise ConfigError(
                "several data.sources: name the one to index (`python -m "
                "jaxmllm.data.index --config ...` indexes them all)"
            )
        return sets[0]
    for ds in [*sets, eval_set(cfg)]:
        if ds is not None and str(ds.path) == str(path):
            return ds
    d = cfg.data
    fmt, name = files_format(d), stem(str(path))
    return DataSet(str(path), fmt, d.media_root, d.index_dir, name, 0.0, d.confine_media_to)


def index_data_set(
    cfg: Config, ds: DataSet, *, workers: int = 0, decode: bool = False, progress: bool = True
) -> dict:
    """Indexes data set `ds` into its index folder; returns the summary."""
    from tqdm import tqdm

    params = Params.from_config(cfg)
    records = open_records(ds.path, ds.format, ds.media_root, data=cfg.data, confine=ds.confine)
    out = index_dir(ds, params.counted())
    chunks = [list(range(a, min(a + 64, len(records)))) for a in range(0, len(records), 64)]
    bar = tqdm(total=len(records), desc=f"index {ds.name}", unit="rec", disable=not progress)
    results: list[dict] = []
    if workers > 0 and len(records):
        ctx = multiprocessing.get_context("spawn")  # safe even if JAX threads are running
        with ctx.Pool(workers, _init_worker, (records, params, decode)) as pool:
            for part in pool.imap(_measure_chunk, chunks):
                results += part
                bar.update(len(part))
    else:
        _init_worker(records, params, decode)
        for chunk in chunks:
            results += _measure_chunk(chunk)
            bar.update(len(chunk))
    bar.close()
    rows, rejects = _dedupe(results)
    summary = _write(cfg, params, ds, records, out, rows, rejects)
    return summary


def _dedupe(results: list[dict]) -> tuple[list[dict], list[dict]]:
    rows, rejects, seen = [], [], set()
    for r in results:
        ok = r.pop("ok")
        if ok and r["id"] in seen:
            ok, r = (
                False,
                {
                    **RecordError("duplicate_id", "seen on an earlier line", r["id"]).to_json(),
                    "line": r["line"],
                    "row": r["row"],
                },
            )
        if ok:
            seen.add(r["id"])
        (rows if ok else rejects).append(r)
    return rows, rejects


def _write(cfg, params, ds: DataSet, records, out: Path, rows, rejects) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "lengths.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    with open(out / "rejects.jsonl", "w") as f:
        for r in rejects:
            f.write(json.dumps(r) + "\n")
    np.savez(out / "scan.npz", **records.scan())
    summary = summarize(cfg, rows, rejects)
    summary.update(
        data=str(ds.path),
        format=records.format,
        detected=records.why,
        files=[[str(f.absolute()), f.stat().st_size] for f in records.files],
        params=params.counted(),
        ignored_members=records.ignored(),
        index=str(out),
    )
    if acceptance_problem(summary, cfg.data.min_accept):
        summary["format_hint"] = format_hint(records)
        summary["media_hint"] = media_hint(summary, records.paths.base)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def format_hint(records) -> str:
    """Where the records look like another format than the one read, the data.format to use."""
    try:
        found, why = detect(records.files)
    except ConfigError:
        return ""
    if found == records.format:
        return ""
    return (f"The files look like {FORMATS[found].what} ({why}): set data.format: {found} "
            "(or auto) and index again")  # fmt: skip


def summarize(cfg: Config, rows: list[dict], rejects: list[dict]) -> dict:
    """Counts and percentiles per modality (training sizes its buckets from the index itself:
    `batch.capacity: auto`)."""
    index = LengthsIndex.from_records(rows)
    llm = index.llm_tokens({p.name: p.per_token(cfg.model) for p in ENCODERS})
    stats = {"text_tokens": index.text, "llm_tokens": llm}
    for p in ENCODERS:
        stats[f"{p.unit}_per_{p.item}"] = index.items[p.name].sizes
        stats[f"{p.items}_per_sample"] = index.items[p.name].count()
    examples: dict[str, dict] = {}
    for r in rejects:
        examples.setdefault(r["reason"], {k: r.get(k) for k in ("id", "detail", "where")})
    videos = [r.get(MEDIA["video"].size_key, []) for r in rows]
    if any(videos):  # (their temporal patches are among the vision items above)
        stats["videos_per_sample"] = np.array([len(v) for v in videos], np.int64)
        stats["frames_per_video"] = np.array([f for v in videos for f, *_ in v], np.int64)
    return {
        "records": len(rows) + len(rejects),
        "accepted": len(rows),
        "rejected": len(rejects),
        "rejects": dict(Counter(r["reason"] for r in rejects).most_common()),
        "examples": examples,
        "percentiles": {k: _percentiles(v) for k, v in stats.items()},
    }


def _percentiles(v: np.ndarray) -> dict:
    if not len(v):
        return {"count": 0}
    q = np.percentile(v, [50, 90, 99])
    return {
        "count": int(len(v)),
        "total": int(v.sum()),
        "mean": round(float(v.mean()), 2),
        "p50": float(q[0]),
        "p90": float(q[1]),
        "p99": float(q[2]),
        "max": int(v.max()),
    }


# ----------------------------------------------------------------------------- CLI


def report(summary: dict) -> list[str]:
    """The console summary of an index: what was read, counts, rejects by reason (one example
    each), where it was written."""
    how = f"auto: {summary['detected']}" if summary.get("detected") else "data.format"
    lines = [
        f"{summary['data']}: {summary['format']} ({how})",
        f"  {summary['records']} records: {summary['accepted']} accepted, "
        f"{summary['rejected']} rejected",
    ]
    if summary["rejects"]:
        lines.append("  rejected, by reason (one example each):")
        for reason, n in summary["rejects"].items():
            ex = summary["examples"].get(reason, {})
            example = f"{ex.get('id')} ({ex.get('where')}): {ex.get('detail')}"
            lines += wrapped(f"    {reason:<22} {n:>7}  {example}", " " * 8)  # (whole)
    if summary.get("ignored_members"):
        left = ", ".join(f".{k} ({v})" for k, v in summary["ignored_members"].items())
        lines.append(f"  left out of the shards (not a record, caption or known media): {left}")
    lines.append(f"  wrote {summary['index']}/: lengths.jsonl, summary.json, rejects.jsonl")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.data.index",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="the training config (data, tokenizer, patch size, budgets)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--manifest", help="index this data file (directory, glob) instead of the "
                   "config's data (data.path's settings apply)")  # fmt: skip
    p.add_argument("--out", help="index folder (with --manifest; default: its keyed folder)")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--decode", action="store_true", help="fully decode media (slower, stricter)")
    args = p.parse_args(argv)
    failed = []
    try:
        cfg = load_config(args.config, args.set)
        if args.manifest:
            sets = [data_set(cfg, args.manifest)]
            if args.out:
                sets = [dataclasses.replace(sets[0], index_dir=args.out)]
        elif cfg.data.source == "synthetic":
            raise ConfigError("the config reads the built-in synthetic data (data.source): give "
                              "data.path or data.sources, or --manifest")  # fmt: skip
        else:
            sets = data_sets(cfg) + [e for e in [eval_set(cfg)] if e is not None]
        for ds in sets:
            summary = index_data_set(cfg, ds, workers=args.workers, decode=args.decode)
            print("\n".join(report(summary)))
            problem = acceptance_problem(summary, cfg.data.min_accept)
            if problem:
                failed.append(f"{ds.path}: {problem}")
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for message in failed:
        print(f"error: {message}", file=sys.stderr)
    if failed:
        return 1
    print("bucket sizes: batch.capacity: auto sizes the encoder buckets from it at start-up")
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
