"""A synthetic columnar lengths index of any size, written quickly, for start-up benchmarks.

    python -m jaxmllm.bench.lengths_synth --samples 100000000 --out /tmp/synth-1e8 [--seed 0]
    python -m jaxmllm.bench.balance --lengths /tmp/synth-1e8 --devices 64 --startup

Writes the columns the planner reads (`text.npy`, per encoder phase `<phase>.ptr.npy` and
`<phase>.sizes.npy`: `jaxmllm.data.stored`) and a summary.json naming them, a chunk of samples
at a time with numpy (about 10^7 samples a second; 10^8 samples are about 3.2 GB). The
distribution is issue 38's long tail: text tokens lognormal around 245 (sigma 0.9, at least
1), 0-4 images in a sample, uniformly, of 256-4096 patches (log-uniform, whole merge blocks of
4), one sample in twenty with a clip of 100-3000 log-mel frames (multiples of 4).
`bench.balance --lengths` and `jaxmllm.data.stored.open_lengths` map it like a built index.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from jaxmllm.data.columnar import CHUNK, ColumnWriter
from jaxmllm.data.stored import FORMAT


def draw(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """`n` samples' counts: text, images (count, sizes), clips (count, sizes)."""
    text = np.maximum(1, np.rint(rng.lognormal(np.log(245.0), 0.9, n))).astype(np.int64)
    images = rng.integers(0, 5, n)
    patches = np.exp(rng.uniform(np.log(256), np.log(4096), int(images.sum())))
    patches = (np.rint(patches / 4) * 4).astype(np.int64)
    clips = (rng.random(n) < 0.05).astype(np.int64)
    frames = (rng.integers(25, 751, int(clips.sum())) * 4).astype(np.int64)
    return {"text": text, "vision": (images, patches), "audio": (clips, frames)}


def write(out: Path, samples: int, seed: int = 0) -> dict:
    """Writes the index of `samples` samples into `out`; returns its summary."""
    out.mkdir(parents=True, exist_ok=True)
    chunk = lambda a: draw(np.random.default_rng([seed, a]), min(CHUNK, samples - a))
    # (each column's length first, so it is written in place: the chunks are drawn twice from
    # the same seeds rather than held)
    items = dict.fromkeys(("vision", "audio"), 0)
    for a in range(0, samples, CHUNK):
        part = chunk(a)
        for phase in items:
            items[phase] += len(part[phase][1])
    writers = {"text": ColumnWriter(out / "text.npy", np.int64, (samples,))}
    for phase, count in items.items():
        writers[f"{phase}.ptr"] = ColumnWriter(out / f"{phase}.ptr.npy", np.int64, (samples + 1,))
        writers[f"{phase}.ptr"].write(np.zeros(1, np.int64))
        writers[f"{phase}.sizes"] = ColumnWriter(out / f"{phase}.sizes.npy", np.int64, (count,))
    done = dict.fromkeys(items, 0)
    for a in range(0, samples, CHUNK):
        part = chunk(a)
        writers["text"].write(part["text"])
        for phase in items:
            counts, sizes = part[phase]
            writers[f"{phase}.ptr"].write(done[phase] + np.cumsum(counts))
            writers[f"{phase}.sizes"].write(sizes)
            done[phase] += len(sizes)
    table = {f"{name}.npy": w.close() for name, w in writers.items()}
    summary = {"index_format": FORMAT, "kind": "lengths", "accepted": samples, "columns": table}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxmllm.bench.lengths_synth`: writes a synthetic lengths index of --samples
    samples into --out and prints how long it took."""
    ap = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.lengths_synth",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--samples", type=int, required=True)
    ap.add_argument("--out", required=True, help="the index folder to write")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.samples < 1:
        ap.error(f"--samples {args.samples}: an index needs at least 1 sample")
    started = time.perf_counter()
    write(Path(args.out), args.samples, args.seed)
    seconds = time.perf_counter() - started
    print(f"{args.out}: {args.samples} samples in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
