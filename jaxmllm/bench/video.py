"""Video reading rate: sampled frames/s per process from the frame cache, threaded decoding and
single-threaded decoding, side by side, and the worker processes an 8-GPU host needs.

    python -m jaxmllm.bench.video [--sizes 480p,1080p] [--seconds 30] [--fps 2] \\
        [--gops 250,30] [--repeat 3] [--threads N] [--recipes 2b,7b] [--tflops 400] \\
        [--gpus 8] [--json OUT]

Writes H.264 MP4s (x264, 30 fps, a keyframe every --gops frames: 250 is x264's default, 30 a
camera's) of --seconds of moving shapes over a textured, drifting background, then reads each
in this one process exactly as training does (`load_video`: the sampled frames at the default
data config's video rule and --fps, RGB and resized, temporal patches), three ways:

- `decode x1`: one decoder thread (the loader's decoding before the frame cache and threads);
- `decode xN`: FFmpeg's frame and slice threads, N = --threads (default: this process's cores),
  what a worker owning N cores does;
- `cache`: from a frame cache built for the clip (`jaxmllm.data.frame_store`: its shard read
  by offset, checksums checked); the pixels are checked equal to decoding's.

Per size, group of pictures and way: sampled frames/s over wall time (the median of --repeat)
and over this process's CPU time, the frames decoded and the seeks made. Then the demand: on the
`video` mix (`jaxmllm.bench.mixes.long_video`), each recipe (`configs/gpu/qwen2vl_<r>.yaml`)
costs `jaxmllm.cost.model`'s training FLOPs per sampled frame (its LLM tokens and vision patches,
shared over the mix's video frames); --gpus GPUs at --tflops each (400: an H100 at ~40% of its
bf16 peak) consume gpus x tflops / FLOPs-a-frame sampled frames/s, and the host needs that over
one process's rate in worker processes (each of the threaded ones owning --threads cores), and
over its frames per CPU-second in cores (threads shorten a video's wait, not the CPU it costs:
a host contended by other jobs gives wall rates below the CPU ones).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIZES = {"360p": (360, 640), "480p": (480, 854), "720p": (720, 1280), "1080p": (1080, 1920)}
RATE = 30  # frames a second of the generated videos


def write_clip(path: Path, height: int, width: int, seconds: float, gop: int) -> Path:
    """An H.264 MP4 of moving shapes over a textured background drifting across the frame
    (so that every frame codes differently, as in real footage), `gop` frames a keyframe."""
    import av

    rng = np.random.default_rng(0)
    h2, w2 = height + 64, width + 64  # (the texture is drawn larger and panned over)
    texture = rng.integers(0, 160, (h2 // 8, w2 // 8, 3), np.uint8).repeat(8, 0).repeat(8, 1)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=RATE, options={"preset": "veryfast"})
        stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
        stream.codec_context.gop_size = gop
        for k in range(int(seconds * RATE)):
            dy, dx = k % 64, (2 * k) % 64
            img = np.ascontiguousarray(texture[dy : dy + height, dx : dx + width])
            for j, colour in enumerate(((230, 40, 40), (40, 220, 60), (60, 80, 240))):
                y = int((height - height // 4) * (0.5 + 0.4 * math.sin(0.05 * k + 2 * j)))
                x = int((width - width // 4) * (0.5 + 0.4 * math.cos(0.03 * k + j)))
                img[y : y + height // 5, x : x + width // 5] = colour
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def read_rate(path: Path, params, repeat: int, way: str, threads: int, cache=None) -> dict:
    """Sampled frames/s of `load_video` on one file read `way` (decode / cache; median of
    `repeat`), and what the decoder did for them."""
    from jaxmllm.data.media import video
    from jaxmllm.data.media.container import set_decode_threads

    rule = video.VideoRule.of(params)
    info = video.read_video_info(path)
    n = video.sampled_frames(info, rule)
    gh, gw = video.frame_grid(info, n, rule)
    counts: dict = {"decoded": 0, "seeks": 0}
    cached = None
    if cache is not None:

        def cached(want, shape):
            groups, why = cache.groups("bench", 0, path, want, shape, rule)
            if groups is None:
                raise RuntimeError(f"the bench's frame cache missed ({why})")
            return groups

    set_decode_threads(threads)
    try:
        if cache is None:
            video.decode_frames(
                path,
                info,
                video.frame_indices(info.frames, n).tolist(),
                (gw * rule.patch, gh * rule.patch),
                "bench",
                counts,
            )
        cpu, wall = [], []
        for _ in range(repeat):
            t0, w0 = time.process_time(), time.perf_counter()
            items = video.load_video(path, info, rule, "bench", cached=cached)
            cpu.append(time.process_time() - t0)
            wall.append(time.perf_counter() - w0)
    finally:
        set_decode_threads(0)
    dt, dw = statistics.median(cpu), statistics.median(wall)
    return {
        "sampled_frames": n,
        "frame_grid": [gh, gw],
        "cpu_s": round(dt, 4),
        "wall_s": round(dw, 4),
        "frames_per_s": round(n / dw, 1),
        "frames_per_cpu_s": round(n / max(dt, 1e-9), 1),
        "decoded_frames": counts["decoded"],
        "seeks": counts["seeks"],
        "pixels": items,
    }


def build_cache(path: Path, folder: Path, params):
    """A frame cache holding `path`'s sampled frames as video 0 of record "bench"."""
    from jaxmllm.data import frame_store
    from jaxmllm.data.media import video

    rule = video.VideoRule.of(params)
    info = video.read_video_info(path)
    frames = video.sampled_frames_of(path, info, rule, "bench")
    folder.mkdir(parents=True, exist_ok=True)
    writer = frame_store.ShardWriter(folder, 0)
    at, sums = writer.add(video.patches_of(frames, rule))
    entry = ["bench", 0, writer.path.stem, at, *frames.shape[:3], path.stat().st_size, sums]
    side = {"name": writer.path.stem, "entries": [entry], "rejects": []}
    side["bytes"] = writer.close()
    frame_store.merge(folder, [side], params.counted())
    return frame_store.FrameCache(folder)


