"""The index build: a map over shards of the data files, then a merge into a staging folder
that is renamed into place once whole.

1. scan: each group of files is scanned (line offsets, .tar members, row groups) by a job,
   which writes its part; the merge makes them the index's `files.*` and `scan.*` columns.
2. measure: each shard of records (a range of record numbers) is read and measured by a job
   (`measure`: a row of counts, or a reject), which writes its part.
3. merge: the parts, in record order, become the columns (`stored.merge_rows`; a repeated id
   is a `duplicate_id` reject), rejects.jsonl and summary.json; then the folder is published.

Jobs run where `shards` puts them (this process, local processes, Ray tasks) and write their
parts to `<staging>/parts/` under a temporary name, renamed when complete: the merge never
reads half a part, and nothing the trainer reads exists until the staging folder is renamed.
The index is the same bytes whatever ran the jobs and however the records were sharded.

A job marks the record it is reading (`<part>.at`); when its process dies (killed for memory,
an abort in the Rust tokenizer), that record becomes a `record_crashed` reject naming it, at
once and without trying it again (why a process died on it is not known until someone looks:
the reject says where to look), and the rest of its shard runs in fresh processes; up to
`MAX_CRASHED` such records a build. A process that dies outside any record stops the build,
saying where.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxmllm.config import ConfigError, DataConfig
from jaxmllm.config.phases import KINDS
from jaxmllm.data import budget
from jaxmllm.data.columnar import Strings, save
from jaxmllm.data.parts import (
    duplicates,
    reject_part,
    row_part,
    row_specs,
    save_part,
    stream,
    strings,
)
from jaxmllm.data.preprocess import MEDIA, Limits, Params, Preprocessor
from jaxmllm.data.records import Records, read_record, scan_file
from jaxmllm.data.records.record import MediaPaths
from jaxmllm.data.rejects import RecordError, failed, shown_id
from jaxmllm.data.stored import ScanColumns

MAX_CRASHED = 32  # records whose worker died, at most, before the build stops
FILES_A_SCAN = 64  # data files a scan job reads at most


@dataclass(frozen=True)
class BuildContext:
    """What every job of one build needs (sent to each worker once)."""

    token: str  # the staging folder: where parts go (and what a Ray worker keys it by)
    files: tuple[str, ...]
    fmt: str
    paths: MediaPaths
    data: DataConfig
    params: Params
    decode: bool

    @property
    def parts(self) -> Path:
        return Path(self.token) / "parts"


# ----------------------------------------------------------------------------- a record


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
        "documents": 2 if record.is_pair else 1,
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


# ----------------------------------------------------------------------------- jobs

_worker: dict = {}


def init_worker(ctx: BuildContext) -> None:
    close_worker()
    _worker["ctx"] = ctx


def close_worker() -> None:
    """Closes what this process's jobs opened (the data files) and forgets the build."""
    if "records" in _worker:
        _worker["records"].close()
    _worker.clear()


def staged_records(ctx: BuildContext) -> Records:
    """The data set's records, opened on the scan columns the scan merge staged."""
    folder = Path(ctx.token)
    table = json.loads((folder / "scan.json").read_text())
    starts = np.load(folder / "files.records.npy", mmap_mode="r")
    scans = ScanColumns(folder, table["columns"], table["keys"], len(ctx.files))
    caps = {"max_bytes": ctx.data.max_media_bytes, "max_memory": ctx.params.worker_memory}
    return Records([Path(f) for f in ctx.files], starts, ctx.fmt, ctx.paths, scans, "", caps)


