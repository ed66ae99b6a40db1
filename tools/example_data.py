"""Writes the small real data set configs/manifest_example.yaml trains on.

    python tools/example_data.py [--out data/example] [--images 160] [--audio 80]

`<out>/manifest.jsonl` (jaxmllm's JSONL records: captions "<image>a red box", questions "what
colour is the box?" answered "red", clips "<audio>a high tone") and `<out>/media/` (images as
PNG, JPEG, WebP and GIF, clips as WAV, FLAC and OGG, at random sizes and lengths), plus six
records broken on purpose (a truncated JPEG, an empty file, noise named .png, a missing file,
mismatched placeholders, a line that is not JSON) to show how bad records are reported. The
same generator feeds the data benchmarks (`jaxmllm.bench.data.write_dataset`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxmllm.bench.data import write_dataset


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python tools/example_data.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="data/example", help="the folder to write")
    p.add_argument("--images", type=int, default=160, help="image records")
    p.add_argument("--audio", type=int, default=80, help="audio records")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    manifest = write_dataset(Path(args.out), args.images, args.audio, broken=1, seed=args.seed)
    print(
        f"wrote {manifest}: {args.images} image and {args.audio} audio records with their "
        f"media in {Path(args.out) / 'media'}/, and 6 broken on purpose (the index reports them)."
        "\nIndex it once, then train:\n"
        "  python -m jaxmllm.data.index --config configs/manifest_example.yaml\n"
        "  python -m jaxmllm.train --config configs/manifest_example.yaml"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
