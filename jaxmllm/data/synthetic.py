"""Built-in learnable data, generated deterministically from (seed, index); no download needed.

Three kinds of sample with a realistic spread of modality mixes and lengths:
- image(s) of a coloured shape at a random native resolution, captioned "a red circle";
- a synthetic log-mel spectrogram of a tone (steady, rising or falling; low, mid or high pitch),
  captioned "a rising high tone";
- text-only counting runs ("17 18 19 20 ...").
A caption can only be predicted by looking at the image or listening to the clip, so a falling loss
on those tokens means the encoders, projectors and routing really work.
"""

from __future__ import annotations

import numpy as np

from jaxmllm.config import Config
from jaxmllm.config.phases import AUDIO, VISION, Phase
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.data.media.image import patchify
from jaxmllm.data.samples import Sample
from jaxmllm.data.text.tokenizer import ByteTokenizer

COLOURS = {
    "red": (1.0, -0.8, -0.8),
    "green": (-0.8, 1.0, -0.8),
    "blue": (-0.8, -0.8, 1.0),
    "yellow": (1.0, 1.0, -0.8),
    "white": (1.0, 1.0, 1.0),
    "purple": (0.6, -0.8, 0.8),
}
SHAPES = ("circle", "square", "triangle", "cross")
PITCHES = {"low": 0.2, "mid": 0.5, "high": 0.8}
CONTOURS = {"steady": 0.0, "rising": 0.3, "falling": -0.3}
IMAGE_PROMPT = "what is this? "
AUDIO_PROMPT = "what do you hear? "


