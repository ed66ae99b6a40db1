"""The frame cache of a data set's videos: decode each video once, train from the frames.

    python -m jaxmllm.data.index --config X     # first: the lengths index
    python -m jaxmllm.data.frames --config X    # then: the frames it samples, decoded once

decodes every video of every indexed record at the frames and size the config's video rule
samples (`data.video_*`, the vision tower's patches; a row that data.on_oversize repairs at its
repaired budget, as training loads it) and stores them losslessly (uint8) in shards under the
index folder (`<index folder>/frames/`, `jaxmllm.data.frame_store`), so the cache shares the
index's preprocessing key: other sampling or resolution settings are another folder, built
again. Training reads it with `data.frame_cache: true`; a video the cache lacks, or whose entry
is stale or damaged, is decoded instead and counted (frames/ metrics).

The build is a map over shards (each a fixed run of the index's rows, written by one worker
process) and a merge of their side files into `frames.json`; a shard already built whose side
file, size and checksums agree with the plan is kept, so an interrupted build resumes and a
truncated or changed shard is built again. A video that fails to decode is a counted reject
(by reason, as at index time), printed with an example; its record decodes (and is rejected)
at load time as without the cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
from pathlib import Path

import numpy as np

from jaxmllm.config import Config, ConfigError, load_config
from jaxmllm.config.command import add_config_args
from jaxmllm.data.datasets import DataSet, data_sets, eval_set, index_dir
from jaxmllm.data.frame_store import ShardWriter, merge, shard_name, source_size, verify_shard
from jaxmllm.data.media.container import set_decode_threads, share_of_cores
from jaxmllm.data.media.video import (
    VideoCaps,
    VideoInfo,
    patches_of,
    sampled_frames_of,
    video_parts,
)
from jaxmllm.data.preprocess import Limits, Params
from jaxmllm.data.records import read_record
from jaxmllm.data.rejects import RecordError, example_lines, failed
from jaxmllm.data.source import open_data_set
from jaxmllm.data.text.tokenizer import config_tokenizer

ROWS_PER_SHARD = 64  # index rows a shard covers (its videos'; a worker's unit of work)

_worker: dict = {}


def build_frames(
    cfg: Config, ds: DataSet, *, workers: int = 0, rows_per_shard: int = ROWS_PER_SHARD
) -> dict:
    """Builds (or completes) data set `ds`'s frame cache; returns its manifest without the
    entries."""
    tokenizer = config_tokenizer(cfg)
    decoding = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, frame_cache=False))
    source = open_data_set(decoding, ds, tokenizer)  # (index checked; oversize repairs made)
    out = index_dir(ds, Params.from_config(cfg).counted()) / "frames"
    out.mkdir(parents=True, exist_ok=True)
    with_video = _with_video(source)
    plans = [with_video[a : a + rows_per_shard] for a in range(0, len(with_video), rows_per_shard)]
    jobs = list(enumerate(plans))
    if workers > 0 and len(jobs) > 1:
        ctx = multiprocessing.get_context("spawn")  # safe even if JAX threads are running
        n = min(workers, len(jobs))
        with ctx.Pool(n, _init_worker, (source, out, share_of_cores(n))) as pool:
            sides = list(pool.imap(_build_shard, jobs))
    else:
        _init_worker(source, out)
        sides = [_build_shard(job) for job in jobs]
    keep = {shard_name(k) for k in range(len(jobs))}
    for path in out.glob("frames-*"):  # (shards of an earlier, larger build)
        if path.name.split(".")[0] not in keep:
            path.unlink()
    manifest = merge(out, sides, Params.from_config(cfg).counted())
    manifest.pop("entries")
    return {
        **manifest,
        "folder": str(out),
        "rebuilt": sum(s["built"] for s in sides),
        "shards_total": len(sides),
    }


def _init_worker(source, out: Path, threads: int = 0) -> None:
    _worker.update(source=source, out=out)
    set_decode_threads(threads)  # (0 in this process: every core)


def _build_shard(job: tuple[int, list[int]]) -> dict:
    """One shard of the map: its rows' videos decoded into `frames-k.bin`, its side file
    written after it; kept as it is when a build already made it and it checks out."""
    k, rows = job
    source, out = _worker["source"], _worker["out"]
    plan = [_plan(source, i) for i in rows]
    side_path = out / f"{shard_name(k)}.json"
    if side_path.is_file():
        try:
            side = json.loads(side_path.read_text())
            if side.get("plan") == plan and verify_shard(out, side):
                return {**side, "built": False}
        except (ValueError, KeyError, OSError):
            pass  # (an unreadable side file: built again)
    side_path.unlink(missing_ok=True)
    writer = ShardWriter(out, k)
    entries, rejects = [], []
    try:
        for i in rows:
            _add_row(source, i, writer, entries, rejects)
    except BaseException:
        writer.file.close()
        writer.tmp.unlink(missing_ok=True)
        raise
    side = {
        "name": shard_name(k),
        "bytes": writer.close(),
        "plan": plan,
        "entries": entries,
        "rejects": rejects,
    }
    tmp = side_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(side))
    os.replace(tmp, side_path)
    return {**side, "built": True}


def _plan(source, i: int) -> list:
    """What row i's videos will be in a shard: [record id, [(frames, rate, height, width) of
    each video], its limits, its videos' byte sizes] (a shard built for another plan, or
    before a video file changed, is built again)."""
    rid, k, videos = _row(source, i)
    limits = source.limits.get(i, Limits())
    try:
        record = read_record(source.records, k)
        sizes = [_size(src) for src in record.media["video"]]
    except Exception:  # noqa: BLE001  (the build rejects the record, counted)
        sizes = None
    return [rid, [list(v) for v in videos], [limits.max_pixels, limits.video_pixels], sizes]


def _row(source, i: int) -> tuple[str, int, list[tuple]]:
    """Sample i's record id, its record's number in the data, and its videos' sizes (frames,
    rate, height, width), from the mapped index."""
    j = source.stored_row(i)
    return (
        source.stored.ids[j],
        int(source.stored.row[j]),
        source.stored.media_sizes(j).media["video"],
    )


def _with_video(source) -> list[int]:
    """The samples with at least one video (from the index's columns, no row read)."""
    sizes = source.stored.sizes.get("video")
    if sizes is None:
        return []
    rows = np.arange(len(source)) if source.keep is None else np.asarray(source.keep)
    return np.flatnonzero(np.diff(np.asarray(sizes[0]))[rows] > 0).tolist()


def _size(src) -> int:
    try:
        return source_size(src)
    except OSError:
        return -1  # (missing: the build rejects it, naming it)


def _add_row(source, i: int, writer: ShardWriter, entries: list, rejects: list) -> None:
    rid, k, videos = _row(source, i)
    pre = source.pre
    rule = pre.video_rule(source.limits.get(i, Limits()))
    p = pre.p
    try:
        record = read_record(source.records, k)
    except RecordError as e:
        rejects.append({**e.to_json(), "video": None})
        return
    except Exception as e:  # noqa: BLE001  one record never stops the build
        rejects.append({**failed(e, rid).to_json(), "video": None})
        return
    for j, size in enumerate(videos):
        src, info = record.media["video"][j], VideoInfo.of(size)
        try:
            caps = VideoCaps(max_bytes=p.max_media_bytes)  # (the file: the index held the rest)
            frames = sampled_frames_of(src, info, rule, rid, None, caps)
            count, (gh, gw) = video_parts(info, rule)
            want = (count * rule.temporal_patch, gh * rule.patch, gw * rule.patch, 3)
            if frames.shape != want:  # (the decoder's contract: never stored otherwise)
                raise RecordError(
                    "changed_since_index",
                    f"video {j}: decoded {frames.shape}, the rule samples {want}",
                    rid,
                )
            at, sums = writer.add(patches_of(frames, rule))
            entries.append(
                [rid, j, writer.path.stem, at, *frames.shape[:3], source_size(src), sums]
            )
        except RecordError as e:
            rejects.append({**e.to_json(), "video": j})
        except Exception as e:  # noqa: BLE001
            rejects.append({**failed(e, rid).to_json(), "video": j})


def report(summary: dict) -> list[str]:
    gib = summary["bytes"] / 2**30
    lines = [
        f"frame cache {summary['folder']}/: {summary['videos']} videos, {summary['frames']} "
        f"frames, {gib:.2f} GiB in {summary['shards_total']} shards ({summary['rebuilt']} built "
        "now, the others kept)"
    ]
    if summary["rejects"]:
        lines.append(
            f"  rejected {sum(summary['rejects'].values())} videos (decoded, and "
            "rejected, at load time):"
        )
        for reason, n in summary["rejects"].items():
            ex = summary["examples"].get(reason, {})
            example = f"{ex.get('id')} (video {ex.get('video')}): {ex.get('detail')}"
            lines += example_lines(reason, n, example)  # (whole)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.data.frames",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p, config_help="the training config (its data and video rule)")
    p.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="decoding processes (each builds whole shards)",
    )
    p.add_argument("--rows-per-shard", type=int, default=ROWS_PER_SHARD)
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        if cfg.data.source == "synthetic":
            raise ConfigError(
                "the config reads the built-in synthetic data (data.source): give "
                "data.path or data.sources"
            )
        if args.rows_per_shard < 1:
            raise ConfigError("--rows-per-shard must be >= 1")
        for ds in data_sets(cfg) + [e for e in [eval_set(cfg)] if e is not None]:
            summary = build_frames(
                cfg, ds, workers=args.workers, rows_per_shard=args.rows_per_shard
            )
            print("\n".join(report(summary)))
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
