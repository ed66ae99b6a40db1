"""Videos on small generated files (PyAV encodes them in tmp_path): the sampling and resize rule
and the temporal patches against transformers' Qwen2-VL video processor, M-RoPE against its
`get_rope_index`, logits with a video against Qwen2VLForConditionalGeneration, the JSONL path,
bad videos rejected and counted, a routed step equal to its samples alone. (A run with videos
from files resuming exactly: test_frames' slow training test.)

transformers' video processor imports torchvision at the top (for its resize), which the CPU
torch build here cannot load; `processor` loads the module with a stand-in for torchvision's
`resize` that returns the size asked of it, so the sampling, the resize rule (the size the
processor asks for) and the patch layout under test are transformers' own code.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from video_files import frame_number, grey_frames, moving_frames, write_empty, write_video

from jaxmllm.batch.bucketize import mrope_positions
from jaxmllm.config import ConfigError, load_config
from jaxmllm.config.spec import Inputs
from jaxmllm.data.index import build_index
from jaxmllm.data.loader import Loader
from jaxmllm.data.media.video import (
    VideoCaps,
    VideoInfo,
    VideoRule,
    decode_frames,
    frame_grid,
    frame_indices,
    load_video,
    read_video_info,
    sampled_frames,
    video_parts,
)
from jaxmllm.data.preprocess import Params, Preprocessor
from jaxmllm.data.records.record import parse_record
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.source import open_source

pytest.importorskip("av")
try:  # (transformers' processor and models run on it: the tests that need it are marked)
    import torch
except ImportError:
    torch = None

PIXELS = Inputs.pixels()  # (0.5, 0.5, 0.5): what the Qwen2-VL processor here normalises with
VIDEO = ["model.vision.video=true", "model.vision.temporal_patch=2", "data.eval.source=none"]


@pytest.fixture(scope="module")
def processor():
    """(transformers' Qwen2VLVideoProcessor class, an instance made without __init__, the sizes
    its resize asked for)."""
    import transformers.image_processing_backends as backends
    import transformers.models.qwen2_vl as package

    asked: list[tuple[int, int]] = []

    def resize(image, size, **_):
        asked.append(tuple(size))
        return torch.zeros(*image.shape[:-2], *size)

    tvf = types.ModuleType("torchvision.transforms.v2.functional")
    tvf.resize = resize
    modes = ("BILINEAR", "BICUBIC", "LANCZOS", "NEAREST")
    tvf.InterpolationMode = types.SimpleNamespace(**{m: m.lower() for m in modes})
    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2"]
    stand_ins = {n: types.ModuleType(n) for n in names} | {tvf.__name__: tvf}
    name = "transformers.models.qwen2_vl.video_processing_qwen2_vl"
    where = f"{package.__path__[0]}/video_processing_qwen2_vl.py"
    spec = importlib.util.spec_from_file_location(name, where)
    module = importlib.util.module_from_spec(spec)
    saved = {k: sys.modules.get(k) for k in [*stand_ins, name]}
    sys.modules.update(stand_ins | {name: module})
    try:
        spec.loader.exec_module(module)
    finally:
        for k, v in saved.items():
            sys.modules.pop(k) if v is None else sys.modules.__setitem__(k, v)
    mp = pytest.MonkeyPatch()
    mp.setattr(backends, "tvF", tvf, raising=False)  # (its resize's module-level name)
    cls = module.Qwen2VLVideoProcessor
    proc = cls.__new__(cls)
    proc.num_frames = proc.fps = None  # (what __init__ leaves them at: each call passes its own)
    yield cls, proc, asked
    mp.undo()


def rule(**kw) -> VideoRule:
    base = dict(
        fps=2.0,
        min_frames=4,
        max_frames=768,
        frame_min_pixels=3136,
        frame_max_pixels=602112,
        max_pixels=3211264,
        temporal_patch=2,
        patch=14,
        merge=2,
    )
    return VideoRule(**(base | kw))


CASES = [  # (frames, rate, height, width, rule changes)
    (300, 30.0, 360, 640, {}),  # 10 s: 20 frames
    (7200, 24.0, 1080, 1920, {}),  # 5 min: 600 frames, the budget split thin
    (5400, 30.0, 480, 854, {"max_frames": 64}),  # capped at 64
    (9, 30.0, 240, 320, {}),  # 0.3 s: at least min_frames, at most its own 9 -> 8
    (25, 25.0, 100, 3000, {"fps": 3.0, "temporal_patch": 1}),  # very wide; one frame a patch
    (1001, 29.97, 720, 1280, {"fps": 1.0, "max_pixels": 200_000_000, "frame_min_pixels": 100352}),
    (3, 30.0, 64, 64, {}),  # too short for min_frames: its 3 frames -> 2
]


@pytest.mark.torch
@pytest.mark.parametrize("frames, rate, height, width, change", CASES)
def test_sampling_and_resize_are_qwen2_vls_video_processors(
    processor, frames, rate, height, width, change
):
    from transformers.image_utils import SizeDict
    from transformers.video_utils import VideoMetadata

    cls, proc, asked = processor
    r = rule(**change)
    info = VideoInfo(frames, rate, height, width)
    n = sampled_frames(info, r)
    meta = VideoMetadata(total_num_frames=frames, fps=rate)
    theirs = cls.sample_frames(
        proc,
        meta,
        temporal_patch_size=r.temporal_patch,
        min_frames=r.min_frames,
        max_frames=r.max_frames,
        fps=r.fps,
    )
    np.testing.assert_array_equal(frame_indices(frames, n), theirs.numpy())
    # HF's video budget is max_video_tokens x factor^2 x 0.9 pixels: ours is that number
    factor = r.patch * r.merge
    proc.max_video_tokens = r.max_pixels / (factor * factor * 0.9) * (1 + 1e-12)
    assert int(proc.max_video_tokens * factor * factor * 0.9) == r.max_pixels
    video = torch.zeros(1, 1, 3, height, width).expand(1, n, 3, height, width)
    size = SizeDict(shortest_edge=r.frame_min_pixels, longest_edge=r.frame_max_pixels)
    cls.resize(
        proc,
        video,
        size,
        resample=None,
        factor=factor,
        temporal_factor=r.temporal_patch,
        cap_pixels_per_frame=True,
    )
    gh, gw = frame_grid(info, n, r)
    assert (gh * r.patch, gw * r.patch) == asked[-1]


@pytest.mark.parametrize("suffix", [".mp4", ".webm", ".mkv"])
def test_decoding_takes_the_sampled_frames_at_the_resized_size(tmp_path, suffix):
    """H.264 in MP4 and MKV, VP9 in WebM: the header's frames, rate and size without decoding;
    the frames decoded are the rule's (each a flat grey that says its number), seeking by
    keyframe; the temporal patches hold them in order, resized to the rule's grid."""
    path = write_video(tmp_path / f"v{suffix}", grey_frames(45, 48, 80), fps=10, gop=6)
    info = read_video_info(path)
    assert info == VideoInfo(45, 10.0, 48, 80)
    r = rule(patch=4, merge=2, fps=3.0, frame_min_pixels=64)
    n = sampled_frames(info, r)
    want = frame_indices(45, n)
    assert n == 12 and want.tolist() == [0, 3, 7, 11, 15, 18, 22, 26, 30, 33, 37, 41]
    gh, gw = frame_grid(info, n, r)
    frames = decode_frames(path, info, want.tolist(), (gw * 4, gh * 4), "v")
    assert [frame_number(f) for f in frames] == want.tolist()
    assert frames[0].shape == (gh * 4, gw * 4, 3)
    items = load_video(path, info, r, "v")
    assert len(items) == n // 2 == video_parts(info, r)[0]
    values, pos = items[1]  # frames 7 and 11, side by side
    assert values.shape == (gh * gw, 2 * 4 * 4 * 3) and pos.shape == (gh * gw, 2)
    assert values.dtype == np.uint8  # (pixels: the encoder normalises them on the device)
    grey = values.reshape(-1, 2, 48).mean(0).mean(-1)
    assert [frame_number(np.full(3, g)) for g in grey] == [7, 11]
    # Only some temporal patches (another host encodes the others): the same values.
    part = load_video(path, info, r, "v", parts=[1, 4])
    assert part[0] is None and np.array_equal(part[1][0], values)


