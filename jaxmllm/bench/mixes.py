"""Built-in workloads for the balancer: a synthetic three-modality mix and the real tables.

- `omni`: synthetic, strong modality-composition incoherence: text-only chats, native-resolution
  single images, multi-image documents, video (many frames, some with an audio track) and audio
  clips, each with its own text length distribution.
- `ai2d`, `chartqa`: real per-sample lengths of two vision-language sets as prepared for InternVL
  (shipped beside this module in `lengths/`, see its README).
- `video`: video-heavy, half of it videos of 64-256 sampled frames (`long_video`), each a
  vision item per temporal patch sized by the data pipeline's own video rule; `video_mix(seed)`
  draws a family of such workloads for held-out checks (`bench.balance --random N --family
  video`).
- `interleaved`, `speech`, `longtail` and the families `docqa_mix`, `chats_mix`: long-tailed
  workloads drawn vectorised at any size (`jaxmllm.bench.tails`).

Lengths files are read in the DESIGN.md JSONL format (`{"text": 312, "images": [1024]}` a line) or
in the InternVL JSON format (`[{"vit_num": 3, "token_num": 811}, ...]`), detected by content;
either may be gzipped (`.gz`). A record that is not of that form (a field of the wrong type, a
negative count) is refused with its line named. Lengths are rounded as the data pipeline
rounds real media: image patches down to a multiple of the merge area (the pipeline resizes
images to whole merge windows) and audio frames down to a multiple of the subsampling factor
(`jaxmllm.data.media.audio.clip_frames`); an item that rounds to nothing is dropped from its sample,
and a sample left with no LLM tokens is dropped; both are counted and logged (`rounded`).
"""

from __future__ import annotations

import gzip
import json
import logging
import resource
import time
from pathlib import Path

import numpy as np

from jaxmllm.bench import tails
from jaxmllm.config import Config, UserError, load_config
from jaxmllm.data.lengths import Items, LengthsIndex
from jaxmllm.data.media.video import VideoInfo, VideoRule, video_parts

INTERNVL_TILE_PATCHES = 1024  # 448 px tile / 14 px patches, squared
INTERNVL_TILE_TOKENS = 256  # after pixel shuffle (merge 2 x 2)


LENGTHS_DIR = Path(__file__).resolve().parent / "lengths"
log = logging.getLogger(__name__)


def from_arrays(
    text: np.ndarray, images: list[np.ndarray], audio: list[np.ndarray]
) -> LengthsIndex:
    """A lengths index from per-sample text counts and per-sample item arrays."""

    def ragged(items):
        ptr = np.cumsum([0] + [len(x) for x in items]).astype(np.int64)
        flat = np.concatenate([np.asarray(x, np.int64) for x in items]) if items else []
        return Items(ptr, np.asarray(flat, np.int64))

    return LengthsIndex(
        text=np.asarray(text, np.int64), items={"vision": ragged(images), "audio": ragged(audio)}
    )