def host_demand(recipe: str, tflops: float, gpus: int) -> dict:
    """Sampled frames/s `gpus` GPUs at `tflops` consume training `recipe`
    (configs/gpu/qwen2vl_<recipe>.yaml) on the `video` mix: its training FLOPs per sampled
    video frame (the mix's LLM tokens and vision patches over its video frames)."""
    from jaxmllm.bench.mixes import long_video
    from jaxmllm.config import load_config
    from jaxmllm.cost.model import CostModel

    cfg = load_config(f"configs/gpu/qwen2vl_{recipe}.yaml", [])
    cost = CostModel.from_model(cfg.model)
    v = cfg.model.vision
    index = long_video(num_samples=4000)
    vision = index.items["vision"]
    llm = index.llm_tokens({"vision": v.merge**2, "audio": 4})
    flops = (
        cost.phase("llm").item_cost(llm).sum() + cost.phase("vision").item_cost(vision.sizes).sum()
    )
    videos = vision.count() > 1  # (the mix's samples with several vision items are videos)
    frames = v.temporal_patch * vision.count()[videos].sum()
    per_frame = flops / frames
    return {
        "recipe": f"configs/gpu/qwen2vl_{recipe}.yaml",
        "gflops_per_frame": round(float(per_frame) / 1e9, 1),
        "frames_per_s_needed": round(float(gpus * tflops * 1e12 / per_frame), 1),
    }


WAYS = ("decode x1", "decode xN", "cache")


