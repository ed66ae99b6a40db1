"""Long-tailed workloads at the scale people train on, drawn vectorised (a million samples in
about a second): what the long variant of a step (`jaxmllm.plan.ladder`) and the sizing on a
sample of the index (`jaxmllm.plan.summary`) are measured on.

- `longtail`: text lognormal around 245 tokens (sigma 0.9), 0-4 images of 256-4,096 patches:
  the longest document grows with the data set (12k LLM tokens among 20k samples, 18k among a
  million) while a device's mean need does not.
- `interleaved`: web documents of text and 1-12 images (OBELICS / MMC4-like), 20k samples.
- `speech`: speech recognition and spoken questions (clips of 1-30 s at 100 frames a second,
  their transcripts) beside text chats, 20k samples.
- `docqa_mix(seed)`: a family of document-QA workloads: questions over documents of a few
  thousand tokens, some with page images, and a rare tail of documents of 16k-30k tokens.
- `chats_mix(seed)`: a family of chat workloads: text chats with a long tail of long
  conversations, mixed with images, video clips and audio clips.

Sizes are in model units, rounded as the data pipeline rounds them (patches to whole merge
windows of 4, frames to whole subsampled rows of 4), so that `jaxmllm.bench.mixes.rounded`
would change nothing.
"""

from __future__ import annotations

import numpy as np

from jaxmllm.data.lengths import Items, LengthsIndex

MERGE_AREA = 4  # patches per LLM token (a 2 x 2 merge)
SUBSAMPLE = 4  # audio frames per LLM token


def ragged(counts: np.ndarray, sizes: np.ndarray) -> Items:
    """Items of `counts` per sample whose sizes are `sizes` (in order, counts.sum() of them)."""
    ptr = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=ptr[1:])
    return Items(ptr, np.asarray(sizes, np.int64))


def index_of(text: np.ndarray, vision: Items | None = None, audio: Items | None = None):
    """A lengths index of text tokens and the phases' items (none where None)."""
    items = {k: v for k, v in (("vision", vision), ("audio", audio)) if v is not None}
    return LengthsIndex(text=np.maximum(np.asarray(text, np.int64), 1), items=items)