def test_a_video_whose_metadata_is_not_utf8_decodes(tmp_path):
    """A title tag in Latin-1 bytes (as some muxers write): PyAV before 19 raises on it unless
    told to ignore it, 19 took that keyword away (a TypeError on every video); with either,
    the header and the frames are read."""
    import av

    path = write_video(tmp_path / "v.mp4", grey_frames(8, 32, 32), fps=4, title="TITLE_01")
    data = path.read_bytes()
    assert data.count(b"TITLE_01") == 1
    path.write_bytes(data.replace(b"TITLE_01", b"caf\xe9 \xff\xfe"))  # (as long: no offset moves)
    info = read_video_info(path, "r1")
    assert info == VideoInfo(8, 4.0, 32, 32)
    items = load_video(path, info, rule(patch=4, merge=2, fps=4.0, frame_min_pixels=16), "r1")
    assert items and items[0][0].dtype == np.uint8, av.__version__


def test_a_video_over_the_byte_cap_is_never_opened(tmp_path):
    """data.max_media_bytes holds for videos as for every media file: over it, the header read
    and the decoding alike refuse it (media_too_large) before FFmpeg sees a byte."""
    path = write_video(tmp_path / "v.mp4", grey_frames(8, 32, 32), fps=4)
    size = path.stat().st_size
    info = read_video_info(path, "r1", VideoCaps(max_bytes=size))  # (at the cap: read)
    for read in (
        lambda: read_video_info(path, "r1", VideoCaps(max_bytes=size - 1)),
        lambda: load_video(
            path, info, rule(patch=4, merge=2), "r1", caps=VideoCaps(max_bytes=size - 1)
        ),
    ):
        with pytest.raises(RecordError) as e:
            read()
        assert e.value.reason == "media_too_large" and e.value.record_id == "r1"