def main(argv: list[str] | None = None) -> int:
    from jaxmllm.config import load_config
    from jaxmllm.data.media.container import cores
    from jaxmllm.data.preprocess import Params

    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.video",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sizes", default="480p,1080p", help=f"of {', '.join(SIZES)}")
    p.add_argument("--seconds", type=float, default=30.0, help="length of each video")
    p.add_argument("--fps", type=float, default=2.0, help="frames sampled a second")
    p.add_argument("--gops", default="250,30", help="frames a keyframe, comma-separated")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="decode xN's threads (0: the cores)")
    p.add_argument("--recipes", default="2b,7b", help="configs/gpu/qwen2vl_<r>.yaml, comma-sep.")
    p.add_argument("--tflops", type=float, default=400.0, help="TFLOP/s a GPU trains at")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    unknown = [s for s in args.sizes.split(",") if s not in SIZES]
    if unknown:
        p.error(f"--sizes: {', '.join(unknown)} is not one of {', '.join(SIZES)}")
    if args.repeat < 1 or args.threads < 0 or args.tflops <= 0 or args.gpus < 1:
        p.error("--repeat and --gpus must be >= 1, --threads >= 0, --tflops > 0")
    threads = args.threads or cores()
    cfg = load_config(None, [f"data.video_fps={args.fps}", "model.vision.temporal_patch=2"])
    params = Params.from_config(cfg)
    recipes = args.recipes.split(",")
    demand = {r: host_demand(r, args.tflops, args.gpus) for r in recipes}
    rows = []
    head = "".join(f" {'workers ' + r:>10} {'cores ' + r:>8}" for r in recipes)
    print(
        f"{'size':>6} {'gop':>4} {'way':>10} {'frames':>6} {'grid':>7} {'frames/s':>9} "
        f"{'(cpu)':>8} {'decoded':>8} {'seeks':>6}{head}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            for gop in (int(g) for g in args.gops.split(",")):
                path = write_clip(Path(tmp) / f"{size}_{gop}.mp4", *SIZES[size], args.seconds, gop)
                cache = build_cache(path, Path(tmp) / f"cache_{size}_{gop}", params)
                got = {}
                for way in WAYS:
                    n = 1 if way == "decode x1" else threads
                    got[way] = read_rate(
                        path, params, args.repeat, way, n, cache if way == "cache" else None
                    )
                same = all(
                    np.array_equal(a[0], b[0])
                    for a, b in zip(got["decode x1"]["pixels"], got["cache"]["pixels"], strict=True)
                )
                if not same:
                    raise RuntimeError(
                        f"{size} gop {gop}: the cache's pixels differ from decoding's"
                    )
                for way in WAYS:
                    row = {
                        "size": size,
                        "gop": gop,
                        "way": way,
                        "threads": 1 if way == "decode x1" else threads,
                        **{k: v for k, v in got[way].items() if k != "pixels"},
                    }
                    for r in recipes:
                        need = demand[r]["frames_per_s_needed"]
                        row[f"workers_{r}"] = math.ceil(need / row["frames_per_s"])
                        row[f"cores_{r}"] = math.ceil(need / row["frames_per_cpu_s"])
                    rows.append(row)
                    workers = "".join(
                        f" {row[f'workers_{r}']:>10} {row[f'cores_{r}']:>8}" for r in recipes
                    )
                    print(
                        f"{size:>6} {gop:>4} {way.replace('N', str(threads)):>10} "
                        f"{row['sampled_frames']:>6} {'x'.join(map(str, row['frame_grid'])):>7} "
                        f"{row['frames_per_s']:>9} {row['frames_per_cpu_s']:>8} "
                        f"{row['decoded_frames']:>8} {row['seeks']:>6}{workers}",
                        flush=True,
                    )
    for r in recipes:
        d = demand[r]
        print(
            f"({d['recipe']}: {d['gflops_per_frame']} GFLOP a sampled frame on the video mix; "
            f"{args.gpus} GPUs x {args.tflops:.0f} TFLOP/s = {d['frames_per_s_needed']} "
            "sampled frames/s a host)"
        )
    print(
        "(workers: that over one process's frames/s, wall clock, each of the threaded ones "
        f"owning {threads} cores; cores: over frames per CPU-second, what the host's cores "
        "must do however the work is split; the cache's pixels equal decoding's in every row)"
    )
    if args.json:
        out = {"demand": demand, "threads": threads, "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