class Marker:
    """Where a job is (the record or file it reads), in `<part>.at`: read back when its
    process dies. -1: not started; -2: writing its part."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.set(-1)

    def set(self, k: int) -> None:
        os.pwrite(self.fd, struct.pack("<q", k), 0)

    def close(self) -> None:
        os.close(self.fd)


def read_marker(path: Path) -> int:
    try:
        return struct.unpack("<q", path.read_bytes()[:8])[0]
    except (OSError, struct.error):
        return -1


def scan_job(job: tuple[int, int]) -> dict:
    """Scans files a..b-1 into part `scan-<a>.npz` (each key's values of its files one after
    another, and `<key>.count` per file); returns what .tar shards left out."""
    ctx, cpu = _worker["ctx"], time.process_time()
    a, b = job
    name = f"scan-{a:09d}"
    marker, found, ignored = Marker(ctx.parts / f"{name}.at"), [], Counter()
    for f in range(a, b):
        marker.set(f)
        scan, left_out = scan_file(Path(ctx.files[f]), ctx.fmt, ctx.data)
        ignored.update(left_out)
        found.append(scan)
    marker.set(-2)
    arrays = {}
    for key in found[0]:
        values = [scan[key] for scan in found]
        arrays[f"{key}.count"] = np.asarray([len(v) for v in values], np.int64)
        if isinstance(values[0], Strings):
            joined = Strings.concat(values)
            arrays[f"{key}.offsets"], arrays[f"{key}.bytes"] = joined.offsets, joined.data
        else:
            arrays[key] = np.concatenate(values)
    save_part(ctx.parts / f"{name}.npz", arrays)
    marker.close()
    return {"ignored": dict(ignored), "cpu_s": time.process_time() - cpu}


def measure_job(job: tuple[int, int]) -> dict:
    """Measures records a..b-1 into part `rows-<a>.npz`."""
    ctx, cpu = _worker["ctx"], time.process_time()
    if "records" not in _worker:
        _worker["records"] = staged_records(ctx)
        _worker["pre"] = Preprocessor(ctx.params)
    records, pre = _worker["records"], _worker["pre"]
    a, b = job
    marker, rows, rejects = Marker(ctx.parts / f"rows-{a:012d}.at"), [], []
    for k in range(a, b):
        marker.set(k)
        r = measure(records, pre, k, ctx.decode)
        (rows if r.pop("ok") else rejects).append(r)
    marker.set(-2)
    write_rows_part(ctx.parts, a, rows, rejects)
    marker.close()
    return {"records": b - a, "cpu_s": time.process_time() - cpu}


def write_rows_part(parts: Path, a: int, rows: list[dict], rejects: list[dict]) -> None:
    """A measure part: rows, rejects, and the rejects' count and first example by reason."""
    reasons = Counter(r["reason"] for r in rejects)
    examples: dict[str, dict] = {}
    for r in rejects:  # (an id cut to a line: the summary quotes it, the log keeps it whole)
        examples.setdefault(
            r["reason"], {**{k: r.get(k) for k in ("detail", "where")}, "id": shown_id(r["id"])}
        )
    meta = json.dumps({"reasons": reasons, "examples": examples}).encode()
    arrays = {**row_part(rows), **reject_part(rejects), "meta": np.frombuffer(meta, np.uint8)}
    save_part(parts / f"rows-{a:012d}.npz", arrays)


# ----------------------------------------------------------------------------- the build


def run_jobs(pool, fn, jobs: list[tuple[int, int]], name: str, on_done, on_died) -> None:
    """Runs `jobs` on `pool` until each is done; a job whose process died goes to `on_died`
    (which returns the jobs to run instead); one that raised stops the build."""
    for job in jobs:
        pool.submit(job, fn, job)
    pending = len(jobs)
    while pending:
        for out in pool.wait():
            pending -= 1
            if out.died is not None:
                again = on_died(out.key, out.died)
                for job in again:
                    pool.submit(job, fn, job)
                pending += len(again)
            elif out.error is not None:
                if out.config_error:
                    raise ConfigError(out.error)
                raise RuntimeError(f"the index's {name} job {out.key} failed: {out.error}")
            else:
                on_done(out.key, out.value)