@pytest.mark.torch
def test_temporal_patches_are_the_processors_patchify(processor, tmp_path):
    """Our temporal patches, permuted to transformers' layout (channel, frame, row, column per
    patch), are its video processor's patches of the same frames, in the same order."""
    cls, proc, _ = processor
    path = write_video(tmp_path / "m.mp4", moving_frames(30, 64, 96), fps=10)
    info = read_video_info(path)
    r = rule(patch=4, merge=2, fps=4.0, frame_min_pixels=64, max_pixels=4096 * 16)
    n = sampled_frames(info, r)
    gh, gw = frame_grid(info, n, r)
    frames = decode_frames(path, info, frame_indices(30, n).tolist(), (gw * 4, gh * 4), "m")
    normal = (np.stack(frames).astype(np.float32) / 255 - 0.5) / 0.5
    video = torch.from_numpy(normal.transpose(0, 3, 1, 2)[None])  # [1, frames, C, H, W]
    theirs, t, h, w = cls.patchify(proc, video, patch_size=4, merge_size=2, temporal_patch_size=2)
    ours = PIXELS.normalise(np.concatenate([v for v, _ in load_video(path, info, r, "m")]))
    assert (t, h, w) == (n // 2, gh, gw) and len(ours) == t * h * w
    as_theirs = ours.reshape(-1, 2, 4, 4, 3).transpose(0, 4, 1, 2, 3).reshape(len(ours), -1)
    np.testing.assert_allclose(as_theirs, theirs[0].numpy(), atol=1e-6)


@pytest.mark.torch
def test_mrope_video_positions_are_get_rope_index(tmp_path):
    """Text, an image, text, two videos one after the other, text: M-RoPE positions equal
    Qwen2-VL's `get_rope_index` for the same ids and grids."""
    import hf_models
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(hf_models.qwen2_vl(tmp_path / "vl"))
    image, video, start, end = 290, 291, 292, 293
    grids = [(1, 4, 6), (3, 4, 4), (2, 2, 6)]  # (t, rows, cols) in patches; merge 2
    text = lambda n: list(range(10, 10 + n))
    pads = lambda token, g: [token] * (g[0] * g[1] * g[2] // 4)
    ids = (
        text(3)
        + [start]
        + pads(image, grids[0])
        + [end]
        + text(2)
        + [start]
        + pads(video, grids[1])
        + [end, start]
        + pads(video, grids[2])
        + [end]
        + text(4)
    )
    ids = np.asarray(ids)
    kinds = np.where(ids == image, 1, np.where(ids == video, 2, 0))
    with torch.no_grad():
        want, _ = model.model.get_rope_index(
            torch.from_numpy(ids[None]),
            torch.from_numpy(kinds[None]),
            image_grid_thw=torch.tensor([grids[0]]),
            video_grid_thw=torch.tensor(grids[1:]),
        )
    got = mrope_positions(ids, [image, video], grids, 2)
    np.testing.assert_array_equal(got, want[:, 0].numpy().T)


@pytest.mark.torch
@pytest.mark.parametrize("tokens_per_second", [1, 4, 25])
def test_qwen2_5_vl_video_positions_are_get_rope_index_in_absolute_time(
    tmp_path, tokens_per_second
):
    """Qwen2.5-VL counts video time in seconds: a JSONL record with an image and two videos of
    other lengths and frame rates (so the sampled fps is not the asked 4: floor(k x
    tokens_per_second x second_per_grid_t) is not a whole step), loaded as training loads it,
    gets M-RoPE positions equal to transformers' `get_rope_index` given the checkpoint's
    tokens_per_second and `second_per_grid_ts` of transformers' own VideoMetadata.sampled_fps
    (temporal_patch / sampled fps); with tokens_per_second 0 they are Qwen2-VL's."""
    import hf_models
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.video_utils import VideoMetadata

    write_video(tmp_path / "a.mp4", moving_frames(33, 32, 48), fps=10)  # 3.3 s: 12 of 33
    write_video(tmp_path / "b.mp4", moving_frames(23, 40, 40, "left"), fps=7)  # 12 of 23
    from PIL import Image

    Image.new("RGB", (24, 16), (200, 30, 30)).save(tmp_path / "cat.png")
    manifest = _manifest(
        tmp_path,
        [
            {
                "id": "v",
                "text": "<video>then<image>and<video>which way?",
                "videos": ["a.mp4", "b.mp4"],
                "images": ["cat.png"],
            },
        ],
    )
    cfg = _config(manifest, f"model.vision.tokens_per_second={tokens_per_second}")
    build_index(cfg, manifest, progress=False)
    source = open_source(cfg)
    sample, row = source[0], source.rows[0]
    pre = source.pre
    spg = []
    for size in row["video_sizes"]:
        info = VideoInfo.of(size)
        n = video_parts(info, pre.video_rule())[0] * 2
        meta = VideoMetadata(
            total_num_frames=info.frames,
            fps=info.rate,
            frames_indices=frame_indices(info.frames, n).tolist(),
        )
        spg.append(2 / meta.sampled_fps)
    assert spg[0] != 1 / 2 and spg[1] != 1 / 2  # (not the asked 4 fps)
    image_id, video_id = (pre.tokenizer.specials.media[k] for k in ("vision", "video"))
    ids = sample.tokens.astype(np.int64)
    kinds = np.where(ids == image_id, 1, np.where(ids == video_id, 2, 0))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        hf_models.qwen2_5_vl(tmp_path / "vl")
    )
    model.config.vision_config.tokens_per_second = tokens_per_second
    thw = [g[:3] for g in sample.grids]
    with torch.no_grad():
        want, _ = model.model.get_rope_index(
            torch.from_numpy(ids[None]),
            torch.from_numpy(kinds[None]),
            image_grid_thw=torch.tensor([thw[1]]),
            video_grid_thw=torch.tensor([thw[0], thw[2]]),
            second_per_grid_ts=torch.tensor(spg),
        )
    assert [len(g) for g in sample.grids] == [4, 3, 4]  # (videos carry their time step)
    got = mrope_positions(ids, [image_id, video_id], sample.grids, 2)
    np.testing.assert_array_equal(got, want[:, 0].numpy().T)
    qwen2_vl = mrope_positions(ids, [image_id, video_id], thw, 2)  # (a step per patch)
    assert not np.array_equal(got, qwen2_vl)  # (a case where absolute time tells)
    plain = open_source(_config(manifest))[0]  # tokens_per_second 0: Qwen2-VL's positions
    assert plain.grids == thw


def _manifest(tmp_path: Path, records: list[dict]) -> Path:
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
            *VIDEO,
            *sets,
        ],
    )


