"""The GPU campaign's step on real length mixes (`jaxmllm.bench.gpu`'s `.../mixes` case).

The built-in data's images (16-64 patches a side) fill the 2B recipe's vision bucket to 36-46%,
so MFU on it reads low for a reason no run on real data has. `MixSource` gives the trainer
samples with the lengths of real data sets instead: ChartQA's and AI2D's (`bench.mixes`, as
InternVL tiled them: images of 1,024 patches a tile, their text tokens), random pixels and
tokens of exactly those lengths, so the planner packs the buckets as it would on such data and
the step's MFU and fill mean what a run reaches.
"""

from __future__ import annotations

import numpy as np

from jaxmllm.bench.mixes import load_mix
from jaxmllm.config import Config
from jaxmllm.config.phases import AUDIO, VISION
from jaxmllm.data.lengths import Items, LengthsIndex
from jaxmllm.data.media.image import patchify
from jaxmllm.data.samples import Sample
from jaxmllm.data.text.tokenizer import ByteTokenizer

MIXES = ("chartqa", "ai2d")


class MixSource:
    """grain random-access source: sample i has mix sample i's text tokens and images (patches
    each; `shrink` divides both, for tiny shapes); `lengths()` is its index."""

    def __init__(self, cfg: Config, mixes: tuple[str, ...] = MIXES, shrink: int = 1):
        """Reads the length mixes' indexes: each sample's text tokens and its images' patch
        counts, divided by `shrink` and rounded to whole merge windows."""
        self.seed, self.patch = cfg.data.seed, cfg.model.vision.patch_size
        self.merge = cfg.model.vision.merge
        self.specials = ByteTokenizer().specials
        area = self.merge**2
        text, images = [], []
        for name in mixes:
            index = load_mix(name)
            text.append(np.maximum(index.text // shrink, 2))
            vision = index.items[VISION.name]
            sizes = np.maximum(vision.sizes // shrink // area, 1) * area  # whole merge windows
            images += np.split(sizes, vision.ptr[1:-1])
        self.text = np.concatenate(text).astype(np.int64)
        self.images = Items.from_lists([list(x) for x in images])

    def __len__(self) -> int:
        """The samples of all the mixes together."""
        return len(self.text)

    def lengths(self) -> LengthsIndex:
        """The lengths index of the mixes (text, images; no audio): what the planner plans on."""
        items = {VISION.name: self.images, AUDIO.name: Items.none(len(self))}
        return LengthsIndex(text=self.text, items=items)

    def __getitem__(self, i: int) -> Sample:
        """Sample `i` at its mix's lengths: random printable bytes for its text (the second half
        the answer), its images as random patches, each image's placeholders up front; the same
        for an `i` on every call."""
        i = int(i)
        rng = np.random.default_rng([self.seed, i, 2])
        sizes = self.images.of(i)
        grids = [grid(int(n), self.merge) for n in sizes]
        media = [self._image(rng, gh, gw) for gh, gw in grids]
        sp = self.specials
        body = rng.integers(32, 127, int(self.text[i]) - 2).astype(np.int32)  # (printable bytes)
        head = [np.full(int(n) // self.merge**2, sp.media[VISION.name], np.int32) for n in sizes]
        tokens = np.concatenate([[sp.bos], *head, body, [sp.eos]]).astype(np.int32)
        loss = np.zeros(len(tokens), bool)
        loss[len(tokens) - len(body) // 2 - 1 :] = True  # (the answer: the text's second half)
        return Sample(
            id=i,
            tokens=tokens,
            loss=loss,
            media={VISION.name: media},
            grids=[(1, gh, gw) for gh, gw in grids],
        )

    def load(self, i: int, keep: dict[str, tuple[int, ...]] | None = None) -> Sample:
        """Sample i with only the items `keep` lists (as `SyntheticSource.load`)."""
        sample = self[i]
        return sample if keep is None else sample.keep_only(keep)

    def _image(self, rng: np.random.Generator, gh: int, gw: int):
        """A random RGB image of gh x gw patches, patchified as the preprocessor does."""
        pixels = rng.integers(0, 256, (gh * self.patch, gw * self.patch, 3), np.uint8)
        return patchify(pixels, self.patch, self.merge)


def grid(patches: int, merge: int) -> tuple[int, int]:
    """The most nearly square (rows, cols) in patches, each whole merge windows, of an image of
    `patches` patches (a multiple of merge**2): a 1,024-patch tile is 32 x 32."""
    windows = patches // merge**2
    rows = max(d for d in range(1, int(windows**0.5) + 1) if windows % d == 0)
    return rows * merge, windows // rows * merge
