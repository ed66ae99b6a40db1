"""The lengths index of a data set: one offline pass, then training plans from it.

    python -m jaxmllm.data.index --config configs/manifest_example.yaml

reads every record of every data set the config names (data.path, or each of data.sources, and
a held-out data.eval.path) once,
in whatever format it is stored (data.format; `auto` says what it detected and why), media sizes
from file headers (PIL reads the size without decoding, soundfile the duration), in parallel,
and writes to each data set's index folder (data.index_dir, default `<path>.index/<key>`, the key
naming the tokenizer and the preprocessing settings, so configs that differ keep their own)
columns every training host maps without parsing (`jaxmllm.data.stored` lists them):

- per accepted record, its counts in model units (text tokens; per encoder phase its items'
  patches or frames: a video's temporal patches are vision items, in placeholder order), where
  it is (id, record number, line) and its media sizes from their headers (image height and
  width, a clip's samples and rate, a video's frames, rate, height and width), which let the
  oversize policy repair a sample at start-up without touching the media;
- the data files (path, size, first record) and what scanning them found (line offsets, .tar
  member offsets), so training does not scan them again;
- `summary.json`: counts, per-modality percentiles, the format, the preprocessing parameters
  the counts depend on (training checks them), rejects by reason with an example of each,
  how many rows are preference pairs (`pairs`: training checks them against
  train.objective), and every column file's dtype and shape (training checks each file);
- `rejects.jsonl`: every rejected record with its id, place and reason.

The build is a map over shards of the files and a merge (`jaxmllm.data.index_build`): in local
worker processes (--workers), or as Ray tasks with --ray [ADDRESS] (data.index_ray; `pip
install -e '.[ray]'`), the same bytes either way. It writes into a staging folder beside the
index and renames it into place once whole: a build killed at any point leaves the previous
index or none, never half of one. A record on which a worker process dies (killed for memory,
an abort in the tokenizer) is a `record_crashed` reject and the build goes on.

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
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from jaxmllm.config import Config, ConfigError, load_config, printable
from jaxmllm.config.command import add_config_args
from jaxmllm.config.phases import ENCODERS
from jaxmllm.config.sections import files_format
from jaxmllm.data.columnar import publish, remove_stale, staging
from jaxmllm.data.datasets import (
    DataSet,
    acceptance_problem,
    check_index_dirs,
    check_objective,
    check_videos,
    data_sets,
    eval_set,
    index_dir,
    stem,
)
from jaxmllm.data.index_build import (
    check_encoders,
    close_worker,
    context,
    init_worker,
    measure,
    measure_records,
    merge_measured,
    scan_files,
)
from jaxmllm.data.preprocess import Params
from jaxmllm.data.records import media_paths
from jaxmllm.data.records.formats import FORMATS, data_files, detect, holds_pairs
from jaxmllm.data.rejects import example_lines, media_hint
from jaxmllm.data.shards import InProcess, LocalProcesses, RayTasks
from jaxmllm.data.stored import FORMAT, StoredIndex

__all__ = ["build_index", "check_encoders", "index_data_set", "main", "measure"]

# ----------------------------------------------------------------------------- building


def build_index(
    cfg: Config,
    path: str | Path | None = None,
    out: str | Path | None = None,
    *,
    workers: int = 0,
    decode: bool = False,
    progress: bool = True,
    ray: str = "",
    stats: dict | None = None,
) -> dict:
    """Indexes one data set: `path` (in data.format, media under data.media_root), else the
    config's only one; into `out`, else its index folder. Returns the summary."""
    ds = data_set(cfg, path)
    if out is not None:
        ds = dataclasses.replace(ds, index_dir=str(out))
    return index_data_set(
        cfg, ds, workers=workers, decode=decode, progress=progress, ray=ray, stats=stats
    )