def test_jsonl_videos_index_and_load_as_the_index_counts(tmp_path):
    """`videos` and `<video>` in JSONL records: the index counts each temporal patch as a
    vision item beside the images, in placeholder order, and a loaded sample has exactly
    those items, its video slots filled by the video placeholder id."""
    write_video(tmp_path / "a.mp4", moving_frames(20, 32, 48), fps=10)
    write_video(tmp_path / "b.webm", moving_frames(12, 40, 40, "left"), fps=8)
    from PIL import Image

    Image.new("RGB", (24, 16), (200, 30, 30)).save(tmp_path / "cat.png")
    manifest = _manifest(
        tmp_path,
        [
            {"id": "v1", "text": "<video>it moves right", "videos": ["a.mp4"]},
            {
                "id": "v2",
                "messages": [
                    {"role": "user", "content": "<image>then<video>which way?"},
                    {"role": "assistant", "content": "left"},
                ],
                "images": ["cat.png"],
                "videos": ["b.webm"],
            },
        ],
    )
    cfg = _config(manifest)
    summary = build_index(cfg, manifest, progress=False)
    assert summary["accepted"] == 2 and summary["percentiles"]["videos_per_sample"]["total"] == 2
    source = open_source(cfg)
    pre = source.pre
    row = source.rows[1]
    image_grid = pre.grid(16, 24)
    info = VideoInfo.of(row["video_sizes"][0])
    count, (gh, gw) = video_parts(info, pre.video_rule())
    assert info == VideoInfo(12, 8.0, 40, 40) and count == 3  # 1.5 s at 4 fps: 6 frames
    assert row["images"] == [image_grid[0] * image_grid[1]] + [gh * gw] * count
    sample = source[1]
    assert [len(m[0]) for m in sample.media["vision"]] == row["images"]
    assert sample.media["vision"][1][0].shape[1] == cfg.model.vision.input_width
    video_id = pre.tokenizer.specials.media["video"]
    assert (sample.tokens == video_id).sum() == count * gh * gw // 4
    assert sample.grids == [(1, *image_grid), (count, gh, gw)]