def synthetic_omni(num_samples: int = 20000, seed: int = 0, merge: int = 2) -> LengthsIndex:
    """Text chats, native-resolution images, multi-image, video frames and audio clips.

    Shares: 35% text-only chats (long-tailed, up to 6k tokens), 22% single images of 16..64
    patches a side, 10% documents of 2-6 images, 10% videos of 8-32 frames of 16x16 patches
    (a third of them with an audio track), 23% audio clips of 1-30 s (100 frames a second).
    """
    rng = np.random.default_rng([seed, 7])
    kind = rng.choice(5, size=num_samples, p=[0.35, 0.22, 0.10, 0.10, 0.23])
    text = np.zeros(num_samples, np.int64)
    images: list[np.ndarray] = [np.zeros(0, np.int64)] * num_samples
    audio: list[np.ndarray] = [np.zeros(0, np.int64)] * num_samples
    chats = kind == 0
    text[chats] = np.clip(rng.lognormal(6.3, 0.9, chats.sum()), 24, 6000).astype(np.int64)
    others = ~chats
    text[others] = np.clip(rng.lognormal(4.6, 0.8, others.sum()), 8, 800).astype(np.int64)

    def side(n, lo, hi):  # native resolution: sides in patches, multiples of the merge factor
        return merge * rng.integers(lo // merge, hi // merge + 1, size=n)

    for i in np.flatnonzero(kind == 1):
        images[i] = side(1, 16, 64) * side(1, 16, 64)
    for i in np.flatnonzero(kind == 2):
        n = int(rng.integers(2, 7))
        images[i] = side(n, 16, 40) * side(n, 16, 40)
    for i in np.flatnonzero(kind == 3):
        frames = int(rng.integers(8, 33))
        images[i] = np.full(frames, 256, np.int64)
        if rng.random() < 1 / 3:
            audio[i] = np.array([4 * int(frames * 25 * rng.uniform(0.8, 1.0))], np.int64)
    for i in np.flatnonzero(kind == 4):
        audio[i] = np.array([4 * int(rng.integers(25, 751))], np.int64)
    return from_arrays(text, images, audio)


RANDOM_KINDS = ("chat", "image", "multi_image", "video", "video_audio", "audio", "image_audio")


def random_mix(
    seed: int, num_samples: int = 20000, merge: int = 2, subsample: int = 4
) -> LengthsIndex:
    """A workload drawn at random, for holding the balancer to data it was not tuned on.

    Per mix, drawn from `seed`: the share of each kind of sample (`RANDOM_KINDS`, a Dirichlet
    draw, so some mixes are nearly one kind and some even), and per kind its text length
    distribution (log-normal, median 16-2000 tokens, spread 0.2-1.2; chats up to 16k tokens,
    the rest up to 4k). Media: native-resolution images of 2-100 patches a side (up to 10k
    patches; the side distribution drawn per mix), multi-image samples of 2 up to 3-8 smaller
    images, videos of 8 up to 16-64 frames of one size each (6-24 patches a side), audio clips
    of 1 up to 5-30 s at 100 frames a second of any frame count (rounded down to `subsample`
    as the pipeline rounds real clips: `rounded`), and tracks beside videos and images.
    """
    rng = np.random.default_rng([seed, 18])
    k = len(RANDOM_KINDS)
    kind = rng.choice(k, size=num_samples, p=rng.dirichlet(np.full(k, 0.5)))
    median = np.exp(rng.uniform(np.log(16), np.log(2000), k))
    spread = rng.uniform(0.2, 1.2, k)
    longest = np.where(np.arange(k) == RANDOM_KINDS.index("chat"), 16384, 4096)
    text = rng.lognormal(np.log(median[kind]), spread[kind])
    text = np.clip(text, 1, longest[kind]).astype(np.int64)
    img_side = np.exp(rng.uniform(np.log(6), np.log(60)))  # median side of single images
    most_images, most_frames = int(rng.integers(3, 9)), int(rng.integers(16, 65))
    most_seconds = rng.uniform(5, 30)

    def sides(n, med, hi):  # native resolution: patches a side, whole merge windows
        s = np.clip(rng.lognormal(np.log(med), 0.5, size=n), 2, hi)
        return (np.ceil(s / merge) * merge).astype(np.int64)

    def clip():  # frames of 1..most_seconds at 100 a second, any count
        return np.array([int(100 * np.exp(rng.uniform(0, np.log(most_seconds))))], np.int64)

    images: list[np.ndarray] = [np.zeros(0, np.int64)] * num_samples
    audio: list[np.ndarray] = [np.zeros(0, np.int64)] * num_samples
    for i, kd in enumerate(kind):
        name = RANDOM_KINDS[kd]
        if name in ("image", "image_audio"):
            images[i] = sides(1, img_side, 100) * sides(1, img_side, 100)
        elif name == "multi_image":
            n = int(rng.integers(2, most_images + 1))
            images[i] = sides(n, img_side / 2, 50) * sides(n, img_side / 2, 50)
        elif name in ("video", "video_audio"):
            side = int(sides(1, 12, 24)[0])
            images[i] = np.full(int(rng.integers(8, most_frames + 1)), side * side, np.int64)
        if name in ("audio", "video_audio", "image_audio"):
            audio[i] = clip()
    return rounded(from_arrays(text, images, audio), merge * merge, subsample)[0]


# Source videos: (height, width) and frame rates, as a crawl of the web holds them
RESOLUTIONS = ((480, 854), (720, 1280), (1080, 1920), (1920, 1080), (480, 640), (360, 640))
RATES = (24.0, 25.0, 30.0, 60.0)


def video_items(
    rng: np.random.Generator, seconds: float, budget_tokens: int, fps: float = 2.0, merge: int = 2
) -> np.ndarray:
    """A video's vision items (patches per temporal patch), from a source of `seconds` at a
    random resolution and rate, by the pipeline's video rule (`jaxmllm.data.media.video`:
    Qwen2-VL's, patch 14, temporal patch 2) with a budget of about `budget_tokens` LLM tokens."""
    height, width = RESOLUTIONS[int(rng.integers(len(RESOLUTIONS)))]
    rate = RATES[int(rng.integers(len(RATES)))]
    unit = 14 * merge
    rule = VideoRule(
        fps=fps,
        min_frames=4,
        max_frames=768,
        frame_min_pixels=unit * unit,
        frame_max_pixels=768 * unit * unit,
        max_pixels=budget_tokens * unit * unit,
        temporal_patch=2,
        patch=14,
        merge=merge,
    )
    count, (gh, gw) = video_parts(VideoInfo(max(1, int(seconds * rate)), rate, height, width), rule)
    return np.full(count, gh * gw, np.int64)


def long_video(num_samples: int = 20000, seed: int = 0, budget_tokens: int = 8192) -> LengthsIndex:
    """Video-heavy: 50% videos of 32-128 s sampled at 2 fps (64-256 frames), 15% short clips of
    4-16 s, 15% native-resolution images of 16..64 patches a side, 20% text chats; every video
    about `budget_tokens` LLM tokens however long (its budget split over its frames), its
    frames from 360p to 1080p sources."""
    rng = np.random.default_rng([seed, 31])
    kind = rng.choice(4, size=num_samples, p=[0.20, 0.15, 0.15, 0.50])
    text = np.clip(rng.lognormal(4.6, 0.8, num_samples), 8, 800).astype(np.int64)
    chats = kind == 0
    text[chats] = np.clip(rng.lognormal(6.3, 0.9, chats.sum()), 24, 6000).astype(np.int64)
    images: list[np.ndarray] = [np.zeros(0, np.int64)] * num_samples
    for i in np.flatnonzero(kind == 1):
        images[i] = np.array([4 * int(rng.integers(8, 33)) * int(rng.integers(8, 33))])
    for i in np.flatnonzero(kind >= 2):
        seconds = rng.uniform(4, 16) if kind[i] == 2 else rng.uniform(32, 128)
        images[i] = video_items(rng, seconds, budget_tokens)
    return from_arrays(text, images, [np.zeros(0, np.int64)] * num_samples)


VIDEO_KINDS = ("chat", "image", "short_video", "long_video", "video_image")


def video_mix(seed: int, num_samples: int = 20000) -> LengthsIndex:
    """A video-heavy workload drawn at random (the held-out family of `long_video`): per seed
    the kinds' shares (`VIDEO_KINDS`, a Dirichlet draw, long videos at least a third), the
    videos' token budget (1k-16k), the longest video (60-300 s) and the sampling rate (1-2
    fps), text lengths log-normal per kind."""
    rng = np.random.default_rng([seed, 32])
    share = rng.dirichlet(np.full(len(VIDEO_KINDS), 0.7))
    share = 0.67 * share + 0.33 * (np.arange(len(VIDEO_KINDS)) == 3)
    kind = rng.choice(len(VIDEO_KINDS), size=num_samples, p=share)
    budget = int(np.exp(rng.uniform(np.log(1024), np.log(16384))))
    longest, fps = rng.uniform(60, 300), float(rng.choice([1.0, 2.0]))
    median = np.exp(rng.uniform(np.log(16), np.log(1000), len(VIDEO_KINDS)))
    text = np.clip(rng.lognormal(np.log(median[kind]), 0.8), 1, 8000).astype(np.int64)
    images: list[np.ndarray] = [np.zeros(0, np.int64)] * num_samples
    for i, k in enumerate(kind.tolist()):
        name = VIDEO_KINDS[k]
        still = lambda: np.array([4 * int(rng.integers(4, 41)) * int(rng.integers(4, 41))])
        if name == "image":
            images[i] = still()
        elif name != "chat":
            seconds = rng.uniform(2, 20) if name == "short_video" else rng.uniform(20, longest)
            clip = video_items(rng, seconds, budget, fps)
            images[i] = np.concatenate([still(), clip]) if name == "video_image" else clip
    return from_arrays(text, images, [np.zeros(0, np.int64)] * num_samples)


def load_internvl(path: str | Path) -> LengthsIndex:
    """Reads an InternVL length table (`vit_num` tiles, `token_num` LLM tokens incl. tiles)."""
    return _from_internvl(json.loads(_read_text(path)), str(path))


def _from_internvl(recs: list, where: str) -> LengthsIndex:
    try:
        tiles = np.array([int(r["vit_num"]) for r in recs], np.int64)
        tokens = np.array([int(r["token_num"]) for r in recs], np.int64)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: not an InternVL table (vit_num, token_num): {e}") from None
    text = tokens - INTERNVL_TILE_TOKENS * tiles
    if (text < 0).any():
        bad = int(np.flatnonzero(text < 0)[0])
        raise ValueError(f"{where}: entry {bad} has fewer tokens than its tiles need")
    imgs = [np.full(t, INTERNVL_TILE_PATCHES, np.int64) for t in tiles]
    return from_arrays(text, imgs, [np.zeros(0, np.int64)] * len(tiles))


def lengths_of(path: str | Path) -> LengthsIndex:
    """The lengths at `path`: a columnar index folder (`jaxmllm.data.stored.open_lengths`:
    mapped) or a lengths file (`load_lengths`: parsed); prints how long that took and the
    process's peak resident memory after it."""
    from jaxmllm.data.stored import open_lengths

    started = time.perf_counter()
    folder = Path(path).is_dir()
    index = open_lengths(path) if folder else load_lengths(path)
    took, how = time.perf_counter() - started, "mapped" if folder else "parsed"
    peak = f"peak resident memory {peak_rss_mb():.0f} MB"
    print(f"{path}: {len(index)} samples {how} in {took:.2f} s, {peak}")
    return index


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


def load_lengths(path: str | Path, merge_area: int = 4, subsample: int = 4) -> LengthsIndex:
    """Reads a lengths file: DESIGN.md JSONL, or an InternVL JSON table (detected); lengths
    rounded to the phases' granularity (see the module docstring), what was dropped logged."""
    path = Path(path)
    text = _read_text(path)
    head = text.lstrip()[:1]
    if head == "[":
        return _from_internvl(json.loads(text), str(path))
    records = []
    for k, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{k}: not JSON: {e}") from None
        if isinstance(rec, dict) and "vit_num" in rec:
            return _from_internvl(
                [json.loads(x) for x in text.splitlines() if x.strip()], str(path)
            )
        records.append(_checked(rec, f"{path}:{k}"))
    if not records:
        raise ValueError(f"{path}: no records (one JSON object a line)")
    index, dropped = rounded(LengthsIndex.from_records(records), merge_area, subsample)
    if not len(index):
        raise ValueError(f"{path}: no sample has an LLM token after rounding: {dropped}")
    if any(dropped.values()):
        log.warning("%s: lengths rounded to the phases' granularity: %s", path, dropped)
    return index


def _checked(rec: object, where: str) -> dict:
    """One lengths record, or a ValueError naming where it is and what to change."""
    if not isinstance(rec, dict):
        raise ValueError(f'{where}: expected an object like {{"text": 312, "images": [1024]}}')
    unknown = set(rec) - {"text", "images", "audio"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}: text, images, audio")
    text = rec.get("text", 0)
    if not _count(text):
        raise ValueError(f"{where}: text must be a count of tokens >= 0, got {text!r}")
    for key in ("images", "audio"):
        items = rec.get(key, [])
        if not isinstance(items, list) or not all(_count(v) for v in items):
            what = "patch counts" if key == "images" else "frame counts"
            raise ValueError(f"{where}: {key} must be a list of {what} >= 0, got {items!r}")
    return rec


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def rounded(
    index: LengthsIndex, merge_area: int, subsample: int
) -> tuple[LengthsIndex, dict[str, int]]:
    """`index` with image patches rounded down to a multiple of `merge_area` and audio frames
    to a multiple of `subsample`, items that round to 0 dropped from their samples and samples
    left with no LLM tokens dropped; and the counts of what was dropped or changed."""
    vis, aud_items = index.items["vision"], index.items["audio"]
    img = vis.sizes // merge_area * merge_area
    aud = aud_items.sizes // subsample * subsample
    counts = {
        "images_rounded": int((vis.sizes != img).sum()),
        "audio_rounded": int((aud_items.sizes != aud).sum()),
        "images_dropped": int((img == 0).sum()),
        "audio_dropped": int((aud == 0).sum()),
    }
    per_token = {"vision": merge_area, "audio": subsample}
    same = LengthsIndex(
        text=index.text, items={"vision": Items(vis.ptr, img), "audio": Items(aud_items.ptr, aud)}
    )
    keep = same.llm_tokens(per_token) > 0
    counts["samples_dropped"] = int((~keep).sum())
    new_id = np.cumsum(keep) - 1  # a kept sample's position in the result

    def kept(values, ptr):  # the non-zero items of kept samples, and their new pointers
        owner = np.repeat(np.arange(len(index)), np.diff(ptr))
        mask = (values > 0) & keep[owner]
        per = np.bincount(new_id[owner[mask]], minlength=int(keep.sum()))
        return values[mask], np.concatenate([[0], np.cumsum(per)]).astype(np.int64)

    (images, images_ptr), (audio, audio_ptr) = kept(img, vis.ptr), kept(aud, aud_items.ptr)
    out = LengthsIndex(
        text=index.text[keep],
        items={"vision": Items(images_ptr, images), "audio": Items(audio_ptr, audio)},
    )
    return out, counts


BUILT_IN_PATCH = 14  # the built-in mixes' images and video frames are in patches of 14 px


def repatched(index: LengthsIndex, patch: int, merge: int = 2) -> LengthsIndex:
    """`index` (a built-in mix: its images in patches of 14 px) with each image's and video
    frame's pixels in patches of `patch` px: n x (14 / patch)^2 patches, to the nearest whole
    merge block (at least one), as the pipeline resizes an image to whole merge windows."""
    vis = index.items["vision"]
    area = merge * merge
    scaled = vis.sizes * (BUILT_IN_PATCH / patch) ** 2 / area
    sizes = np.maximum(np.rint(scaled), 1).astype(np.int64) * area
    items = {**index.items, "vision": Items(vis.ptr, sizes)}
    return LengthsIndex(text=index.text, items=items)


def _read_text(path: Path) -> str:
    """A file's text, gunzipped when its name ends in .gz."""
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            return f.read()
    return path.read_text()


def _table(name: str, samples: int = 0) -> LengthsIndex:
    """A shipped length table (its size is its own)."""
    if samples:
        raise ValueError(f"{name} is a table of real lengths: its size is fixed (drop --samples)")
    return load_internvl(LENGTHS_DIR / f"{name}_internvl.json.gz")


# name -> (seed, samples: 0 for the mix's default size) -> index
MIXES = {
    "omni": lambda seed=0, samples=0: synthetic_omni(samples or 20000, seed=seed),
    "video": lambda seed=0, samples=0: long_video(samples or 20000, seed=seed),
    "ai2d": lambda seed=0, samples=0: _table("ai2d", samples),
    "chartqa": lambda seed=0, samples=0: _table("chartqa", samples),
    "interleaved": lambda seed=0, samples=0: tails.interleaved(samples or 20000, seed),
    "speech": lambda seed=0, samples=0: tails.speech(samples or 20000, seed),
    "longtail": lambda seed=0, samples=0: tails.longtail(samples or 200_000, seed),
}


# --random's families: name -> (seed, samples: 0 for the family's default size) -> index
FAMILIES = {
    "random": lambda seed, samples=0: random_mix(seed, samples or 20000),
    "video": lambda seed, samples=0: video_mix(seed, samples or 20000),
    "docqa": lambda seed, samples=0: tails.docqa_mix(seed, samples or 200_000),
    "chats": lambda seed, samples=0: tails.chats_mix(seed, samples or 200_000),
}


def load_mix(name: str, seed: int = 0, samples: int = 0) -> LengthsIndex:
    """A built-in mix by name (see MIXES), of `samples` samples (0: its default size; the
    synthetic ones only)."""
    if name not in MIXES:
        raise UserError(f"--mix: unknown mix {name!r}; built-in mixes: {', '.join(MIXES)}")
    return MIXES[name](seed, samples)


# ----------------------------------------------------------------------------- benches' start-up


def bench_config(config: str, default: str) -> Config:
    """A bench's `--config`: `default` (a path in the checkout) found from wherever the bench
    runs, any other as given."""
    here = Path(__file__).resolve().parents[2] / default
    return load_config(here if config == default and not Path(default).exists() else config)


def units_per_token(cfg: Config) -> dict[str, int]:
    """Encoder units an LLM token takes, per phase: the vision merge's area, the audio
    subsampling."""
    v = cfg.model.vision
    return {"vision": v.merge * v.merge, "audio": cfg.model.audio.subsample}


def length_tables(cfg: Config, mix: str, lengths: str | None) -> list[tuple[str, LengthsIndex]]:
    """The length tables a bench plans, in `cfg`'s patches: `--lengths FILE`'s, else each
    comma-separated `--mix` name's, as (name, index). OSError / ValueError: a table that
    cannot be read."""
    v = cfg.model.vision
    if lengths:
        return [(Path(lengths).name, load_lengths(lengths, v.merge * v.merge))]
    return [(m, repatched(load_mix(m), v.patch_size, v.merge)) for m in mix.split(",")]
