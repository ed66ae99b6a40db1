"""Preprocessing throughput: samples/s and MB/s by worker count, on generated real media files.

    python -m jaxmllm.bench.data --images 300 --audio 150 --workers 0,1,2,4 --step-time-s 0.5

Writes a folder of PNG/JPEG/WebP/GIF images and WAV/FLAC/OGG clips with a JSONL manifest,
indexes it, then loads every sample (decode, resize, patchify, resample, log-mel) through the
trainer's loader with each worker count. "keeps up" compares the rate with what a training step
consumes: the planner's samples per step / --step-time-s.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 60, 220)}
PITCHES = {"low": 220.0, "mid": 660.0, "high": 1760.0}
IMAGE_FORMATS = (("png", "PNG"), ("jpg", "JPEG"), ("webp", "WEBP"), ("gif", "GIF"))
AUDIO_FORMATS = (("wav", "WAV"), ("flac", "FLAC"), ("ogg", "OGG"))


def write_image(path: Path, rng: np.random.Generator, colour: str, fmt: str, size=None) -> None:
    """A noisy background with a coloured box, at a random size (or `size` = (h, w))."""
    from PIL import Image

    h, w = size or (int(rng.integers(24, 160)), int(rng.integers(24, 160)))
    img = rng.integers(0, 90, (h, w, 3)).astype(np.uint8)
    y0, x0 = int(rng.integers(0, h // 2)), int(rng.integers(0, w // 2))
    img[y0 : y0 + h // 2, x0 : x0 + w // 2] = COLOURS[colour]
    Image.fromarray(img).save(path, format=fmt)


def write_audio(
    path: Path, rng: np.random.Generator, pitch: str, fmt: str, rate=None, seconds=None
):
    """A tone (stereo when the rate is 44.1 kHz) of a random length."""
    import soundfile as sf

    rate = rate or int(rng.choice([16000, 22050, 44100]))
    seconds = seconds or float(rng.uniform(0.3, 2.0))
    t = np.arange(int(rate * seconds)) / rate
    x = 0.4 * np.sin(2 * np.pi * PITCHES[pitch] * t) + 0.02 * rng.standard_normal(len(t))
    if rate == 44100:
        x = np.stack([x, 0.5 * x], axis=1)
    sf.write(path, x.astype(np.float32), rate, format=fmt)


def write_dataset(folder: str | Path, images: int, audio: int, broken: int = 0, seed: int = 0):
    """Writes media files and `manifest.jsonl` (captions and chats); returns the manifest path.

    `broken` adds that many bad records of each kind: a truncated JPEG, a zero-byte file,
    random bytes named .png, a missing path, a bad JSON line, mismatched placeholders.
    """
    folder = Path(folder)
    (folder / "media").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lines = []
    for k in range(images):
        ext, fmt = IMAGE_FORMATS[k % len(IMAGE_FORMATS)]
        colour = str(rng.choice(list(COLOURS)))
        write_image(folder / f"media/img{k}.{ext}", rng, colour, fmt)
        rec = {"id": f"img{k}", "images": [f"media/img{k}.{ext}"]}
        if k % 2:
            rec["text"] = f"<image>a {colour} box"
        else:
            rec["messages"] = [
                {"role": "user", "content": "<image>what colour is the box?"},
                {"role": "assistant", "content": colour},
            ]
        lines.append(json.dumps(rec))
    for k in range(audio):
        ext, fmt = AUDIO_FORMATS[k % len(AUDIO_FORMATS)]
        pitch = str(rng.choice(list(PITCHES)))
        write_audio(folder / f"media/clip{k}.{ext}", rng, pitch, fmt)
        rec = {
            "id": f"clip{k}",
            "text": f"<audio>a {pitch} tone",
            "audio": [f"media/clip{k}.{ext}"],
        }
        lines.append(json.dumps(rec))
    for k in range(broken):
        lines += _broken_records(folder, rng, k)
    order = rng.permutation(len(lines))
    path = folder / "manifest.jsonl"
    path.write_text("\n".join(lines[i] for i in order) + "\n")
    return path


def _broken_records(folder: Path, rng: np.random.Generator, k: int) -> list[str]:
    """Broken records of each kind a manifest may hold (a truncated JPEG, an empty and a noise
    PNG, a missing file, a placeholder mismatch, a line that is not JSON), their media written
    into `folder`: the index's rejects to count."""
    write_image(folder / f"media/trunc{k}.jpg", rng, "red", "JPEG", (64, 64))
    data = (folder / f"media/trunc{k}.jpg").read_bytes()
    (folder / f"media/trunc{k}.jpg").write_bytes(data[: len(data) // 2])
    (folder / f"media/zero{k}.png").write_bytes(b"")
    (folder / f"media/noise{k}.png").write_bytes(rng.bytes(300))
    bad = [
        {"id": f"trunc{k}", "text": "<image>x", "images": [f"media/trunc{k}.jpg"]},
        {"id": f"zero{k}", "text": "<image>x", "images": [f"media/zero{k}.png"]},
        {"id": f"noise{k}", "text": "<image>x", "images": [f"media/noise{k}.png"]},
        {"id": f"missing{k}", "text": "<image>x", "images": [f"media/nothere{k}.png"]},
        {"id": f"mismatch{k}", "text": "<image><image>x", "images": [f"media/zero{k}.png"]},
    ]
    return [json.dumps(b) for b in bad] + ['{"id": "bad json", text: }']


def bench(cfg, manifest: Path, workers: list[int], step_time_s: float) -> list[dict]:
    """Loads every indexed sample once per worker count; returns one row per count."""
    import dataclasses

    from jaxmllm.data.loader import Loader
    from jaxmllm.data.source import open_source
    from jaxmllm.resolve.run import resolve_run

    source = open_source(cfg)
    megabytes = (
        sum(
            (manifest.parent / p).stat().st_size
            for r in source.rows
            for p in _media_paths(source, r)
        )
        / 1e6
    )
    planner = resolve_run(cfg, 8, data=(source, source.index)).planner()
    per_step = float(np.mean([len(planner.plan().samples) for _ in range(8)]))
    rows = []
    for w in workers:
        wcfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, workers=w))
        loader = Loader(wcfg, source)
        loader.load(np.arange(min(8, len(source))), step=1)  # start the workers
        t0 = time.perf_counter()
        loader.load(np.arange(len(source)), step=1)
        dt = time.perf_counter() - t0
        loader.close()
        rate = len(source) / dt
        rows.append(
            {
                "workers": w,
                "samples_per_s": round(rate, 1),
                "mb_per_s": round(megabytes / dt, 2),
                "samples_per_step": round(per_step, 1),
                "keeps_up": bool(rate >= per_step / step_time_s),
            }
        )
    return rows


