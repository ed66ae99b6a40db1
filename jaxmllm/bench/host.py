"""The host against the device: each step's feed work beside the device time the step needs.

    python -m jaxmllm.bench.host --config configs/small.yaml [--data synthetic,media,config]
        [--devices 8,64] [--workers 0,1,2] [--steps 6] [--warmup 2] [--device-tflops 400]
        [--devices-per-host 8] [--json OUT] [--set key=value ...]

Per step, the feed's time by stage on the host (`jaxmllm.feed.times.HostTimes`): planning,
loading this host's samples, bucketize, counting, the copy to the devices; `serial_s` is
everything but the loading (the part worker processes do not share), `overlapped_s` the same
with the copy on its own thread (as the feed runs it: the longer of the feed thread's share
and the copy), `wait_s` what a consumer that runs each step for `device_s` waits on the feed
(its threads run ahead, two steps prefetched and one copied, as in the trainer).

`device_s` is the step's device time: measured where a device runs it (a backend other than CPU,
or `--measure-device`: each local device's bucket of the warm-up steps alone on a one-device
program, the slowest per step, their median), else the analytic FLOPs of the slowest bucket per
microbatch at `--device-tflops` (400: an H100 at ~40% of its dense bf16 peak).
`workers_needed`: the worker processes one host needs for its loading to keep pace with the
devices, from the per-sample cost (a worker's seconds per sample: the wall time per sample,
times the worker count when there are workers, as if they ran in parallel) x samples per step
/ device_s.

The data (`--data`): `synthetic` (the built-in source), `media` (a JSONL manifest of real media
files the bench writes and indexes: 300-1500 px JPEG / PNG images, some records with two or
three, 3-20 s WAV / FLAC clips; `--media-dir` keeps it for the next run) and `config` (what the
config names, e.g. `--set data.source=jsonl --set data.path=...`).

Opening the source (the columnar index mapped and checked, data.on_oversize applied: the
trainer's start-up before its first plan) is timed with the peak resident memory so far, on
stderr and in the JSON (`source_open_s`, `source_open_peak_rss_mb`).

With more devices than `--devices-per-host`, the host is one of several: it plans the global
step and loads, bucketizes and copies only its own devices' share (positions 0..7 of 64).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import sharding
from jaxmllm.batch.counts import bucket_work
from jaxmllm.bench.data import write_audio
from jaxmllm.config import Config, MeshConfig, load_config
from jaxmllm.config.command import add_config_args
from jaxmllm.cost.flops import sliding_window
from jaxmllm.cost.model import CostModel
from jaxmllm.data.source import make_source
from jaxmllm.feed.iterator import make_pipeline
from jaxmllm.process.distributed import split_cpu
from jaxmllm.resolve.run import resolve_run

DATA = ("synthetic", "media", "config")


# ----------------------------------------------------------------------------- real media


def write_media(folder: str | Path, records: int = 240, seed: int = 0) -> Path:
    """Writes `records` records of real media and their manifest; returns its path.

    Half the records hold images (300-1500 px a side, JPEG or PNG; a fifth of them two or
    three), a quarter a 3-20 s clip (WAV or FLAC, 16 / 22.05 / 44.1 kHz, stereo at 44.1 kHz),
    the rest text.
    """
    folder = Path(folder)
    (folder / "media").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lines = []
    for k in range(records):
        u = rng.random()
        if u < 0.5:
            n = int(rng.integers(2, 4)) if rng.random() < 0.2 else 1
            paths = []
            for j in range(n):
                ext = "png" if rng.random() < 0.3 else "jpg"
                path = f"media/img{k}_{j}.{ext}"
                write_photo(folder / path, rng)
                paths.append(path)
            rec = {"id": f"img{k}", "images": paths, "text": "<image>" * n + _words(rng, 30)}
        elif u < 0.75:
            ext, fmt = ("flac", "FLAC") if rng.random() < 0.3 else ("wav", "WAV")
            path = f"media/clip{k}.{ext}"
            seconds = float(rng.uniform(3.0, 20.0))
            write_audio(folder / path, rng, "mid", fmt, seconds=seconds)
            rec = {"id": f"clip{k}", "audio": [path], "text": "<audio>" + _words(rng, 30)}
        else:
            rec = {"id": f"text{k}", "text": _words(rng, 400)}
        lines.append(json.dumps(rec))
    path = folder / "manifest.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_photo(path: Path, rng: np.random.Generator) -> None:
    """A photo-like image (smooth gradients, boxes, mild noise) of 300-1500 px a side."""
    from PIL import Image

    h, w = (int(v) for v in rng.integers(300, 1501, 2))
    y, x = np.ogrid[0:h, 0:w]
    base = rng.uniform(40, 200, 3) + rng.uniform(-60, 60, 3) * (y / h + x / w)[..., None] / 2
    img = base + rng.normal(0, 6, (h, w, 3))
    for _ in range(3):
        y0, x0 = int(rng.integers(0, h // 2)), int(rng.integers(0, w // 2))
        img[y0 : y0 + h // 3, x0 : x0 + w // 3] += rng.uniform(-80, 80, 3)
    options = {"quality": 90} if path.suffix == ".jpg" else {}
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(path, **options)


def _words(rng: np.random.Generator, most: int) -> str:
    """A few (3 to `most`) random words 'w123', as a synthetic record's text."""
    return " ".join(f"w{int(v)}" for v in rng.integers(0, 1000, int(rng.integers(3, most))))


