"""The index build's rate: records a second (and a second per core) in local processes and as
Ray tasks, side by side on one manifest; then a training host's start-up on the index.

    python -m jaxmllm.bench.indexing --media 2000 [--workers 0,1,2] [--ray 2] [--json OUT]
    python -m jaxmllm.bench.indexing --text-image 1000000 --workers 2 [--keep DIR]

`--media N` writes N records of real media (`bench.host.write_media`: 300-1500 px JPEG / PNG
images, 3-20 s WAV / FLAC clips, text; with `--keep DIR` once, then reused) and builds its
index with each `--workers` count (0: in this process) and, with `--ray CPUS`, on a local Ray
cluster of that many CPUs (started here; its start is not timed). `--text-image N` writes N
records, half of them one image drawn from 200 files of 300-1500 px (one an image record below
400 records), the rest text: the build at scale. Each build writes the same index (compared
byte for byte: `same`). `open` is then a fresh process's `open_source` of it (the index mapped
and checked, data.on_oversize applied) with its peak resident memory. A build's time includes
starting its workers (and is split into scan, measure and merge); `jobs CPU s` is the CPU time
its scan and measure jobs took, wherever they ran, and `rec a CPU second` the records over it:
a rate a core that the other jobs of a shared machine do not skew.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxmllm.bench.host import write_media, write_photo
from jaxmllm.config import load_config

SETTINGS = ["data.source=jsonl", "data.eval.source=none", "data.image_max_pixels=65536"]


def write_text_image(folder: Path, records: int, seed: int = 0) -> Path:
    """`records` records, every other one with one of 200 images (fewer for fewer than 400
    records: one an image record; a photo takes ~0.1 s to write), the rest text."""
    rng = np.random.default_rng(seed)
    (folder / "media").mkdir(parents=True, exist_ok=True)
    photos = max(1, min(200, records // 2))
    for k in range(photos):
        write_photo(folder / "media" / f"img{k}.jpg", rng)
    words = [f"w{i}" for i in range(1000)]
    path = folder / "manifest.jsonl"
    with open(path, "w") as f:
        for k in range(records):
            text = " ".join(rng.choice(words, int(rng.integers(3, 60))))
            if k % 2:
                image = f"media/img{int(rng.integers(photos))}.jpg"
                rec = {"id": f"r{k}", "text": "<image>" + text, "images": [image]}
            else:
                rec = {"id": f"r{k}", "text": text}
            f.write(json.dumps(rec) + "\n")
    return path


def repeated(manifest: Path, times: int) -> Path:
    """`manifest`'s records `times` over, the k-th copy's ids suffixed `.k`."""
    out = manifest.with_name(f"{manifest.stem}-x{times}.jsonl")
    lines = manifest.read_text().splitlines()
    with open(out, "w") as f:
        for k in range(times):
            for line in lines:
                rec = json.loads(line)
                f.write(json.dumps({**rec, "id": f"{rec['id']}.{k}"}) + "\n")
    return out


def build(manifest: Path, out: Path, workers: int, ray: str) -> tuple[float, dict]:
    """Seconds to build the index of `manifest` into `out`, and the build's figures."""
    from jaxmllm.data.index import build_index

    cfg = load_config("configs/tiny.yaml", [*SETTINGS, f"data.path={manifest}"])
    started, stats = time.perf_counter(), {}
    build_index(cfg, manifest, out, workers=workers, progress=False, ray=ray, stats=stats)
    return time.perf_counter() - started, stats


def digest(folder: Path) -> str:
    """A short sha256 of an index folder's files (names and bytes): builds with different worker
    counts must give the same index."""
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