def scan_files(pool, ctx: BuildContext, stats: dict) -> dict[str, int]:
    """The scan stage: parts per group of files, merged into the staged `files.*`, `scan.*`
    columns; returns the .tar members left out, by extension (`stats`: the jobs' CPU time)."""
    n = len(ctx.files)
    step = max(1, min(FILES_A_SCAN, n // 256))
    jobs = [(a, min(n, a + step)) for a in range(0, n, step)]
    ignored: Counter[str] = Counter()

    def died(job, how: str) -> list:
        f = read_marker(ctx.parts / f"scan-{job[0]:09d}.at")
        if not 0 <= f < n:
            raise ConfigError(died_outside(how))
        raise ConfigError(f"{ctx.files[f]}: the index's worker died scanning it ({how}); check it")

    def finished(job, value) -> None:
        ignored.update(value["ignored"])
        stats["jobs_cpu_s"] = stats.get("jobs_cpu_s", 0.0) + value["cpu_s"]

    run_jobs(pool, scan_job, jobs, "scan", finished, died)
    merge_scans(ctx, [ctx.parts / f"scan-{a:09d}.npz" for a, _ in jobs])
    return dict(sorted(ignored.items()))


def merge_scans(ctx: BuildContext, paths: list[Path]) -> None:
    """Streams the scan parts into the staging folder's columns: `scan.<key>` and its
    `.ptr` (file f's values at [ptr[f]:ptr[f + 1]]), `files.path`, `files.size`,
    `files.records` (each file's first record); and `scan.json`, their table."""
    folder = Path(ctx.token)
    with np.load(paths[0]) as part:
        names = set(part.files)
    keys = sorted({k.removesuffix(".count") for k in names if k.endswith(".count")} - {"records"})
    specs = [("ragged", f"scan.{k}", f"{k}.count", f"scan.{k}", k) for k in keys]
    table = stream(folder, paths, [*specs, ("plain", "files.count", "records")])
    counts = np.load(folder / "files.count.npy")
    (folder / "files.count.npy").unlink()
    del table["files.count.npy"]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    files = Strings.of(str(Path(f).absolute()) for f in ctx.files)
    sizes = np.asarray([Path(f).stat().st_size for f in ctx.files], np.int64)
    for name, value in (("files.records", starts), ("files.path", files), ("files.size", sizes)):
        table.update(save(folder, name, value))
    (folder / "scan.json").write_text(json.dumps({"columns": table, "keys": keys}))


def shard_size(records: int, workers: int) -> int:
    """Records a measure job reads: about 16 jobs a worker, 16..4096 records each."""
    return int(np.clip(-(-records // max(1, 16 * workers)), 16, 4096))


def measure_records(
    pool, ctx: BuildContext, records: int, workers: int, bar, stats: dict
) -> list[int]:
    """The measure stage; returns the first record of each part, in order (`stats`: the
    jobs' CPU time)."""
    step = shard_size(records, workers)
    jobs = [(a, min(records, a + step)) for a in range(0, records, step)]
    done: list[int] = []
    crashed: list[str] = []
    opened: list[Records] = []

    def finished(job, value) -> None:
        done.append(job[0])
        bar.update(job[1] - job[0])
        stats["jobs_cpu_s"] = stats.get("jobs_cpu_s", 0.0) + value["cpu_s"]

    def died(job, how: str) -> list:
        """A job whose process died: the record it was reading is a reject naming it (not
        tried again: a death on a record is not understood until someone looks at it, and
        the reject says where), the rest of its records go on in fresh processes. A death
        outside any record stops the build, saying where."""
        a, b = job
        k = read_marker(ctx.parts / f"rows-{a:012d}.at")
        if k == -2:
            raise ConfigError(
                f"a worker process of the index died writing its part of records {a}..{b - 1} "
                f"to {ctx.parts} ({how}): look at that folder's filesystem (full, or its "
                "quota) and the machine's memory, then index again"
            )
        if not a <= k < b:  # (before its first record)
            raise ConfigError(died_outside(how))
        if not opened:
            opened.append(staged_records(ctx))
        write_rows_part(ctx.parts, k, [], [crash_reject(opened[0], k, how)])
        crashed.append(f"{opened[0].where(k)} ({how})")
        done.append(k)
        bar.update(1)
        if len(crashed) > MAX_CRASHED:
            raise ConfigError(
                f"the index's workers died on {len(crashed)} records (e.g. "
                f"{'; '.join(crashed[:3])}): more than {MAX_CRASHED}; look for what they "
                "share (very long turns, huge media) and give the build more memory or "
                "leave them out"
            )
        return [j for j in ((a, k), (k + 1, b)) if j[0] < j[1]]

    run_jobs(pool, measure_job, jobs, "measure", finished, died)
    if not records:  # (the merge's columns come from the parts: an empty one)
        write_rows_part(ctx.parts, 0, [], [])
        done.append(0)
    return sorted(done)


def died_outside(how: str) -> str:
    return (
        f"a worker process of the index died outside any record ({how}). A script that "
        "builds an index with workers must keep its top-level code under `if __name__ == "
        '"__main__":` (workers start by spawn, which runs the main script again in each); '
        "--workers 0 builds it in the calling process"
    )


def crash_reject(records: Records, k: int, how: str) -> dict:
    """The reject of record k, on which a worker process died."""
    where = records.where(k)
    err = RecordError(
        "record_crashed",
        f"the index's worker process died reading it ({how.split(':')[0]}); the build went on "
        "without it. A record that takes more memory than the machine has (a very long text "
        "turn, a huge media file) does this",
        records.fallback_id(k),
    )
    return err.to_json(line=0, row=k, where=where)


def merge_measured(folder: Path, starts: list[int]) -> tuple[dict, Counter, dict, int]:
    """Merges the measure parts (first records `starts`) into the columns and rejects.jsonl,
    a part at a time; returns (column table, reject counts by reason, an example of each,
    the accepted rows that are preference pairs)."""
    paths = [folder / "parts" / f"rows-{a:012d}.npz" for a in starts]
    drop = duplicates(paths)
    pairs = 0
    for path, dup in zip(paths, drop, strict=True):
        with np.load(path) as part:
            pairs += int((part["documents"][~dup] == 2).sum())
    # (pairs: where each splits into its documents, a column; none: no column, as before it)
    table = stream(folder, paths, row_specs(pairs > 0), [~d for d in drop])
    reasons: Counter[str] = Counter()
    examples: dict[str, dict] = {}
    with open(folder / "rejects.jsonl", "w") as out:
        for path, dup in zip(paths, drop, strict=True):
            with np.load(path) as part:
                lines = strings(part, "rejects").tolist()
                rows = part["rejects.row"].tolist()
                for j in np.flatnonzero(dup).tolist():
                    entry = duplicate_reject(part, j)
                    lines.append(json.dumps(entry))
                    rows.append(entry["row"])
                    where = f"record {entry['row']}"  # (a part keeps no file names)
                    example = {
                        "id": shown_id(entry["id"]),
                        "detail": entry["detail"],
                        "where": where,
                    }
                    examples.setdefault("duplicate_id", example)
                    reasons["duplicate_id"] += 1
                for j in np.argsort(rows, kind="stable").tolist():
                    out.write(lines[j] + "\n")
                meta = json.loads(part["meta"].tobytes())
            reasons.update(meta["reasons"])
            for reason, ex in meta["examples"].items():
                examples.setdefault(reason, ex)
    return table, reasons, examples, pairs


def duplicate_reject(part, j: int) -> dict:
    rid = strings(part, "id")[j]
    err = RecordError("duplicate_id", "seen on an earlier line", rid)
    return {**err.to_json(), "line": int(part["line"][j]), "row": int(part["row"][j])}


def context(
    fmt: str,
    files: list[Path],
    paths: MediaPaths,
    cfg,
    staged: Path,
    decode: bool,
    processes: int = 1,
) -> BuildContext:
    """The build's context for data files `files` of data.format `fmt`, read by `processes`
    side by side (the memory budget's share: `jaxmllm.data.budget`)."""
    memory = budget.resolve(cfg.data.worker_memory, processes)
    return BuildContext(
        token=str(staged),
        files=tuple(str(f) for f in files),
        fmt=fmt,
        paths=paths,
        data=cfg.data,
        params=dataclasses.replace(Params.from_config(cfg), worker_memory=memory),
        decode=decode,
    )