def data_config(cfg: Config, data: str, folder: Path, records: int = 240) -> Config:
    """`cfg` reading `data`: the built-in source, a written media manifest (indexed), or as is."""
    from jaxmllm.data.datasets import data_sets, index_dir
    from jaxmllm.data.index import build_index
    from jaxmllm.data.preprocess import Params

    if data == "config":
        return cfg
    if data == "synthetic":
        built_in = dataclasses.replace(cfg.data, source="synthetic", path="", sources=())
        return dataclasses.replace(cfg, data=built_in)
    manifest = folder / "manifest.jsonl"
    if not manifest.exists():
        write_media(folder, records)
    d = dataclasses.replace(cfg.data, source="jsonl", path=str(manifest), index_dir="")
    cfg = dataclasses.replace(cfg, data=d)
    out = index_dir(data_sets(cfg)[0], Params.from_config(cfg).counted())
    if not (out / "summary.json").exists():
        build_index(cfg, manifest, progress=False)  # (its folder keyed by the settings)
    return cfg


# ----------------------------------------------------------------------------- device time


def flops_seconds(cfg: Config, batch: dict[str, np.ndarray], tflops: float) -> float:
    """The step's analytic device time: per microbatch the FLOPs of its costliest bucket (the
    devices wait for it at the microbatch's collectives), summed, at `tflops` TFLOP/s."""
    cost = CostModel.from_model(cfg.model)
    work = bucket_work(batch, cfg.mesh.context, sliding_window(cfg.model.llm))
    per_bucket = cost.phases_cost(work)  # (a decoder's sliding-window layers: by llm_wsq)
    return float(np.max(per_bucket, axis=1).sum()) / (tflops * 1e12)


class DeviceTimer:
    """Each bucket of a host batch alone on a one-device program; a step's time is the slowest
    (every device computes its whole fixed-shape bucket, and waits for the slowest)."""

    def __init__(self, cfg: Config):
        """The config's train step on one device (its compile deferred to the first call), with a
        fresh state, and the batch shapes of one bucket."""
        from jaxmllm.batch.bucketize import batch_shapes
        from jaxmllm.step.program import build_program

        self.mesh = sharding.make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
        with jax.set_mesh(self.mesh):
            prog = build_program(cfg, self.mesh)
            self.state, self.step = prog.init(), prog.step
        self.shapes = batch_shapes(cfg, 1)
        self.compiled = False

    def __call__(self, host: dict[str, np.ndarray]) -> float:
        """The device's step time for a host batch: each of its buckets run alone as a one-device
        step (the first call compiling, untimed), the slowest bucket's seconds: what a step of
        all of them in parallel takes."""
        from jaxmllm.bench.throughput import device_batch

        times = []
        with jax.set_mesh(self.mesh):
            for d in range(next(iter(host.values())).shape[1]):
                batch = sharding.make_global_batch(device_batch(host, d, self.shapes), self.mesh)
                if not self.compiled:  # (the first call compiles: not the step's time)
                    self.state, metrics = self.step(self.state, batch)
                    jax.block_until_ready(metrics)
                    self.compiled = True
                start = time.perf_counter()
                self.state, metrics = self.step(self.state, batch)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - start)
        return max(times)


