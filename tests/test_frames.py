"""The frame cache (`python -m jaxmllm.data.frames`) on small generated videos: batches from the
cache are bit-identical to decoding's and resume the same; a truncated or changed shard, a
changed video and a video the cache lacks are decoded instead, counted, and a rebuild repairs
the shards; a video broken after indexing is a counted reject at cache time; a config asking
for a cache that was not built is told how to build it; a run from the cache trains as one that
decodes, and one that decodes resumes exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from video_files import moving_frames, write_video

from jaxmllm.config import ConfigError, load_config
from jaxmllm.data.datasets import index_dir
from jaxmllm.data.frames import build_frames, main
from jaxmllm.data.index import build_index, data_set
from jaxmllm.data.preprocess import Params
from jaxmllm.data.source import open_source

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

pytest.importorskip("av")

VIDEO = ["model.vision.video=true", "model.vision.temporal_patch=2", "data.eval.source=none"]


def _data(tmp_path: Path) -> Path:
    ways = ("left", "right")
    for k, (n, h, w) in enumerate([(20, 32, 48), (12, 40, 40), (16, 32, 32), (24, 48, 32)]):
        write_video(tmp_path / f"v{k}.mp4", moving_frames(n, h, w, ways[k % 2]), fps=10)
    from PIL import Image

    Image.new("RGB", (24, 16), (200, 30, 30)).save(tmp_path / "cat.png")
    records = [
        {
            "id": f"v{j}",
            "videos": [f"v{j % 4}.mp4"],
            "text": f"<video>which way does it move? {ways[j % 2]}",
        }
        for j in range(12)
    ]
    records += [
        {
            "id": "two",
            "text": "<image><video>and<video>",
            "images": ["cat.png"],
            "videos": ["v1.mp4", "v2.mp4"],
        }
    ]
    records += [{"id": f"t{j}", "text": " ".join(map(str, range(j, j + 8)))} for j in range(4)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _config(manifest: Path, *sets):
    return load_config(
        "configs/tiny.yaml",
        [
            "data.source=jsonl",
            f"data.path={manifest}",
            "data.video_fps=4",
            "data.video_frame_min_pixels=64",
            "data.video_max_pixels=8192",
            f"train.output_dir={manifest.parent / 'run'}",
            *VIDEO,
            *sets,
        ],
    )


def _built(tmp_path: Path):
    manifest = _data(tmp_path)
    cfg = _config(manifest)
    build_index(cfg, manifest, progress=False)
    summary = build_frames(cfg, data_set(cfg, None))
    return manifest, summary


def _batches(cfg, steps: int, state=None):
    from jaxmllm.feed.iterator import make_pipeline
    from jaxmllm.resolve.run import resolve_run

    it = make_pipeline(resolve_run(cfg, 8), prefetch=0)
    if state is not None:
        it.set_state(state)
    out = [next(it) for _ in range(steps)]
    return out, it.get_state()


def _same(a: dict, b: dict) -> None:
    assert np.array_equal(a["info"].samples, b["info"].samples)
    assert sorted(a["batch"]) == sorted(b["batch"])
    for key in a["batch"]:
        assert np.array_equal(a["batch"][key], b["batch"][key]), key


def test_batches_from_the_cache_are_decodings_bit_for_bit_and_resume(tmp_path, capsys):
    """Pixels and positions (every array of every batch) from the cache equal decoding's; the
    metrics count cache hits and no decode; a pipeline restored from a cached run's state
    after step 1 gives the uninterrupted run's steps 2 and 3; the command line builds the
    same cache again without decoding anything (every shard checks out)."""
    manifest, summary = _built(tmp_path)
    assert summary["videos"] == 14 and summary["rejects"] == {} and summary["rebuilt"] == 1
    decoding, _ = _batches(_config(manifest), 3)
    cached, _ = _batches(_config(manifest, "data.frame_cache=true"), 3)
    for a, b in zip(decoding, cached, strict=True):
        _same(a, b)
    hits = cached[-1]["info"].rejects
    assert hits.get("frames/cache_hit", 0) > 0 and not any("decoded" in k for k in hits), hits
    assert decoding[-1]["info"].rejects.get("frames/decoded", 0) > 0
    assert (cached[0]["batch"]["vision_segment_ids"] > 0).any()  # (videos in the steps)

    first, state = _batches(_config(manifest, "data.frame_cache=true"), 1)
    resumed, _ = _batches(_config(manifest, "data.frame_cache=true"), 2, state)
    for a, b in zip(cached[1:], resumed, strict=True):
        _same(a, b)

    sets = [
        "data.source=jsonl",
        f"data.path={manifest}",
        "data.video_fps=4",
        "data.video_frame_min_pixels=64",
        "data.video_max_pixels=8192",
        *VIDEO,
    ]
    argv = ["--config", "configs/tiny.yaml", *[x for s in sets for x in ("--set", s)]]
    assert main([*argv, "--workers", "0"]) == 0
    out = capsys.readouterr().out
    assert "14 videos" in out and "(0 built now, the others kept)" in out, out


def _pixels(source, i: int) -> list[np.ndarray]:
    return [m[0] for m in source[i].media["vision"]]


def test_a_damaged_or_stale_cache_is_never_read_as_pixels(tmp_path):
    """A shard cut short, a shard with one byte changed (same size), an entry the cache lacks,
    a video file rewritten since the build: each video is decoded instead (the pixels are
    decoding's), counted by reason; building again rebuilds only what is damaged."""
    manifest, _ = _built(tmp_path)
    cfg = _config(manifest)
    folder = index_dir(data_set(cfg, None), Params.from_config(cfg).counted()) / "frames"
    want = _pixels(open_source(cfg), 0)

    def check(reason):
        source = open_source(_config(manifest, "data.frame_cache=true"))
        got = source[0]
        assert got.frames == {reason: 1}, got.frames
        return [m[0] for m in got.media["vision"]]

    def same(got):
        assert len(got) == len(want) == 4
        assert all(np.array_equal(a, b) for a, b in zip(want, got, strict=True))

    same(check("cache_hit"))
    shard = folder / "frames-00000.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])  # truncated
    same(check("decoded_damaged"))
    shard.write_bytes(data[:10] + bytes([data[10] ^ 1]) + data[11:])  # changed, same size
    same(check("decoded_damaged"))
    summary = build_frames(cfg, data_set(cfg, None))
    assert summary["rebuilt"] == 1 and shard.read_bytes() == data
    same(check("cache_hit"))

    manifest_json = folder / "frames.json"
    saved = json.loads(manifest_json.read_text())
    saved["entries"] = [e for e in saved["entries"] if e[0] != "v0"]
    manifest_json.write_text(json.dumps(saved))
    same(check("decoded_absent"))
    assert build_frames(cfg, data_set(cfg, None))["rebuilt"] == 0  # (the shards check out)
    same(check("cache_hit"))

    size = (tmp_path / "v0.mp4").stat().st_size
    write_video(tmp_path / "v0.mp4", moving_frames(20, 32, 48, "left"), fps=10, gop=5)
    assert (tmp_path / "v0.mp4").stat().st_size != size  # (the same header: the index agrees)
    assert not all(np.array_equal(a, b) for a, b in zip(want, check("decoded_stale"), strict=True))
    assert build_frames(cfg, data_set(cfg, None))["rebuilt"] == 1  # (its shard, for the new file)
    check("cache_hit")


def test_a_video_broken_after_indexing_is_a_counted_reject_at_cache_time(tmp_path):
    """The index accepted it (its header was fine then); the cache build decodes it, fails,
    counts the reject by reason with the record and video named, and caches the others; the
    training load decodes it and rejects it, counted, as without the cache."""
    from jaxmllm.data.loader import Loader

    manifest = _data(tmp_path)
    cfg = _config(manifest)
    build_index(cfg, manifest, progress=False)
    data = (tmp_path / "v3.mp4").read_bytes()
    (tmp_path / "v3.mp4").write_bytes(data[:300])
    summary = build_frames(cfg, data_set(cfg, None))
    assert summary["rejects"] == {"undecodable_media": 3}  # (v3, v7, v11)
    assert summary["examples"]["undecodable_media"]["id"] == "v3"
    assert summary["videos"] == 11
    cached = _config(manifest, "data.frame_cache=true")
    source = open_source(cached)
    row = next(i for i, r in enumerate(source.rows) if r["id"] == "v3")
    loader = Loader(cached, source, tmp_path / "run" / "rejects.jsonl")
    assert loader.load(np.array([row]), step=0) == {row: None}
    assert loader.counts()["rejects/load_undecodable_media"] == 1.0


def test_a_config_asking_for_a_cache_never_built_is_told_how(tmp_path):
    """data.frame_cache without a build stops at start-up naming the command; a change of the
    sampling rule (data.video_fps) is another index key, so another cache to build."""
    manifest, _ = _built(tmp_path)
    other = _config(manifest, "data.video_fps=2")
    build_index(other, manifest, progress=False)
    with pytest.raises(ConfigError, match="python -m jaxmllm.data.frames"):
        open_source(_config(manifest, "data.frame_cache=true", "data.video_fps=2"))
    assert build_frames(other, data_set(other, None))["rebuilt"] == 1  # (its own folder)
    open_source(_config(manifest, "data.frame_cache=true", "data.video_fps=2"))


@pytest.mark.parametrize("suffix", [".mp4", ".webm"])
def test_threaded_decoding_gives_the_same_frames_with_a_seek_a_group_of_pictures(tmp_path, suffix):
    """FFmpeg's frame and slice threads (the worker's share of the cores) decode the sampled
    frames bit for bit as one thread does (the cache and the decoder agree whatever each ran
    with), and the decoder seeks at most once per group of pictures it samples from."""
    from jaxmllm.data.media.container import set_decode_threads
    from jaxmllm.data.media.video import decode_frames, frame_indices, read_video_info

    path = write_video(tmp_path / f"m{suffix}", moving_frames(90, 48, 64), fps=10, gop=12)
    info = read_video_info(path)
    indices = frame_indices(info.frames, 30).tolist()  # (three frames a second of 10)
    got = {}
    try:
        for threads in (1, 4):
            set_decode_threads(threads)
            counts: dict = {}
            got[threads] = decode_frames(path, info, indices, (32, 24), "m", counts)
            assert counts["seeks"] <= -(-90 // 12), counts  # (8 groups of pictures)
    finally:
        set_decode_threads(0)
    assert len(got[1]) == len(got[4]) == 30
    assert all(np.array_equal(a, b) for a, b in zip(got[1], got[4], strict=True))


@pytest.mark.slow  # (~55 s of CPU, est.: two short training runs, one cut and rerun; the fast
# pipeline test above holds the cache's batches and their resumption, this one the trainer's)
def test_a_run_from_the_cache_trains_as_one_that_decodes_and_that_resumes_exactly(tmp_path):
    """Training from the cache, and training on the same JSONL records decoding their videos
    with PyAV (every step has some), interrupted after step 3 and run again: the rerun resumes
    from the step-2 checkpoint, and steps 1..4 of the decoding run have the losses and gradient
    norms of the uninterrupted run from the cache. (The default suite's test_train resumes
    tiny.yaml, whose synthetic data has rendered videos; this is the path from files.)"""
    from jaxmllm.loop.metrics import read_metrics
    from jaxmllm.train import main as train

    manifest, _ = _built(tmp_path)

    def run(out, *sets, on_step=None):
        steps = ["train.steps=4", "train.log_every=1", "train.checkpoint_every=2"]
        cfg = _config(
            manifest, f"train.output_dir={out}", *steps, "train.progress_bar=false", *sets
        )
        train(cfg, on_step=on_step)

    def interrupt_at_3(step, _):
        if step == 3:
            raise KeyboardInterrupt

    run(tmp_path / "cached", "data.frame_cache=true")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut", on_step=interrupt_at_3)
    assert read_metrics(tmp_path / "cut")[-1]["step"] == 3
    run(tmp_path / "cut")  # the same command again: resumes from the step-2 checkpoint
    cached, cut = ({r["step"]: r for r in read_metrics(tmp_path / n)} for n in ("cached", "cut"))
    assert sorted(cut) == sorted(cached) == [1, 2, 3, 4]
    for step in cached:
        assert cached[step]["padding/vision"] < 1.0  # (videos in every step)
        assert cached[step].get("frames/cache_hit", 0) > 0, cached[step]
        assert cut[step].get("frames/cache_hit", 0) == 0, cut[step]  # (it decodes)
        for key in ("loss", "grad_norm", "loss_tokens", "samples"):
            assert cut[step][key] == cached[step][key], (step, key)
