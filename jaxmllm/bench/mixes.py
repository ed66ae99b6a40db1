"""Built-in workloads for the balancer: a synthetic three-modality mix and the real tables.

- `omni`: synthetic, strong modality-composition incoherence: text-only chats, native-resolution
  single images, multi-image documents, video (many frames, some with an audio track) and audio
  clips, each with its own text length distribution.
- `ai2d`, `chartqa`: real per-sample lengths of two vision-language sets as prepared for InternVL
  (shipped beside this module in `lengths/`, see its README).

Lengths files are read in the DESIGN.md JSONL format (`{"text": 312, "images": [1024]}` a line) or
in the InternVL JSON format (`[{"vit_num": 3, "token_num": 811}, ...]`), detected by content;
either may be gzipped (`.gz`).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

from jaxmllm.data.samples import LengthsIndex

INTERNVL_TILE_PATCHES = 1024  # 448 px tile / 14 px patches, squared
INTERNVL_TILE_TOKENS = 256  # after pixel shuffle (merge 2 x 2)


LENGTHS_DIR = Path(__file__).resolve().parent / "lengths"


def from_arrays(
    text: np.ndarray, images: list[np.ndarray], audio: list[np.ndarray]
) -> LengthsIndex:
    """A lengths index from per-sample text counts and per-sample item arrays."""

    def ragged(items):
        ptr = np.cumsum([0] + [len(x) for x in items]).astype(np.int64)
        flat = np.concatenate([np.asarray(x, np.int64) for x in items]) if items else []
        return ptr, np.asarray(flat, np.int64)

    iptr, ivals = ragged(images)
    aptr, avals = ragged(audio)
    return LengthsIndex(
        text=np.asarray(text, np.int64), images_ptr=iptr, images=ivals, audio_ptr=aptr, audio=avals
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


def load_lengths(path: str | Path) -> LengthsIndex:
    """Reads a lengths file: DESIGN.md JSONL, or an InternVL JSON table (detected)."""
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
        if "vit_num" in rec:
            return _from_internvl(
                [json.loads(x) for x in text.splitlines() if x.strip()], str(path)
            )
        records.append(rec)
    return LengthsIndex.from_records(records)


def _read_text(path: Path) -> str:
    """A file's text, gunzipped when its name ends in .gz."""
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            return f.read()
    return path.read_text()


MIXES = {
    "omni": lambda seed=0: synthetic_omni(seed=seed),
    "ai2d": lambda seed=0: load_internvl(LENGTHS_DIR / "ai2d_internvl.json.gz"),
    "chartqa": lambda seed=0: load_internvl(LENGTHS_DIR / "chartqa_internvl.json.gz"),
}


def load_mix(name: str, seed: int = 0) -> LengthsIndex:
    """A built-in mix by name (see MIXES)."""
    if name not in MIXES:
        raise ValueError(f"unknown mix {name!r}; built-in mixes: {', '.join(MIXES)}")
    return MIXES[name](seed)