# ----------------------------------------------------------------------------- measuring


@dataclasses.dataclass
class Setup:
    """What every row of one data source shares."""

    cfg: Config
    source: object
    index: object
    steps: int
    warmup: int
    per_host: int
    tflops: float
    measure: bool
    # One compiled one-device step per bucket shape, shared by the rows that plan to it (rows of
    # other worker counts plan the same buckets: a recipe's step compiles for minutes on a GPU)
    timers: dict = dataclasses.field(default_factory=dict)

    def timer(self, cfg: Config) -> DeviceTimer | None:
        """The device timer of `cfg`'s bucket shapes (built on first use), or None when the
        device time is analytic."""
        if not self.measure:
            return None
        from jaxmllm.batch.bucketize import batch_shapes

        key = repr(sorted(batch_shapes(cfg, 1).items()))
        if key not in self.timers:
            self.timers[key] = DeviceTimer(cfg)
        return self.timers[key]


def measure(setup: Setup, devices: int, workers: int) -> dict:
    """One row: the feed of `devices` buckets (this host's share) with `workers` processes,
    consumed by a step that takes the device time; medians over the measured steps."""
    cfg = dataclasses.replace(setup.cfg, data=dataclasses.replace(setup.cfg.data, workers=workers))
    run = resolve_run(cfg, devices, data=(setup.source, setup.index))
    cfg, local = run.cfg, min(devices, setup.per_host)
    if local < devices:  # (this host as one of several: it loads only its own positions')
        run = dataclasses.replace(run, positions=np.arange(local))
    mesh = local_mesh(local)
    timer = setup.timer(cfg)
    # Measured, the device runs the warm-up steps' batches (every device's bucket in turn, so
    # longer than a step); the measured steps then take their median, as the analytic ones do.
    timed = max(setup.warmup, 1) if timer is not None else 0
    device_s, measured = 0.0, []

    def to_device(host: dict[str, np.ndarray]) -> dict:
        """The host batch as global device arrays, waited for: the transfer's whole time."""
        return jax.block_until_ready(sharding.make_global_batch(host, mesh))

    feed = make_pipeline(run, to_device=to_device)
    rows = []
    try:
        for step in range(setup.warmup + setup.steps):
            start = time.perf_counter()
            element = next(feed)
            wait = time.perf_counter() - start
            host = element["info"].host
            if step < timed:
                measured.append(timer(jax.device_get(element["batch"])))
                device_s = statistics.median(measured)
            else:
                if timer is None:
                    device_s = flops_seconds(cfg, jax.device_get(element["batch"]), setup.tflops)
                time.sleep(device_s)  # the devices run the step meanwhile
            if step >= setup.warmup:
                rows.append({**host.to_json(), "wait_s": wait, "device_s": device_s})
    finally:
        feed.close()
    return summarize(rows, devices, workers, "measured" if timer else f"{setup.tflops:g} TFLOP/s")


def summarize(rows: list[dict], devices: int, workers: int, device_from: str) -> dict:
    """Medians per step, and the ratios against the device time."""
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    per_sample = statistics.median(r["load_s"] / max(r["samples"], 1) for r in rows)
    device_s = med["device_s"]
    worker_s = per_sample * max(1, workers)  # a worker's seconds per sample
    return {
        "devices": devices,
        "workers": workers,
        "samples": med["samples"],
        **{k: med[k] for k in ("plan_s", "load_s", "bucketize_s", "count_s", "transfer_s")},
        "serial_s": med["serial_s"],
        "overlapped_s": med["overlapped_s"],
        "host_s": med["serial_s"] + med["load_s"],
        "wait_s": med["wait_s"],
        "load_s_per_sample": per_sample,
        "device_s": device_s,
        "device_from": device_from,
        "host_over_device": (med["serial_s"] + med["load_s"]) / device_s,
        "serial_over_device": med["serial_s"] / device_s,
        "overlapped_over_device": med["overlapped_s"] / device_s,
        "workers_needed": worker_s * med["samples"] / device_s,
        "bytes_to_device": int(med["bytes_to_device"]),
    }