def test_video_placeholders_are_a_checkpoints_own_or_its_image_token(tmp_path):
    """A Qwen tokenizer directory places a video with its own <|video_pad|> where its template
    renders the video part (ids equal transformers' apply_chat_template); a Llama one, with no
    video token, with its image placeholder: no new embedding row."""
    from test_chat import build_dir, hf_ids

    from jaxmllm.data.text.tokenizer import make_tokenizer

    qwen = build_dir(tmp_path / "qwen-vl", "qwen", "Qwen/Qwen2.5-VL-7B-Instruct")
    tk = make_tokenizer(str(qwen))
    assert tk.specials.media["video"] == tk.token_id("<|video_pad|>")
    parts = [{"type": "video"}, {"type": "text", "text": "What is in this picture?"}]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": "A cat."}]
    record = parse_record({"id": "r", "messages": messages, "videos": ["x.mp4"]}, tmp_path, 1)
    ids = [
        int(i)
        for p in tk.pieces(record)
        for i in (p[1] if p[0] == "text" else [tk.specials.media[p[0]]])
    ]
    assert ids == hf_ids(qwen, messages)
    llama = make_tokenizer(str(build_dir(tmp_path / "llama", "llama", None)))
    assert llama.specials.media["video"] == llama.specials.media["vision"]
    assert "<|jaxmllm_video|>" not in llama.added_tokens
    text = parse_record(
        {"id": "t", "text": "<video>a<image>b", "videos": ["v"], "images": ["i"]}, tmp_path, 1
    )
    assert [p for p in llama.pieces(text) if p[0] != "text"] == [("video", 0), ("vision", 0)]