def data_set(cfg: Config, path: str | Path | None) -> DataSet:
    """The config's data set at `path` (one of data.sources, or data.path's settings for
    another file: a config that names no data gives its defaults); without `path`, its only
    one."""
    sets = data_sets(cfg) if path is None or cfg.data.source != "none" else []
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
    cfg: Config,
    ds: DataSet,
    *,
    workers: int = 0,
    decode: bool = False,
    progress: bool = True,
    ray: str = "",
    stats: dict | None = None,
) -> dict:
    """Indexes data set `ds` into its index folder; returns the summary. `workers` local
    processes (0: this one), or Ray tasks on the cluster at `ray` (`auto`: a running one, else
    a local one; default data.index_ray). `stats` gets the build's figures (seconds of each
    stage, the jobs' CPU time: never in the index, which is the same bytes however built)."""
    params = Params.from_config(cfg)
    files = data_files(ds.path)
    fmt, why = detect(files) if ds.format == "auto" else (ds.format, "")
    pairs = holds_pairs(files, fmt)  # (by the first record: a mismatch stops before the build)
    if pairs is not None:
        check_objective(cfg, ds, int(pairs), 1)
    out = index_dir(ds, params.counted())
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    staged = staging(out)
    (staged / "parts").mkdir()
    paths = media_paths(ds.path, files, ds.media_root, cfg.data, ds.confine)
    ray = ray or cfg.data.index_ray
    processes = (os.cpu_count() or 1) if ray else max(1, workers)  # (Ray: a task a core)
    ctx = context(fmt, files, paths, cfg, staged, decode, processes)
    pool, workers = make_pool(ctx, workers, ray)
    stats = {} if stats is None else stats
    try:
        merged, ignored = run_build(pool, ctx, ds.name, workers, progress, stats)
        started = time.perf_counter()
        summary = write_summary(
            cfg, ds, staged, merged, ignored, (files, fmt, why, paths.base), out
        )
        publish(staged, out)
        stats["merge_s"] += time.perf_counter() - started
    except BaseException:
        pool.close()
        shutil.rmtree(staged, ignore_errors=True)
        raise
    finally:
        close_worker()  # (the files jobs run in this process opened)
    return summary


def make_pool(ctx, workers: int, ray: str):
    """(Where the build's jobs run, how many run at once): Ray tasks on the cluster at `ray`,
    else `workers` local processes, else this process."""
    if ray:
        pool = RayTasks(ray, init_worker, ctx)
        return pool, pool.cores()
    if workers:
        return LocalProcesses(workers, init_worker, ctx), workers
    return InProcess(init_worker, ctx), 0


def run_build(pool, ctx, name: str, workers: int, progress: bool, stats: dict) -> tuple:
    """The build's map and merge into its staging folder: ((records, column table, rejects by
    reason, an example of each), the .tar members left out)."""
    from tqdm import tqdm

    staged, started = Path(ctx.token), time.perf_counter()
    ignored = scan_files(pool, ctx, stats)
    records = int(np.load(staged / "files.records.npy")[-1])
    stats["scan_s"], started = time.perf_counter() - started, time.perf_counter()
    bar = tqdm(total=records, desc=f"index {printable(name)}", unit="rec", disable=not progress)
    starts = measure_records(pool, ctx, records, workers, bar, stats)
    bar.close()
    pool.close()
    stats["measure_s"], started = time.perf_counter() - started, time.perf_counter()
    table, reasons, examples, pairs = merge_measured(staged, starts)
    stats["merge_s"] = time.perf_counter() - started
    return (records, table, reasons, examples, pairs), ignored