class SyntheticSource:
    """grain random-access source: `len()` samples, `source[i]` -> Sample."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.syn = cfg.data.synthetic
        self.patch = cfg.model.vision.patch_size
        self.n_mels = cfg.model.audio.n_mels
        self.merge = cfg.model.vision.merge
        self.subsample = cfg.model.audio.subsample
        self.tokenizer = ByteTokenizer()
        self.specials = self.tokenizer.specials  # what bucketize pads with and finds slots by
        self._params = [self._sample_params(i) for i in range(self.syn.num_samples)]

    def __len__(self) -> int:
        return self.syn.num_samples

    def __getitem__(self, i: int) -> Sample:
        p = self._params[int(i)]
        rng = np.random.default_rng([self.cfg.data.seed, int(i), 1])
        if p["kind"] == "text":
            return self._text_sample(int(i), p)
        if p["kind"] == "image":
            media = [self._render_image(rng, *img) for img in p["images"]]
            caption = " and ".join(f"a {c} {s}" for _, _, c, s in p["images"])
            return self._media_sample(
                int(i),
                VISION,
                [len(m[0]) // self.merge**2 for m in media],
                IMAGE_PROMPT,
                caption,
                media,
                grids=[(gh, gw) for gh, gw, _, _ in p["images"]],
            )
        clip = self._render_audio(rng, *p["audio"])
        caption = f"a {p['audio'][2]} {p['audio'][1]} tone"
        item = (clip, np.arange(len(clip), dtype=np.int32))
        rows = [len(clip) // self.subsample]
        return self._media_sample(int(i), AUDIO, rows, AUDIO_PROMPT, caption, [item])

    def load(self, i: int, keep: dict[str, tuple[int, ...]] | None = None) -> Sample:
        """Sample i with only the items `keep[phase]` lists (by number; None = all) kept.

        The others are None: another host encodes them. Rendering is cheap, so this renders
        everything and drops the rest; a decoding source (the manifest) skips the work.
        """
        sample = self[i]
        return sample if keep is None else sample.keep_only(keep)

    def lengths(self) -> LengthsIndex:
        """Counts in model units for every sample, without rendering any media."""
        records = []
        for p in self._params:
            if p["kind"] == "text":
                records.append({"text": len(self._text_tokens(p))})
            elif p["kind"] == "image":
                caption = " and ".join(f"a {c} {s}" for _, _, c, s in p["images"])
                records.append(
                    {
                        "text": 2 + len(IMAGE_PROMPT) + len(caption.encode()),
                        VISION.items: [h * w for h, w, _, _ in p["images"]],
                    }
                )
            else:
                caption = f"a {p['audio'][2]} {p['audio'][1]} tone"
                records.append(
                    {
                        "text": 2 + len(AUDIO_PROMPT) + len(caption.encode()),
                        AUDIO.items: [p["audio"][0]],
                    }
                )
        return LengthsIndex.from_records(records)

    # ------------------------------------------------------------------ sample parameters

    def _sample_params(self, i: int) -> dict:
        rng = np.random.default_rng([self.cfg.data.seed, i, 0])
        u = rng.random()
        syn = self.syn
        if u < syn.image_fraction:
            n = 2 if u < syn.multi_image_fraction else 1
            return {"kind": "image", "images": [self._image_params(rng) for _ in range(n)]}
        if u < syn.image_fraction + syn.audio_fraction:
            frames = 4 * int(rng.integers(syn.min_audio_frames // 4, syn.max_audio_frames // 4 + 1))
            return {
                "kind": "audio",
                "audio": (frames, str(rng.choice(list(PITCHES))), str(rng.choice(list(CONTOURS)))),
            }
        # Long-tailed text lengths: most samples short, a few near the maximum.
        words = int(
            min(syn.max_text_words, 3 + rng.geometric(1.0 / max(2, syn.max_text_words // 3)))
        )
        return {"kind": "text", "start": int(rng.integers(0, 90)), "words": words}

    def _image_params(self, rng: np.random.Generator) -> tuple[int, int, str, str]:
        m = self.merge  # image sides in patches are multiples of the merge factor
        lo, hi = max(1, self.syn.min_image_side // m), max(1, self.syn.max_image_side // m)
        h, w = m * int(rng.integers(lo, hi + 1)), m * int(rng.integers(lo, hi + 1))
        return h, w, str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES))

    # ------------------------------------------------------------------ rendering

    def _text_tokens(self, p: dict) -> np.ndarray:
        n = self.syn.text_tokens  # (0: the sample's own words; > 0: exactly n tokens)
        words = n // 2 + 1 if n else p["words"]  # (a word and its space: 2 bytes at least)
        text = self.tokenizer.encode(" ".join(str(p["start"] + k) for k in range(words)))
        text = text[: n - 2] if n else text
        sp = self.specials
        return np.concatenate([[sp.bos], text, [sp.eos]]).astype(np.int32)

    def _text_sample(self, i: int, p: dict) -> Sample:
        tokens = self._text_tokens(p)
        loss = np.ones(len(tokens), bool)
        loss[0] = False  # BOS is never predicted
        return Sample(id=i, tokens=tokens, loss=loss)

    def _media_sample(self, i, phase: Phase, rows, prompt, caption, items, grids=()) -> Sample:
        head = [np.array([self.specials.bos], np.int32)]
        head += [np.full(r, self.specials.media[phase.name], np.int32) for r in rows]
        head.append(self.tokenizer.encode(prompt))
        eos = self.specials.eos
        answer = np.concatenate([self.tokenizer.encode(caption), [eos]]).astype(np.int32)
        prefix = np.concatenate(head).astype(np.int32)
        tokens = np.concatenate([prefix, answer])
        loss = np.concatenate([np.zeros(len(prefix), bool), np.ones(len(answer), bool)])
        return Sample(id=i, tokens=tokens, loss=loss, media={phase.name: items}, grids=list(grids))

    def _render_image(self, rng, gh: int, gw: int, colour: str, shape: str):
        """An image of gh x gw patches, patchified in 2x2-merge order with (row, col) positions."""
        p = self.patch
        height, width = gh * p, gw * p
        y, x = np.mgrid[0:height, 0:width].astype(np.float32)
        r = rng.uniform(0.25, 0.4) * min(height, width)
        cy = rng.uniform(r, height - r)
        cx = rng.uniform(r, width - r)
        dy, dx = np.abs(y - cy), np.abs(x - cx)
        mask = {
            "circle": dy**2 + dx**2 < r**2,
            "square": (dy < r * 0.8) & (dx < r * 0.8),
            "triangle": (y > cy - r) & (y < cy + r) & (dx < (y - (cy - r)) / 2),
            "cross": ((dx < r / 3) & (dy < r)) | ((dy < r / 3) & (dx < r)),
        }[shape]
        img = rng.normal(-0.5, 0.15, (height, width, 3)).astype(np.float32)
        img[mask] = np.asarray(COLOURS[colour], np.float32)
        return patchify(np.clip(img, -1, 1), p, self.merge)

    def _render_audio(self, rng, frames: int, pitch: str, contour: str) -> np.ndarray:
        """Log-mel frames of a tone whose pitch follows the contour, with noise."""
        n = self.n_mels
        t = np.linspace(0.0, 1.0, frames, dtype=np.float32)[:, None]
        centre = (PITCHES[pitch] + CONTOURS[contour] * (t - 0.5)) * (n - 1)
        bins = np.arange(n, dtype=np.float32)[None, :]
        band = np.exp(-0.5 * ((bins - centre) / max(1.0, n / 16)) ** 2)
        return (4.0 * band - 2.0 + rng.normal(0, 0.3, (frames, n))).astype(np.float32)


# ----------------------------------------------------------------------------- scoring answers

# What `score_answer` checks of each kind of answer, and a uniform guess's chance of it
SCORED = {
    "shapes": {"count": 1 / 2, "colour": 1 / len(COLOURS), "shape": 1 / len(SHAPES)},
    "tone": {"pitch": 1 / len(PITCHES), "contour": 1 / len(CONTOURS)},
}


def score_answer(answer: str, truth: str) -> dict[str, float]:
    """How much of a generated caption is right, by what it names.

    Shapes ("a red circle and a blue square"): `count` (as many shapes named as shown),
    `colour` and `shape` (the share of the shown shapes, in order, named right); a tone ("a
    rising high tone"): `pitch`, `contour`; both: `exact` (the whole answer).
    """
    scores = {"exact": float(answer.strip() == truth.strip())}
    want, got = _named(truth), _named(answer)
    got += [("", "", "")] * len(want)  # (an answer naming fewer things misses the rest)
    if truth.strip().endswith(" tone"):  # (contour, pitch, "tone")
        scores["contour"] = float(got[0][0] == want[0][0])
        scores["pitch"] = float(got[0][1] == want[0][1])
    elif want:  # shapes: (colour, shape) each
        scores["count"] = float(len(got) - len(want) == len(want))
        pairs = list(zip(want, got, strict=False))
        scores["colour"] = sum(w[0] == g[0] for w, g in pairs) / len(want)
        scores["shape"] = sum(w[1] == g[1] for w, g in pairs) / len(want)
    return scores


def _named(caption: str) -> list[tuple[str, str, str]]:
    """The first three words after each "a " of a caption's " and "-joined parts ("" where a
    part has fewer)."""
    parts = [p.strip().removeprefix("a ").split() for p in caption.strip().split(" and ")]
    return [tuple((p + ["", "", ""])[:3]) for p in parts if p]