def local_mesh(local: int):
    """A data mesh over this host's devices (as many of them as divide its buckets)."""
    n = max(k for k in range(1, min(local, jax.local_device_count()) + 1) if local % k == 0)
    return sharding.make_mesh(MeshConfig(data=n), devices=jax.local_devices()[:n])


def table(rows: list[dict]) -> str:
    """The host benchmark's table: per data set, devices and workers, the feed's seconds a step
    by stage (plan, load, bucketize, count, transfer), serial and overlapped, against the
    device's step, and the share of it the device would wait."""
    cols = (
        "data",
        "dev",
        "wk",
        "smp",
        "plan",
        "load",
        "bucket",
        "count",
        "xfer",
        "serial",
        "overlap",
        "host",
        "wait",
        "device",
        "host/dev",
        "serial/dev",
        "overlap/dev",
        "ms/smp",
        "wk need",
        "MB/step",
    )
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:
        s = lambda k, r=r: f"{r[k]:.3f}"
        lines.append(
            " | ".join(
                [
                    r["data"],
                    str(r["devices"]),
                    str(r["workers"]),
                    f"{r['samples']:.0f}",
                    s("plan_s"),
                    s("load_s"),
                    s("bucketize_s"),
                    s("count_s"),
                    s("transfer_s"),
                    s("serial_s"),
                    s("overlapped_s"),
                    s("host_s"),
                    s("wait_s"),
                    s("device_s"),
                    f"{r['host_over_device']:.1f}x",
                    f"{r['serial_over_device']:.2f}x",
                    f"{r['overlapped_over_device']:.2f}x",
                    f"{r['load_s_per_sample'] * 1e3:.1f}",
                    f"{r['workers_needed']:.1f}",
                    f"{r['bytes_to_device'] / 1e6:.0f}",
                ]
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxmllm.bench.host`: runs the training feed for each --data, --devices and
    --workers combination, times each stage a step, and prints whether one host's feed keeps up
    with its devices' step (measured, or from --device-tflops)."""
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.host",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    p.add_argument("--data", default="config", help=f"comma list of {', '.join(DATA)}")
    p.add_argument("--devices", default="8", help="data-parallel buckets per step, comma list")
    p.add_argument("--workers", default="0", help="data.workers values, comma list")
    p.add_argument("--steps", type=int, default=6, help="measured steps per row")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per row")
    p.add_argument("--device-tflops", type=float, default=400.0)
    p.add_argument("--devices-per-host", type=int, default=8)
    p.add_argument(
        "--measure-device",
        action="store_true",
        help="time the step on a device even on CPU (default: off the CPU only)",
    )
    p.add_argument("--media-dir", help="where the media manifest is written (kept); default tmp")
    p.add_argument("--media-records", type=int, default=240, help="records of the manifest")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    base = load_config(args.config, args.set)
    split_cpu(base.mesh.cpu_devices)
    measure_device = args.measure_device or jax.default_backend() != "cpu"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for data in args.data.split(","):
            cfg = data_config(base, data, Path(args.media_dir or tmp), args.media_records)
            started = time.perf_counter()
            source, index = make_source(cfg)
            opened = time.perf_counter() - started
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
            what = "index mapped and checked, oversize applied"
            print(
                f"{data}: {len(index)} samples, source opened in {opened:.2f} s ({what}), "
                f"peak resident memory {peak:.0f} MB",
                file=sys.stderr,
            )
            setup = Setup(
                cfg,
                source,
                index,
                args.steps,
                args.warmup,
                args.devices_per_host,
                args.device_tflops,
                measure_device,
            )
            for devices in (int(d) for d in args.devices.split(",")):
                for workers in (int(w) for w in args.workers.split(",")):
                    row = {"data": data, **measure(setup, devices, workers)}
                    row["source_open_s"], row["source_open_peak_rss_mb"] = opened, peak
                    rows.append(row)
                    print(f"{data} {devices} devices {workers} workers: done", file=sys.stderr)
    print(
        f"{args.config}: medians of {args.steps} steps after {args.warmup}; seconds per step "
        f"on this host; device: {rows[0]['device_from']}"
    )
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