def write_summary(cfg: Config, ds: DataSet, staged: Path, merged, ignored, found, out) -> dict:
    """Writes the staging folder's summary.json (its last file), clearing the build's own
    files; returns it. `found`: (the data files, their format, why `auto` chose it, the folder
    relative media paths start from)."""
    records, table, reasons, examples, pairs = merged
    files, fmt, why, base = found
    scan = json.loads((staged / "scan.json").read_text())
    table = dict(sorted({**table, **scan["columns"]}.items()))
    stored = StoredIndex(staged, {"accepted": table["text.npy"][1][0], "columns": table})
    summary = {"index_format": FORMAT, **summarize(cfg, stored, records, reasons, examples)}
    summary.update(
        data=str(ds.path),
        format=fmt,
        detected=why,
        file_count=len(files),
        params=Params.from_config(cfg).counted(),
        ignored_members=ignored,
        index=str(out),
        scan_keys=scan["keys"],
        columns=table,
        pairs=pairs,  # (accepted rows that are preference pairs: `datasets.check_objective`)
    )
    if acceptance_problem(summary, cfg.data.min_accept):
        summary["format_hint"] = format_hint(files, fmt)
        summary["media_hint"] = media_hint(summary, base)
    del stored
    shutil.rmtree(staged / "parts")
    (staged / "scan.json").unlink()
    (staged / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def format_hint(files: list[Path], fmt: str) -> str:
    """Where the records look like another format than the one read, the data.format to use."""
    try:
        found, why = detect(files)
    except ConfigError:
        return ""
    if found == fmt:
        return ""
    return (
        f"The files look like {FORMATS[found].what} ({why}): set data.format: {found} "
        "(or auto) and index again"
    )


def summarize(
    cfg: Config, stored: StoredIndex, records: int, reasons: Counter, examples: dict
) -> dict:
    """Counts and percentiles per modality (training sizes its buckets from the index itself:
    `batch.capacity: auto`); rejects by reason, most first, with an example of each."""
    index = stored.lengths()
    per_token = {p.name: p.per_token(cfg.model) for p in ENCODERS}
    llm = index.llm_tokens(per_token)
    stats = {"text_tokens": index.text, "llm_tokens": llm}
    if index.split is not None:  # (preference pairs: each of their two documents)
        stats["llm_tokens_per_document"] = index.llm_documents(per_token)
    for p in ENCODERS:
        stats[f"{p.unit}_per_{p.item}"] = index.items[p.name].sizes
        stats[f"{p.items}_per_sample"] = index.items[p.name].count()
        stats[f"{p.unit}_per_sample"] = index.items[p.name].per_sample()
    ptr, videos = stored.sizes["video"]
    if len(videos):  # (their temporal patches are among the vision items above)
        stats["videos_per_sample"] = np.diff(ptr)
        stats["frames_per_video"] = videos[:, 0].astype(np.int64)
    rejected = sum(reasons.values())
    order = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    return {
        "records": records,
        "accepted": len(index),
        "rejected": rejected,
        "rejects": dict(order),
        "examples": {reason: examples[reason] for reason, _ in order},
        "videos": len(videos),
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
        printable(f"{summary['data']}: {summary['format']} ({how})"),
        f"  {summary['records']} records: {summary['accepted']} accepted, "
        f"{summary['rejected']} rejected",
    ]
    if summary["rejects"]:
        lines.append("  rejected, by reason (one example each):")
        for reason, n in summary["rejects"].items():
            ex = summary["examples"].get(reason, {})
            example = printable(f"{ex.get('id')} ({ex.get('where')}): {ex.get('detail')}")
            lines += example_lines(reason, n, example)  # (whole)
    if summary.get("ignored_members"):
        left = ", ".join(f".{printable(k)} ({v})" for k, v in summary["ignored_members"].items())
        lines.append(f"  left out of the shards (not a record, caption or known media): {left}")
    lines.append(f"  wrote {summary['index']}/: columns (.npy), summary.json, rejects.jsonl")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.data.index",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(
        p,
        required=False,
        config_help="the training config (data, tokenizer, patch size, budgets); without it, "
        "--manifest is indexed with the defaults and --set",
    )
    p.add_argument(
        "--manifest",
        help="index this data file (directory, glob) instead of the "
        "config's data (data.path's settings apply)",
    )
    p.add_argument("--out", help="index folder (with --manifest; default: its keyed folder)")
    p.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="local worker processes (0: in this process)",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        default="",
        metavar="ADDRESS",
        help="run the shards as Ray tasks: on the cluster at ADDRESS, or (no "
        "ADDRESS, `auto`) the one `ray start` started here, else a local one "
        "(default: data.index_ray)",
    )
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
            raise ConfigError(
                "the config reads the built-in synthetic data (data.source): give "
                "data.path or data.sources, or --manifest"
            )
        else:
            sets = data_sets(cfg) + [e for e in [eval_set(cfg)] if e is not None]
        check_index_dirs(cfg, sets)
        for ds in sets:
            summary = index_data_set(
                cfg, ds, workers=args.workers, decode=args.decode, ray=args.ray
            )
            print("\n".join(report(summary)))
            if args.config:  # (what training would refuse, said now: the index's sizes too)
                check_videos(cfg, summary["videos"], ds.path)
            problem = acceptance_problem(summary, cfg.data.min_accept)
            if problem:
                failed.append(f"{ds.path}: {problem}")
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {printable(e, keep_lines=True)}", file=sys.stderr)
        return 2
    for message in failed:
        print(f"error: {printable(message)}", file=sys.stderr)
    if failed:
        return 1
    print("bucket sizes: batch.capacity: auto sizes the encoder buckets from it at start-up")
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