def test_bad_videos_are_rejected_and_counted_naming_the_record(tmp_path):
    """Truncated, garbage, no video stream, no frame at all, too short, over the caps (length,
    frame size, frames x pixels): each a counted reject naming its record, with its reason, at
    indexing (nothing decoded); a file broken after indexing is a counted load-time reject and
    its slots stay padding."""
    good = write_video(tmp_path / "good.mp4", moving_frames(20, 32, 48), fps=10)
    data = good.read_bytes()
    (tmp_path / "cut.mp4").write_bytes(data[: len(data) // 2])  # (its index at the end: gone)
    streamed = write_video(tmp_path / "s.mp4", moving_frames(40, 32, 48), fps=10, faststart=True)
    (tmp_path / "cut2.mp4").write_bytes(streamed.read_bytes()[: streamed.stat().st_size // 2])
    (tmp_path / "junk.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    import soundfile

    soundfile.write(tmp_path / "tone.wav", np.zeros(8000, np.float32), 16000)
    write_video(tmp_path / "blip.mp4", moving_frames(1, 32, 48), fps=10)  # (one frame)
    write_video(tmp_path / "long.mkv", grey_frames(50, 32, 48), fps=1)
    write_empty(tmp_path / "empty.mp4")  # (a stream, no frame)
    write_empty(tmp_path / "empty.webm")
    write_video(tmp_path / "wide.mp4", grey_frames(4, 64, 128), fps=10)  # (8192 pixels a frame)
    write_video(tmp_path / "many.mp4", moving_frames(100, 32, 48), fps=10)  # (153600 decoded)
    names = (
        "good.mp4",
        "cut.mp4",
        "cut2.mp4",
        "junk.mp4",
        "tone.wav",
        "blip.mp4",
        "long.mkv",
        "missing.mp4",
        "empty.mp4",
        "empty.webm",
        "wide.mp4",
        "many.mp4",
    )
    records = [{"id": f"r-{name}", "text": "<video>x", "videos": [name]} for name in names]
    records.append({"id": "r-count", "text": "<video><video>x", "videos": ["good.mp4"]})
    manifest = _manifest(tmp_path, records)
    caps = [
        "data.max_video_seconds=30",
        "data.max_image_pixels=4096",
        "data.max_video_decoded_pixels=100000",
        f"data.index_dir={manifest}.index",
        "data.min_accept=0",
    ]  # (mostly bad on purpose)
    cfg = _config(manifest, *caps)
    summary = build_index(cfg, manifest, progress=False)
    assert summary["accepted"] == 1
    assert summary["rejects"] == {
        "undecodable_media": 6,
        "video_too_short": 1,
        "video_too_large": 3,
        "missing_media": 1,
        "placeholder_mismatch": 1,
    }
    rejects = [json.loads(x) for x in (Path(f"{manifest}.index") / "rejects.jsonl").open()]
    why = {r["id"]: (r["reason"], r["detail"]) for r in rejects}
    assert set(why) == {f"r-{name}" for name in names[1:]} | {"r-count"}
    assert "truncated" in why["r-cut2.mp4"][1] and "no video stream" in why["r-tone.wav"][1]
    assert why["r-empty.mp4"][0] == why["r-empty.webm"][0] == "undecodable_media"
    assert "data.max_video_seconds=30" in why["r-long.mkv"][1]
    assert "128x64" in why["r-wide.mp4"][1] and "data.max_image_pixels=4096" in why["r-wide.mp4"][1]
    assert "100 frames" in why["r-many.mp4"][1]
    assert "data.max_video_decoded_pixels=100000" in why["r-many.mp4"][1]
    # Broken after indexing: a load-time reject, counted, logged with its id; no crash.
    (tmp_path / "good.mp4").write_bytes(data[:200])
    source = open_source(cfg)
    loader = Loader(cfg, source, tmp_path / "run" / "rejects.jsonl")
    assert loader.load(np.array([0]), step=0) == {0: None}
    assert loader.counts()["rejects/load_undecodable_media"] == 1.0
    with pytest.raises(RecordError, match="r-good.mp4.*undecodable_media"):
        source.load(0)


def test_videos_need_the_vision_encoder_to_take_them(tmp_path):
    write_video(tmp_path / "a.mp4", moving_frames(20, 32, 48), fps=10)
    manifest = _manifest(tmp_path, [{"id": "v", "text": "<video>x", "videos": ["a.mp4"]}])
    cfg = _config(manifest)
    build_index(cfg, manifest, progress=False)
    with pytest.raises(ConfigError, match="1 video.*model.vision.video: true"):
        open_source(_config(manifest, "model.vision.video=false"))
    with pytest.raises(ConfigError, match="data.synthetic.video_fraction: needs model.vision.vid"):
        load_config(
            "configs/tiny.yaml", ["model.vision.video=false", "data.synthetic.video_fraction=0.1"]
        )


def test_the_index_says_when_training_would_refuse_its_videos(tmp_path, capsys):
    """The index accepted the user's videos and only training refused them: the index says
    so when it has counted them, naming the key (exit 2; its sizes were for images only)."""
    from jaxmllm.data.index import main

    write_video(tmp_path / "a.mp4", moving_frames(20, 32, 48), fps=10)
    manifest = _manifest(tmp_path, [{"id": "v", "text": "<video>x", "videos": ["a.mp4"]}])
    sets = ["data.source=jsonl", f"data.path={manifest}", "data.video_fps=4", *VIDEO]
    sets += ["data.video_frame_min_pixels=64", "data.video_max_pixels=8192"]
    argv = ["--config", "configs/tiny.yaml", "--workers", "0", "--set", *sets]
    assert main([*argv, "model.vision.video=false"]) == 2
    err = capsys.readouterr().err
    assert "has 1 video(s), but model.vision.video is false" in err, err
    assert main(argv) == 0


def test_oversize_videos_shrink_then_cut_or_skip(tmp_path):
    """A video too long for the LLM row: shrink lowers its pixel budget, then keeps its first
    temporal patches; skip drops it; every one counted at start-up."""
    write_video(tmp_path / "a.mp4", moving_frames(40, 64, 96), fps=10)
    manifest = _manifest(
        tmp_path,
        [{"id": "v", "text": "<video>x", "videos": ["a.mp4"]}, {"id": "t", "text": "short text"}],
    )
    sets = ["batch.capacity=fixed", "data.video_max_pixels=40000", "batch.llm_row_len=64"]
    cfg = _config(manifest, *sets)
    build_index(cfg, manifest, progress=False)
    params = Params.from_config(cfg)
    pre = Preprocessor(params)
    full = pre.layout(
        parse_record({"id": "v", "text": "<video>x", "videos": ["a.mp4"]}, tmp_path, 1),
        pre.sizes(parse_record({"id": "v", "text": "<video>x", "videos": ["a.mp4"]}, tmp_path, 1)),
    )
    assert full.counts()["text"] + sum(full.counts()["images"]) // 4 > 64
    shrunk = open_source(cfg)
    (entry,) = shrunk.startup_rejects
    assert entry["action"] == "shrink" and entry["limits"]["video_pixels"] < 40000
    assert len(shrunk) == 2 and shrunk.index.llm_tokens({"vision": 4, "audio": 4}).max() <= 64
    sample = shrunk[0]
    assert len(sample.tokens) <= 64 and sample.grids[0][0] >= 1
    skipped = open_source(_config(manifest, *sets, "data.on_oversize=skip"))
    assert len(skipped) == 1 and skipped.startup_rejects[0]["action"] == "skip"


@pytest.mark.torch
def test_qwen2_vl_with_a_video_matches_transformers(processor, tmp_path):
    """A whole Qwen2-VL with an image and a video in the prompt: its tower encodes the video's
    temporal patches (each attending within itself) and the image, the merger's rows fill the
    video and image pads, M-RoPE places them on their grids; the logits of every token equal
    transformers' given the processor's patches of the same decoded frames."""
    import jax.numpy as jnp
    from hf_models import qwen2_vl

    from jaxmllm.data.media.image import patchify
    from jaxmllm.hf.check import hf_module
    from jaxmllm.hf.towers import config_for, load_towers

    cls, proc, _ = processor
    source = qwen2_vl(tmp_path / "qwen2_vl")
    llm = load_towers(config_for("llm", source), "llm").llm
    tower = load_towers(config_for("vision", source, llm_width=64), "vision")
    path = write_video(tmp_path / "m.mp4", moving_frames(30, 32, 48), fps=10)
    info = read_video_info(path)
    r = rule(patch=4, merge=2, fps=4.0, frame_min_pixels=64, max_pixels=32 * 48 * 6)
    t, (gh, gw) = video_parts(info, r)
    assert t == 6 and (gh, gw) == (8, 12)
    video = [(PIXELS.normalise(v), p) for v, p in load_video(path, info, r, "m")]
    rng = np.random.default_rng(0)
    image = rng.normal(size=(16, 8, 3)).astype(np.float32)
    img_patches, img_pos = patchify(image, 4, 2)
    # Our vision row: the image (its frame repeated, as bucketize fills it) and the video's
    # temporal patches, each its own segment.
    items = [(np.tile(img_patches, (1, 2)), img_pos), *video]
    patches = np.concatenate([v for v, _ in items])
    segments = np.concatenate([np.full(len(v), k + 1) for k, (v, _) in enumerate(items)])
    positions = np.concatenate([p for _, p in items])
    feats = tower.vision(
        jnp.asarray(patches)[None],
        jnp.asarray(segments, jnp.int32)[None],
        jnp.asarray(positions)[None],
    )
    rows = np.asarray(tower.vision_projector(feats)[0])
    image_id, video_id, start, end = 290, 291, 292, 293
    text = lambda n: list(rng.integers(0, 290, n))
    n_img = len(img_patches) // 4
    ids = np.asarray(
        text(4)
        + [start]
        + [image_id] * n_img
        + [end]
        + text(3)
        + [start]
        + [video_id] * (len(rows) - n_img)
        + [end]
        + text(5),
        np.int32,
    )
    grids = [(1, 4, 2), (t, gh, gw)]
    x = llm.embed(jnp.asarray(ids)[None])
    x = x.at[0, np.flatnonzero(ids == image_id)].set(rows[:n_img])
    x = x.at[0, np.flatnonzero(ids == video_id)].set(rows[n_img:])
    pos = mrope_positions(ids, [image_id, video_id], grids, 2)
    ours = llm(x, jnp.ones((1, len(ids)), jnp.int32), jnp.asarray(pos)[None])[0]

    ref = hf_module(source, json.loads((tmp_path / "qwen2_vl" / "config.json").read_text()), "llm")
    gh_, gw_ = frame_grid(info, 2 * t, r)
    frames = decode_frames(
        path, info, frame_indices(info.frames, 2 * t).tolist(), (gw_ * 4, gh_ * 4), "m"
    )
    normal = (np.stack(frames).astype(np.float32) / 255 - 0.5) / 0.5
    clip = torch.from_numpy(normal.transpose(0, 3, 1, 2)[None])
    pixel_values_videos = cls.patchify(proc, clip, 4, 2, 2)[0][0]
    still = img_patches.reshape(-1, 4, 4, 3).transpose(0, 3, 1, 2)[:, :, None]
    pixel_values = torch.from_numpy(np.repeat(still, 2, axis=2).reshape(len(still), -1))
    kinds = np.where(ids == image_id, 1, np.where(ids == video_id, 2, 0))
    with torch.no_grad():
        out = ref(
            input_ids=torch.from_numpy(ids[None].astype(np.int64)),
            pixel_values=pixel_values,
            image_grid_thw=torch.tensor([grids[0]]),
            pixel_values_videos=pixel_values_videos,
            video_grid_thw=torch.tensor([grids[1]]),
            mm_token_type_ids=torch.from_numpy(kinds[None]),
        )
    theirs = out.logits[0].numpy()
    assert np.abs(theirs).max() > 0.5
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4)


@pytest.mark.slow  # (~65 s of CPU, 2 min on a shared box: a routed step, its samples alone)
def test_routed_step_with_videos_equals_samples_one_by_one(tmp_path):
    """Videos from files, decoded by PyAV, in a planned step whose every vision item (an image,
    a video's temporal patch) is encoded on another device than its text, a video's temporal
    patches spread over several: loss and gradients equal each sample computed alone on one
    device, unpacked."""
    import dataclasses

    import jax
    from PIL import Image
    from test_orchestration import assert_equals_alone, one_sample_batch, repack

    import sharding
    from jaxmllm.batch.bucketize import bucketize
    from jaxmllm.resolve.run import resolve_run
    from jaxmllm.resolve.sizing import capacities, planner_from_config
    from jaxmllm.step.program import build_program, make_loss_and_grads, model_parts

    for k, (n, h, w, way) in enumerate(
        [(20, 32, 48, "left"), (31, 40, 40, "right"), (12, 48, 32, "left")]
    ):
        write_video(tmp_path / f"v{k}.mp4", moving_frames(n, h, w, way), fps=10)
    Image.new("RGB", (24, 16), (200, 30, 30)).save(tmp_path / "cat.png")
    ask = "which way does it move? "
    manifest = _manifest(
        tmp_path,
        [
            {"id": "a", "text": f"<video>{ask}left", "videos": ["v0.mp4"]},
            {"id": "b", "text": f"<video>{ask}right", "videos": ["v1.mp4"]},
            {
                "id": "c",
                "text": "<image>a red square<video>and it moves left",
                "images": ["cat.png"],
                "videos": ["v2.mp4"],
            },
            {"id": "d", "text": "<image>what is this? a red square", "images": ["cat.png"]},
            {"id": "e", "text": "1 2 3 4 5 6 7 8 9"},
        ],
    )
    cfg = _config(
        manifest,
        "batch.route_pair_capacity=160",
        "batch.capacity=fixed",
        "batch.vision_patches=640",
        "batch.audio_frames=128",
    )
    build_index(cfg, manifest, progress=False)
    run = resolve_run(cfg)
    cfg, source = run.cfg, run.source
    blocks = cfg.batch.vision_patches // cfg.batch.attention_block  # (room for the moves)
    cfg = dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, vision_tiles=blocks**2))
    mesh = sharding.make_mesh(cfg.mesh)
    devices = sharding.data_parallel_size(mesh)
    plan = planner_from_config(cfg, source.index, devices).plan()
    vision, index = plan.items["vision"], source.index.items["vision"]
    home = plan.device[vision.owner]
    vision.device = (home + 1 + vision.item) % devices  # (a video's patches over devices)
    repack(vision, plan, index.sizes, index.ptr)
    host = bucketize(
        plan,
        {int(s): source[int(s)] for s in plan.samples},
        cfg,
        capacities(cfg, devices),
        specials=source.specials,
    )
    videos = [int(s) for s in plan.samples if source.rows[int(s)]["video_sizes"]]
    assert set(videos) == {0, 1, 2} and (vision.device != home).all()  # (some twice: epochs)
    with jax.set_mesh(mesh):
        prog = build_program(cfg, mesh)
        state = prog.init()
        got = jax.jit(make_loss_and_grads(prog.parts))(
            state["params"], state["frozen"], sharding.make_global_batch(host, mesh)
        )
    params, frozen = jax.device_get((state["params"], state["frozen"]))
    ref_cfg, _ = one_sample_batch(cfg, int(plan.samples[0]), source, source.index)
    reference = jax.jit(make_loss_and_grads(model_parts(ref_cfg)[0]))
    alone = (one_sample_batch(cfg, s, source, source.index)[1] for s in plan.samples.tolist())
    assert_equals_alone(got, reference, (params, frozen), alone, host)