def _round(x: np.ndarray, unit: int, least: int) -> np.ndarray:
    """x rounded down to a multiple of `unit`, at least `least`."""
    return np.maximum(np.asarray(x, np.int64) // unit * unit, least)


def _lognormal(rng, median, sigma, size, lo=1, hi=None) -> np.ndarray:
    """`size` integers drawn log-normal around `median` with log-scale spread `sigma`, clipped to
    [lo, hi]: the long-tailed lengths real data sets have."""
    x = rng.lognormal(np.log(median), sigma, size)
    return np.clip(x, lo, hi if hi is not None else np.inf).astype(np.int64)


def _images(rng, counts: np.ndarray, lo: int, hi: int) -> Items:
    """Images of lo..hi patches (uniform), `counts` per sample."""
    sizes = rng.integers(lo // MERGE_AREA, hi // MERGE_AREA + 1, int(counts.sum())) * MERGE_AREA
    return ragged(counts, sizes)


def _native(rng, counts: np.ndarray, median_side: float, hi_side: int) -> Items:
    """Native-resolution images: sides lognormal around `median_side` patches (whole merge
    windows), `counts` per sample."""
    n = int(counts.sum())
    side = lambda: 2 * np.ceil(np.clip(rng.lognormal(np.log(median_side), 0.5, n), 2, hi_side) / 2)
    return ragged(counts, (side() * side()).astype(np.int64))


def _clips(rng, counts: np.ndarray, seconds_lo: float, seconds_hi: float) -> Items:
    """Audio clips of seconds_lo..seconds_hi (log-uniform) at 100 frames a second."""
    s = np.exp(rng.uniform(np.log(seconds_lo), np.log(seconds_hi), int(counts.sum())))
    return ragged(counts, _round(100 * s, SUBSAMPLE, SUBSAMPLE))


def _frames(rng, counts: np.ndarray, side_lo: int, side_hi: int, frames_hi: int):
    """Video clips: per sample `counts` (0 or 1) clips of 8..frames_hi frames of one size
    (sides side_lo..side_hi patches, even), as vision items (a frame each)."""
    clip = counts > 0
    frames = np.zeros(len(counts), np.int64)
    frames[clip] = rng.integers(8, frames_hi + 1, int(clip.sum()))
    side = 2 * rng.integers(side_lo // 2, side_hi // 2 + 1, len(counts))
    return ragged(frames, np.repeat(side * side, frames))


def _concat(a: Items, b: Items) -> Items:
    """Each sample's items of `a`, then of `b`."""
    counts = a.count() + b.count()
    owner = np.concatenate(
        [np.repeat(np.arange(len(counts)), a.count()), np.repeat(np.arange(len(counts)), b.count())]
    )
    order = np.argsort(owner, kind="stable")
    return ragged(counts, np.concatenate([a.sizes, b.sizes])[order])


def longtail(num_samples: int = 200_000, seed: int = 0) -> LengthsIndex:
    """Text lognormal around 245 tokens (sigma 0.9), 0-4 images of 256-4,096 patches each."""
    rng = np.random.default_rng([seed, 38])
    text = _lognormal(rng, 245, 0.9, num_samples)
    return index_of(text, _images(rng, rng.integers(0, 5, num_samples), 256, 4096))


def interleaved(num_samples: int = 20000, seed: int = 0) -> LengthsIndex:
    """Web documents: text lognormal around 800 tokens (sigma 0.8, up to 8k), 1-12 images
    (geometric, mean 3) of native resolution (sides around 32 patches, up to 64)."""
    rng = np.random.default_rng([seed, 39])
    text = _lognormal(rng, 800, 0.8, num_samples, 16, 8000)
    count = np.minimum(rng.geometric(1 / 3, num_samples), 12)
    return index_of(text, _native(rng, count, 32, 64))


def speech(num_samples: int = 20000, seed: int = 0) -> LengthsIndex:
    """55% speech recognition (clips of 1-30 s, transcripts of ~3 tokens a second), 25% spoken
    questions (a clip of 2-20 s, an answer lognormal around 120 tokens), 20% text chats
    (lognormal around 500 tokens, sigma 1.0, up to 8k)."""
    rng = np.random.default_rng([seed, 40])
    kind = rng.choice(3, num_samples, p=[0.55, 0.25, 0.20])
    has_clip = kind < 2
    lo, hi = np.where(kind == 0, 1.0, 2.0), np.where(kind == 0, 30.0, 20.0)
    seconds = np.exp(rng.uniform(np.log(lo), np.log(hi)))
    frames = _round(100 * seconds[has_clip], SUBSAMPLE, SUBSAMPLE)
    text = np.where(
        kind == 0,
        (3 * seconds * rng.uniform(0.7, 1.3, num_samples)).astype(np.int64),
        _lognormal(rng, 120, 0.7, num_samples, 4, 2000),
    )
    chats = kind == 2
    text[chats] = _lognormal(rng, 500, 1.0, int(chats.sum()), 16, 8000)
    return index_of(text, audio=ragged(has_clip.astype(np.int64), frames))


DOCQA_LONGEST = 30000  # tokens of the longest documents of `docqa_mix`


def docqa_mix(seed: int, num_samples: int = 200_000) -> LengthsIndex:
    """Document QA drawn at random: per seed, documents lognormal around 400-2,500 tokens
    (sigma 0.5-0.9, up to 12k) with a question and answer of ~20-200 tokens, a share of 10-60%
    with 1-8 page images (1,024-4,096 patches), and a rare tail (2-20 in 100,000) of documents
    of 16k-30k tokens (`DOCQA_LONGEST`): the ones that set a tile capacity held for the
    longest document."""
    rng = np.random.default_rng([seed, 41])
    median, sigma = np.exp(rng.uniform(np.log(400), np.log(2500))), rng.uniform(0.5, 0.9)
    doc = _lognormal(rng, median, sigma, num_samples, 32, 12000)
    rare = rng.random(num_samples) < np.exp(rng.uniform(np.log(2e-5), np.log(2e-4)))
    doc[rare] = rng.integers(16000, DOCQA_LONGEST + 1, int(rare.sum()))
    qa = _lognormal(rng, np.exp(rng.uniform(np.log(20), np.log(200))), 0.7, num_samples, 4, 1000)
    pages = np.where(
        rng.random(num_samples) < rng.uniform(0.1, 0.6), rng.integers(1, 9, num_samples), 0
    )
    pages[rare] = 0  # (a 30k-token document is its text: its pages would not fit a row)
    return index_of(doc + qa, _images(rng, pages, 1024, 4096))


CHAT_KINDS = ("chat", "image", "video", "audio")


def chats_mix(seed: int, num_samples: int = 200_000) -> LengthsIndex:
    """Chats drawn at random: per seed the kinds' shares (`CHAT_KINDS`, a Dirichlet draw),
    text lognormal per kind (chats around 300-1,500 tokens with a spread of 0.8-1.2, so a long
    tail of conversations up to 24k tokens; the rest around 50-400), 1-3 native-resolution
    images, video clips of 8-64 frames of 8-20 patches a side, audio clips of 1-30 s."""
    rng = np.random.default_rng([seed, 42])
    kind = rng.choice(len(CHAT_KINDS), num_samples, p=rng.dirichlet(np.full(len(CHAT_KINDS), 0.7)))
    chat = kind == 0
    text = _lognormal(rng, np.exp(rng.uniform(np.log(50), np.log(400))), 0.8, num_samples, 4, 4000)
    median = np.exp(rng.uniform(np.log(300), np.log(1500)))
    text[chat] = _lognormal(rng, median, rng.uniform(0.8, 1.2), int(chat.sum()), 16, 24000)
    images = _native(rng, np.where(kind == 1, rng.integers(1, 4, num_samples), 0), 24, 80)
    video = _frames(rng, (kind == 2).astype(np.int64), 8, 20, 64)
    clips = _clips(rng, (kind == 3).astype(np.int64), 1.0, 30.0)
    return index_of(text, _concat(images, video), clips)
