"""Video decoding rate: sampled frames/s per worker process, and the workers a host needs.

    python -m jaxmllm.bench.video [--sizes 480p,1080p] [--seconds 30] [--fps 2] \\
        [--gops 250,30] [--repeat 3] [--tokens-per-s 27300] [--gpus 8] [--json OUT]

Writes H.264 MP4s (x264, 30 fps, a keyframe every --gops frames: 250 is x264's default, 30 a
camera's) of --seconds of moving shapes over a textured, drifting background, then decodes each
in this one process (a worker's share of the host) exactly as training does: `load_video` (the
packet index, a seek to the keyframe before a sampled frame where that is cheaper than decoding
on, RGB and resize in swscale, normalise, temporal patches) at --fps, by the default data
config's video rule. Per size and group of pictures: sampled frames/s (the median of --repeat)
over this process's CPU time (one decoder thread: what a worker on a core of its own does,
whatever else the machine runs) and over wall time, the frames the decoder went through, and
the seeks it made.

The workers a host needs for training on the `video` mix (`jaxmllm.bench.mixes.long_video`):
--gpus x the real LLM tokens/s a GPU trains (--tokens-per-s; default: `bench.throughput` of
configs/small.yaml on one H100, orchestrated: docs/benchmarks.md) x the share of the mix's LLM
tokens that are video tokens / the mix's video tokens per sampled frame = sampled frames/s the
host must decode, over one worker's sampled frames/s.
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


def decode_rate(path: Path, params, repeat: int) -> dict:
    """Sampled frames/s of `load_video` on one file (median of `repeat`), and what the decoder
    did for them."""
    from jaxmllm.data.media import video

    rule = video.VideoRule.of(params)
    info = video.read_video_info(path)
    n = video.sampled_frames(info, rule)
    gh, gw = video.frame_grid(info, n, rule)
    counts: dict = {}
    video.decode_frames(path, info, video.frame_indices(info.frames, n).tolist(),
                        (gw * rule.patch, gh * rule.patch), "bench", counts)  # fmt: skip
    cpu, wall = [], []
    for _ in range(repeat):
        t0, w0 = time.process_time(), time.perf_counter()
        video.load_video(path, info, rule, "bench")
        cpu.append(time.process_time() - t0)
        wall.append(time.perf_counter() - w0)
    dt = statistics.median(cpu)
    return {
        "sampled_frames": n,
        "frame_grid": [gh, gw],
        "cpu_s": round(dt, 3),
        "wall_s": round(statistics.median(wall), 3),
        "sampled_frames_per_s": round(n / dt, 1),
        "sampled_frames_per_wall_s": round(n / statistics.median(wall), 1),
        "decoded_frames": counts["decoded"],
        "decoded_frames_per_s": round(counts["decoded"] / dt, 1),
        "seeks": counts["seeks"],
    }


def host_demand(tokens_per_s: float, gpus: int, per_token: int = 4) -> dict:
    """Sampled frames/s a host of `gpus` must decode to train the `video` mix at
    `tokens_per_s` real LLM tokens/s a GPU."""
    from jaxmllm.bench.mixes import long_video

    index = long_video(num_samples=4000)
    vision = index.items["vision"]
    videos = vision.count() > 1  # (the mix's samples with several vision items are videos)
    llm = index.llm_tokens({"vision": per_token, "audio": 4})
    video_tokens = vision.per_sample(vision.sizes // per_token)[videos].sum()
    frames = 2 * vision.count()[videos].sum()  # (two frames a temporal patch)
    share = video_tokens / llm.sum()
    per_frame = video_tokens / frames
    need = gpus * tokens_per_s * share / per_frame
    return {"video_token_share": round(float(share), 3),
            "video_tokens_per_frame": round(float(per_frame), 1),
            "frames_per_s_needed": round(float(need), 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from jaxmllm.config import load_config
    from jaxmllm.data.preprocess import Params

    p = argparse.ArgumentParser(prog="python -m jaxmllm.bench.video", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--sizes", default="480p,1080p", help=f"of {', '.join(SIZES)}")
    p.add_argument("--seconds", type=float, default=30.0, help="length of each video")
    p.add_argument("--fps", type=float, default=2.0, help="frames sampled a second")
    p.add_argument("--gops", default="250,30", help="frames a keyframe, comma-separated")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--tokens-per-s",
        type=float,
        default=27300.0,
        help="real LLM tokens/s a GPU trains (docs/benchmarks.md: small.yaml, H100)",
    )
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    unknown = [s for s in args.sizes.split(",") if s not in SIZES]
    if unknown:
        p.error(f"--sizes: {', '.join(unknown)} is not one of {', '.join(SIZES)}")
    cfg = load_config(None, [f"data.video_fps={args.fps}", "model.vision.temporal_patch=2"])
    params = Params.from_config(cfg)
    demand = host_demand(args.tokens_per_s, args.gpus)
    rows = []
    print(f"{'size':>6} {'gop':>4} {'frames':>6} {'grid':>7} {'sampled/s':>10} {'(wall)':>7} "
          f"{'decoded':>8} {'decoded/s':>10} {'seeks':>6} {'workers':>8}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            for gop in (int(g) for g in args.gops.split(",")):
                path = write_clip(Path(tmp) / f"{size}_{gop}.mp4", *SIZES[size], args.seconds, gop)
                row = {"size": size, "gop": gop, **decode_rate(path, params, args.repeat)}
                row["workers_needed"] = math.ceil(
                    demand["frames_per_s_needed"] / row["sampled_frames_per_s"]
                )
                rows.append(row)
                print(f"{size:>6} {gop:>4} {row['sampled_frames']:>6} "
                      f"{'x'.join(map(str, row['frame_grid'])):>7} "
                      f"{row['sampled_frames_per_s']:>10} {row['sampled_frames_per_wall_s']:>7} "
                      f"{row['decoded_frames']:>8} "
                      f"{row['decoded_frames_per_s']:>10} {row['seeks']:>6} "
                      f"{row['workers_needed']:>8}", flush=True)  # fmt: skip
    print(f"(workers: {args.gpus} GPUs x {args.tokens_per_s:.0f} tokens/s x "
          f"{demand['video_token_share']} video tokens / {demand['video_tokens_per_frame']} "
          f"tokens a sampled frame = {demand['frames_per_s_needed']} sampled frames/s a host, "
          "over one worker's sampled frames/s)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"demand": demand, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