def _media_paths(source, row) -> list[str]:
    """The media paths a source's record at this index row names (images, then audio)."""
    rec = source.records.raw(row["row"])[0]
    return list(rec.get("images", [])) + list(rec.get("audio", []))


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxmllm.bench.data`: builds a manifest of --images and --audio samples in a
    temporary folder, indexes it, times loading with each --workers count, and prints whether
    loading keeps up with a step of --step-time-s (--json: the rows as JSON)."""
    from jaxmllm.config import load_config
    from jaxmllm.data.index import build_index

    p = argparse.ArgumentParser(prog="python -m jaxmllm.bench.data", description=__doc__)
    p.add_argument("--config", default="configs/manifest_example.yaml")
    p.add_argument("--images", type=int, default=300)
    p.add_argument("--audio", type=int, default=150)
    p.add_argument("--workers", default="0,1,2,4")
    p.add_argument("--step-time-s", type=float, default=0.5, help="a training step's wall time")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        manifest = write_dataset(tmp, args.images, args.audio)
        cfg = load_config(
            args.config, [f"data.path={manifest}", "data.index_dir=", "data.source=jsonl"]
        )
        build_index(cfg, manifest, progress=False)
        rows = bench(cfg, manifest, [int(w) for w in args.workers.split(",")], args.step_time_s)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'workers':>7} {'samples/s':>10} {'MB/s':>7} {'samples/step':>13} {'keeps up':>9}")
    for r in rows:
        print(
            f"{r['workers']:>7} {r['samples_per_s']:>10} {r['mb_per_s']:>7} "
            f"{r['samples_per_step']:>13} {'yes' if r['keeps_up'] else 'no':>9}"
        )
    print(f"(keeps up: samples/s >= samples per step / {args.step_time_s} s per step)")
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