def open_in_child(manifest: Path, out: Path, row_len: int) -> dict:
    """A fresh process's open_source of the index (LLM rows of `row_len` tokens): seconds,
    peak resident memory, samples repaired or dropped by data.on_oversize."""
    sets = [*SETTINGS, f"data.path={manifest}", f"data.index_dir={out}"]
    sets.append(f"batch.llm_row_len={row_len}")
    code = f"""
import json, resource, time
t0 = time.perf_counter()
from jaxmllm.config import load_config
from jaxmllm.data.source import open_source
cfg = load_config("configs/tiny.yaml", {sets!r})
t1 = time.perf_counter()
source = open_source(cfg)
t2 = time.perf_counter()
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
over = len(source.startup_rejects)
print(json.dumps({{"import_s": t1 - t0, "open_s": t2 - t1, "peak_mb": rss, "over": over}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxmllm.bench.indexing`: builds the index of a synthetic manifest (--media or
    --text-image records) with each --workers count (and on a local Ray), prints the seconds and
    records a second per build, and checks every build wrote the same index."""
    ap = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.indexing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    data = ap.add_mutually_exclusive_group(required=True)
    data.add_argument("--media", type=int, help="records of real media (images, clips, text)")
    data.add_argument("--text-image", type=int, help="records, half with an image")
    ap.add_argument("--workers", default="0,1,2", help="local worker counts, comma list")
    ap.add_argument("--ray", type=int, default=0, help="also on a local Ray of this many CPUs")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="each record this many times, each with its own id (the same media "
        "files: more records without writing more media)",
    )
    ap.add_argument("--keep", help="write the data here (kept) instead of a temporary folder")
    ap.add_argument(
        "--row-len",
        type=int,
        default=8192,
        help="batch.llm_row_len of the open (a sample over it is repaired at start-up "
        "by data.on_oversize: a record read each)",
    )
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    counts = args.workers.split(",")
    if not all(w.strip().isdigit() for w in counts):
        ap.error(f"--workers {args.workers}: a comma list of worker counts (0: in this process)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        started = time.perf_counter()
        manifest, n = folder / "manifest.jsonl", args.media or args.text_image
        if not manifest.exists():  # (--keep: written once)
            write = write_media if args.media else write_text_image
            write(folder, n)
            print(f"{manifest}: {n} records written in {time.perf_counter() - started:.0f} s")
        if args.repeat > 1:
            manifest, n = repeated(manifest, args.repeat), n * args.repeat
        runs = [("local", int(w), "") for w in counts]
        if args.ray:
            runs.append(("ray", args.ray, "auto"))
        rows = []
        for kind, workers, ray in runs:
            if ray:
                import ray as ray_module

                ray_module.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
            out = folder / f"index-{manifest.stem}"  # (one folder: the summary names it)
            seconds, stats = build(manifest, out, workers, ray)
            if ray:
                ray_module.shutdown()
            rate, cpu = n / seconds, stats["jobs_cpu_s"]
            row = {"backend": kind, "workers": workers, "records": n, "s": seconds, **stats}
            row.update(rec_per_s=rate, rec_per_cpu_s=n / cpu, digest=digest(out))
            rows.append(row)
            stages = f"scan {stats['scan_s']:.1f} + measure {stats['measure_s']:.1f} + merge "
            print(
                f"{kind:<6}{workers:>3} workers: {seconds:7.1f} s ({stages}"
                f"{stats['merge_s']:.1f})  {rate:6.0f} rec/s  jobs {cpu:6.1f} CPU s: "
                f"{n / cpu:5.0f} rec a CPU second",
                flush=True,
            )
        same = len({r["digest"] for r in rows}) == 1
        print(f"the same index every way: {same}")
        opened = open_in_child(manifest, folder / f"index-{manifest.stem}", args.row_len)
        took = f"{opened['open_s']:.2f} s (+{opened['import_s']:.2f} s imports)"
        print(
            f"open_source: {took}, peak resident memory {opened['peak_mb']:.0f} MB, "
            f"{opened['over']} samples over batch.llm_row_len={args.row_len}"
        )
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "same": same, "open": opened}))
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
