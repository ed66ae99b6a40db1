"""Built-in learnable data, generated deterministically from (seed, index); no download needed.

Four kinds of sample with a realistic spread of modality mixes and lengths:
- image(s) of a coloured shape at a random native resolution, captioned "a red circle" (drawn
  on the patch grid: `_render_image` says why);
- a synthetic log-mel spectrogram of a tone (steady, rising or falling; low, mid or high pitch),
  captioned "a rising high tone";
- with `video_fraction`, a short video of a coloured shape crossing its frames, asked "which way
  does it move?" and answered "a red circle moving left": only its frames in order say which way;
- text-only counting runs ("17 18 19 20 ...").
A caption can only be predicted by looking at the image or video or listening to the clip, so a
falling loss on those tokens means the encoders, projectors and routing really work.

Under `train.objective: dpo` every sample is a preference pair (`Sample.documents`): the same
prompt (BOS, the items' placeholders, the question; a counting run's first number) with the
right answer as chosen and a wrong one as rejected, drawn from (seed, index)
(`jaxmllm.data.synthetic_pairs`): another colour and/or shape of one image, the other way for
a video, another pitch and/or contour for a clip, a counting run with one digit changed.
Learning to prefer the chosen answer takes the same looking and listening.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np

from jaxmllm.config import Config
from jaxmllm.config.phases import AUDIO, VIDEO, VISION, Phase
from jaxmllm.data.lengths import Items, LengthsIndex
from jaxmllm.data.media.image import patchify
from jaxmllm.data.pcg import Streams
from jaxmllm.data.samples import Sample
from jaxmllm.data.synthetic_pairs import text_pair, twists, wrong_images, wrong_names
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
DIRECTIONS = ("left", "right")
IMAGE_PROMPT = "what is this? "
log = logging.getLogger("jaxmllm")
AUDIO_PROMPT = "what do you hear? "
VIDEO_PROMPT = "which way does it move? "


class SyntheticSource:
    """grain random-access source: `len()` samples, `source[i]` -> Sample."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.syn = cfg.data.synthetic
        self.patch = cfg.model.vision.patch_size
        self.n_mels = cfg.model.audio.n_mels
        self.merge = cfg.model.vision.merge
        self.temporal = cfg.model.vision.temporal_patch  # frames a video's temporal patch
        self.subsample = cfg.model.audio.subsample
        self.tokenizer = ByteTokenizer()
        self.specials = self.tokenizer.specials  # what bucketize pads with and finds slots by
        self.pairs = cfg.train.objective == "dpo"  # every sample a preference pair
        self._table = self._param_table()  # every sample's parameters, as arrays

    def __len__(self) -> int:
        return self.syn.num_samples

    def __getitem__(self, i: int) -> Sample:
        p = self._table.params(int(i))
        rng = np.random.default_rng([self.cfg.data.seed, int(i), 1])
        wrong = self._wrong(int(i), p) if self.pairs else None  # (a pair's rejected answer)
        if p["kind"] == "text":
            return self._text_sample(int(i), p)
        if p["kind"] == "image":
            media = [self._render_image(rng, *img) for img in p["images"]]
            return self._media_sample(
                int(i),
                VISION,
                [len(m[0]) // self.merge**2 for m in media],
                IMAGE_PROMPT,
                _image_caption(p["images"]),
                media,
                grids=[(1, gh, gw) for gh, gw, _, _ in p["images"]],
                wrong=wrong,
            )
        if p["kind"] == "video":
            items = self._render_video(rng, *p["video"])
            grid = (len(items), self.syn.video_side, self.syn.video_side)
            rows = [len(v) // self.merge**2 for v, _ in items]
            caption = self._video_caption(p["video"])
            return self._media_sample(
                int(i),
                VISION,
                rows,
                VIDEO_PROMPT,
                caption,
                items,
                grids=[grid],
                marker=VIDEO.name,
                wrong=wrong,
            )
        clip = self._render_audio(rng, *p["audio"])
        caption = _audio_caption(p["audio"])
        item = (clip, np.arange(len(clip), dtype=np.int32))
        rows = [len(clip) // self.subsample]
        return self._media_sample(int(i), AUDIO, rows, AUDIO_PROMPT, caption, [item], wrong=wrong)

    def _wrong(self, i: int, p: dict) -> str | None:
        """Sample i's rejected answer where it is a media sample's (a caption not its own:
        `wrong_names`); None for a counting run (`text_pair` changes a digit)."""
        t, twist = self._table, twists(self.cfg.data.seed, np.array([i]))
        if p["kind"] == "image":
            colours, shapes = wrong_images(t.images[[i]], t.n_images[[i]], twist, COLOURS, SHAPES)
            names = zip(colours[0].tolist(), shapes[0].tolist(), strict=True)
            images = [
                (h, w, tuple(COLOURS)[c], SHAPES[s])
                for (h, w, _, _), (c, s) in zip(p["images"], names, strict=False)
            ]
            return _image_caption(images)
        if p["kind"] == "audio":
            pitch, contour = wrong_names(twist, t.audio[[i], 1], t.audio[[i], 2], PITCHES, CONTOURS)
            return _audio_caption((0, tuple(PITCHES)[pitch[0]], tuple(CONTOURS)[contour[0]]))
        if p["kind"] == "video":
            frames, colour, shape, direction = p["video"]
            other = DIRECTIONS[1 - DIRECTIONS.index(direction)]
            return self._video_caption((frames, colour, shape, other))
        return None

    def load(self, i: int, keep: dict[str, tuple[int, ...]] | None = None) -> Sample:
        """Sample i with only the items `keep[phase]` lists (by number; None = all) kept.

        The others are None: another host encodes them. Rendering is cheap, so this renders
        everything and drops the rest; a decoding source (the manifest) skips the work.
        """
        sample = self[i]
        return sample if keep is None else sample.keep_only(keep)

    def lengths(self) -> LengthsIndex:
        """Counts in model units for every sample, without rendering any media. A pair's
        `text` is both documents' text and its placeholder rows once (the index counts each
        item once: text + a token per encoder row is the pair's length), its `split` the
        chosen document's LLM tokens."""
        t = self._table
        image, audio, video = t.kind == IMAGE_KIND, t.kind == AUDIO_KIND, t.kind == VIDEO_KIND
        answers = (
            t.images[:, :, 2],
            t.images[:, :, 3],
            t.audio[:, 1],
            t.audio[:, 2],
            t.video[:, 3],
        )
        tokens = self._document_text(*answers)
        # Vision items in sample order: a sample's images, or its video's temporal patches
        patches = (t.images[:, :, 0] * t.images[:, :, 1]).astype(np.int64)
        n_images = np.where(image, t.n_images, 0)
        n_video = np.where(video, t.video[:, 0] // self.temporal, 0).astype(np.int64)
        sizes = np.zeros((len(t.kind), 2), np.int64)  # (a sample's first two items' sizes)
        sizes[:] = patches
        slots = np.arange(2)[None, :] < n_images[:, None]
        from_images = np.repeat(np.flatnonzero(n_images), n_images[n_images > 0])
        from_video = np.repeat(np.flatnonzero(n_video), n_video[n_video > 0])
        order = np.argsort(np.concatenate([from_images, from_video]), kind="stable")
        vision = np.concatenate([sizes[slots], np.full(len(from_video), self.syn.video_side**2)])
        ptr = lambda counts: np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # noqa: E731
        items = {
            VISION.name: Items(ptr(n_images + n_video), vision[order].astype(np.int64)),
            AUDIO.name: Items(ptr(audio), t.audio[audio, 0].astype(np.int64)),
        }
        split = None
        if self.pairs:  # (the rejected document's text, and its rows counted as text)
            twist = twists(self.cfg.data.seed, np.arange(len(t.kind)))
            colours, shapes = wrong_images(t.images, t.n_images, twist, COLOURS, SHAPES)
            pitch, contour = wrong_names(twist, t.audio[:, 1], t.audio[:, 2], PITCHES, CONTOURS)
            rejected = self._document_text(colours, shapes, pitch, contour, 1 - t.video[:, 3])
            vision, clips = items[VISION.name], items[AUDIO.name]
            rows = vision.per_sample(vision.sizes // self.merge**2)
            rows = rows + clips.per_sample(clips.sizes // self.subsample)
            split = tokens + rows  # (the chosen document's LLM tokens: where the pair splits)
            tokens = tokens + rejected + rows
        return LengthsIndex(text=tokens, items=items, split=split)

    def _document_text(self, colours, shapes, pitch, contour, direction) -> np.ndarray:
        """Each sample's text tokens (placeholders aside) in a document whose answer names
        these (numbers of the names, per sample: two images' colours and shapes, a clip's
        pitch and contour, a video's direction): BOS, the question, the answer, EOS; a
        counting run's BOS, run, EOS."""
        t = self._table
        image, audio, text = t.kind == IMAGE_KIND, t.kind == AUDIO_KIND, t.kind == TEXT_KIND
        video = t.kind == VIDEO_KIND
        tokens = np.zeros(len(t.kind), np.int64)
        tokens[text] = self._text_lengths(t.text[text, 0], t.text[text, 1])
        # "a red circle", " and " between two
        names = [
            NAME_BYTES["colour"][colours[:, k]] + NAME_BYTES["shape"][shapes[:, k]]
            for k in range(2)
        ]
        caption = 3 + names[0] + np.where(t.n_images == 2, 5 + 3 + names[1], 0)
        tokens[image] = (2 + len(IMAGE_PROMPT) + caption)[image]
        caption = 3 + NAME_BYTES["contour"][contour] + NAME_BYTES["pitch"][pitch]
        tokens[audio] = (2 + len(AUDIO_PROMPT) + caption + len(" tone"))[audio]
        # "a red circle moving left"
        caption = (
            3
            + NAME_BYTES["colour"][t.video[:, 1]]
            + NAME_BYTES["shape"][t.video[:, 2]]
            + len(" moving ")
            + NAME_BYTES["direction"][direction]
        )
        tokens[video] = (2 + len(VIDEO_PROMPT) + caption)[video]
        return tokens

    def _text_lengths(self, start: np.ndarray, words: np.ndarray) -> np.ndarray:
        """len(_text_tokens) of text samples: BOS, the counting run's bytes, EOS."""
        n = self.syn.text_tokens
        words = np.full_like(words, n // 2 + 1) if n else words.astype(np.int64)
        start = start.astype(np.int64)
        run = _digits_below(start + words) - _digits_below(start) + words - 1  # digits, spaces
        return 2 + (np.minimum(run, n - 2) if n else run)

    # ------------------------------------------------------------------ sample parameters

    def _param_table(self) -> _Table:
        """Every sample's parameters (`_sample_params`), drawn for all samples at once: the
        same numbers, from the same per-sample streams (`jaxmllm.data.pcg`)."""
        ids = np.arange(self.syn.num_samples)
        blocks = [self._draw_params(ids[k : k + BLOCK]) for k in range(0, len(ids), BLOCK)]
        table = _Table.concat([t for t, _ in blocks], len(ids))
        exact = np.concatenate([e for _, e in blocks] or [np.ones(0, bool)])
        probe = np.unique(np.linspace(0, max(len(ids) - 1, 0), 16).astype(np.int64))[: len(ids)]
        probe = probe[exact[probe]]  # (a lane on numpy's rare branch is drawn its way below)
        if any(table.params(int(i)) != self._sample_params(int(i)) for i in probe):
            log.warning(
                "numpy's streams differ from jaxmllm.data.pcg's: synthetic parameters "
                "drawn one sample at a time (slower start-up, same samples)"
            )
            exact[:] = False
        for i in np.flatnonzero(~exact).tolist():  # a rare branch of numpy's: drawn its way
            table.set(i, self._sample_params(i))
        return table

    def _draw_params(self, ids: np.ndarray) -> tuple[_Table, np.ndarray]:
        """`_sample_params` for all `ids` at once: (the table, where it is exact)."""
        syn, m = self.syn, self.merge
        streams = Streams([self.cfg.data.seed], ids, [0])
        u = streams.random()
        table = _Table.empty(len(ids))
        exact = np.ones(len(ids), bool)
        image = u < syn.image_fraction
        audio = ~image & (u < syn.image_fraction + syn.audio_fraction)
        table.kind[image], table.kind[audio] = IMAGE_KIND, AUDIO_KIND
        table.n_images[:] = np.where(u < syn.multi_image_fraction, 2, 1)
        lanes = streams.take(image)
        lo, hi = max(1, syn.min_image_side // m), max(1, syn.max_image_side // m)
        for k in range(2):  # (a one-image sample never draws the second's)
            draws = [
                lanes.integers(lo, hi + 1),
                lanes.integers(lo, hi + 1),
                lanes.integers(0, len(COLOURS)),
                lanes.integers(0, len(SHAPES)),
            ]
            for c, (value, ok) in enumerate(draws):
                table.images[image, k, c] = value * (m if c < 2 else 1)
                exact[image] &= ok | (k >= table.n_images[image])
        lanes = streams.take(audio)
        frames = lanes.integers(syn.min_audio_frames // 4, syn.max_audio_frames // 4 + 1)
        draws = [frames, lanes.integers(0, len(PITCHES)), lanes.integers(0, len(CONTOURS))]
        for c, (value, ok) in enumerate(draws):
            table.audio[audio, c] = value * (4 if c == 0 else 1)
            exact[audio] &= ok
        video = ~image & ~audio & (u < syn.image_fraction + syn.audio_fraction + syn.video_fraction)
        table.kind[video] = VIDEO_KIND
        lanes = streams.take(video)
        t = self.temporal  # (whole temporal patches)
        draws = [
            lanes.integers(-(-syn.min_video_frames // t), syn.max_video_frames // t + 1),
            lanes.integers(0, len(COLOURS)),
            lanes.integers(0, len(SHAPES)),
            lanes.integers(0, len(DIRECTIONS)),
        ]
        for c, (value, ok) in enumerate(draws):
            table.video[video, c] = value * (t if c == 0 else 1)
            exact[video] &= ok
        text = ~image & ~audio & ~video
        lanes = streams.take(text)
        most = syn.max_text_words
        steps, ok_steps = lanes.geometric(1.0 / max(2, most // 3))
        start, ok_start = lanes.integers(0, 90)
        table.text[text, 0] = start
        table.text[text, 1] = np.minimum(most, 3 + np.minimum(steps, most))
        exact[text] &= ok_steps & ok_start
        return table, exact

    def _sample_params(self, i: int) -> dict:
        """Sample i's parameters from its own Generator (`_draw_params` draws the same for many
        samples at once)."""
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
        if u < syn.image_fraction + syn.audio_fraction + syn.video_fraction:
            t = self.temporal  # (whole temporal patches)
            frames = t * int(
                rng.integers(-(-syn.min_video_frames // t), syn.max_video_frames // t + 1)
            )
            colour, shape = str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES))
            return {"kind": "video", "video": (frames, colour, shape, str(rng.choice(DIRECTIONS)))}
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
        if self.pairs:
            return text_pair(i, tokens)
        loss = np.ones(len(tokens), bool)
        loss[0] = False  # BOS is never predicted
        return Sample(id=i, tokens=tokens, loss=loss)

    def _media_sample(
        self,
        i,
        phase: Phase,
        rows,
        prompt,
        caption,
        items,
        grids=(),
        marker: str = "",
        wrong: str | None = None,
    ) -> Sample:
        """BOS, the items' placeholder rows (of kind `marker`, else the phase's own), the
        prompt; then the caption and EOS, learned. With a `wrong` caption, a preference pair:
        that document, then the same prompt with the wrong caption and EOS."""
        head = [np.array([self.specials.bos], np.int32)]
        head += [np.full(r, self.specials.media[marker or phase.name], np.int32) for r in rows]
        head.append(self.tokenizer.encode(prompt))
        eos = self.specials.eos
        answer = np.concatenate([self.tokenizer.encode(caption), [eos]]).astype(np.int32)
        prefix = np.concatenate(head).astype(np.int32)
        tokens = np.concatenate([prefix, answer])
        loss = np.concatenate([np.zeros(len(prefix), bool), np.ones(len(answer), bool)])
        documents: tuple[int, ...] = ()
        if wrong is not None:
            other = np.concatenate([self.tokenizer.encode(wrong), [eos]]).astype(np.int32)
            documents = (len(tokens), len(prefix) + len(other))
            tokens = np.concatenate([tokens, prefix, other])
            learned = [np.zeros(len(prefix), bool), np.ones(len(other), bool)]
            loss = np.concatenate([loss, *learned])
        return Sample(
            id=i,
            tokens=tokens,
            loss=loss,
            media={phase.name: items},
            grids=list(grids),
            documents=documents,
        )

    def _render_image(self, rng, gh: int, gw: int, colour: str, shape: str):
        """An image of gh x gw patches, patchified in 2x2-merge order with (row, col) positions.

        The shape's radius is whole patches and its centre on a line between patches, so a
        shape cuts the same patterns into its patches wherever it is drawn. Drawn anywhere to
        the pixel, a tiny tower taught the shape alone named 34% of held-out images after 3,200
        (chance 25%) and needed some 10,000 to pass half; on the patch grid, 86% after 3,200 and
        98% after 6,400 (`python -m tools.shape_probe`, 2026-11-28)."""
        p = self.patch
        height, width = gh * p, gw * p
        r = _whole_patches(rng.uniform(0.25, 0.4) * min(height, width), p, min(height, width))
        cy = _on_grid(rng.uniform(r, height - r), p, r, height - r)
        cx = _on_grid(rng.uniform(r, width - r), p, r, width - r)
        mask = _shape_mask(height, width, cy, cx, r, shape)
        img = _pixels(rng.normal(-0.5, 0.15, (height, width, 3)))
        np.copyto(img, _pixels(COLOURS[colour]), where=mask[..., None])
        return patchify(img, p, self.merge)

    @staticmethod
    def _video_caption(video: tuple) -> str:
        _, colour, shape, direction = video
        return f"a {colour} {shape} moving {direction}"

    def _render_video(self, rng, frames: int, colour: str, shape: str, direction: str) -> list:
        """A shape crossing `frames` frames of video_side x video_side patches left or right,
        as vision items: per temporal patch (its frames' patches side by side, frame-major;
        (row, col) positions)."""
        p, side = self.patch, self.syn.video_side * self.patch
        # (on the patch grid as an image's shape, where a shape of whole-patch radius still
        # crosses a patch or more: frames 3 patches wide at least; narrower, as drawn)
        grid = self.syn.video_side >= 3
        r = rng.uniform(0.2, 0.3) * side
        r = _whole_patches(r, p, side) if grid else r
        cy = rng.uniform(r, side - r)
        cy = _on_grid(cy, p, r, side - r) if grid else cy
        start, end = r, side - r
        if direction == "left":
            start, end = end, start
        noise = _pixels(rng.normal(-0.5, 0.15, (side, side, 3)))
        per_frame = []
        for k in range(frames):
            cx = start + (end - start) * k / max(frames - 1, 1)
            cx = _on_grid(cx, p, r, side - r) if grid else cx
            img = noise.copy()
            img[_shape_mask(side, side, cy, cx, r, shape)] = _pixels(COLOURS[colour])
            per_frame.append(patchify(img, p, self.merge))
        t = self.temporal
        return [
            (np.concatenate([v for v, _ in per_frame[a : a + t]], axis=-1), per_frame[a][1])
            for a in range(0, frames - frames % t, t)
        ]

    def _render_audio(self, rng, frames: int, pitch: str, contour: str) -> np.ndarray:
        """Log-mel frames of a tone whose pitch follows the contour, with noise."""
        n = self.n_mels
        t = np.linspace(0.0, 1.0, frames, dtype=np.float32)[:, None]
        centre = (PITCHES[pitch] + CONTOURS[contour] * (t - 0.5)) * (n - 1)
        bins = np.arange(n, dtype=np.float32)[None, :]
        band = np.exp(-0.5 * ((bins - centre) / max(1.0, n / 16)) ** 2)
        return (4.0 * band - 2.0 + rng.normal(0, 0.3, (frames, n))).astype(np.float32)


TEXT_KIND, IMAGE_KIND, AUDIO_KIND, VIDEO_KIND = 0, 1, 2, 3  # kinds of sample (_Table.kind)
BLOCK = 1 << 16  # samples drawn together (their arrays stay in the cache)
# The bytes of each name, by its number (the order the draws number them)
NAME_BYTES = {
    key: np.array([len(name.encode()) for name in names])
    for key, names in (
        ("colour", COLOURS),
        ("shape", SHAPES),
        ("pitch", PITCHES),
        ("contour", CONTOURS),
        ("direction", DIRECTIONS),
    )
}


@dataclass
class _Table:
    """Every sample's parameters as arrays: kind; up to two images (rows, cols in patches,
    colour, shape: name numbers); a clip (frames, pitch, contour); a text (start, words); a
    video (frames, colour, shape, direction)."""

    kind: np.ndarray  # int8 [N]
    n_images: np.ndarray  # int8 [N]
    images: np.ndarray  # int32 [N, 2, 4]
    audio: np.ndarray  # int32 [N, 3]
    text: np.ndarray  # int32 [N, 2]
    video: np.ndarray  # int32 [N, 4]

    @classmethod
    def empty(cls, n: int) -> _Table:
        zeros = lambda *shape, d=np.int32: np.zeros((n, *shape), d)  # noqa: E731
        return cls(zeros(d=np.int8), zeros(d=np.int8), zeros(2, 4), zeros(3), zeros(2), zeros(4))

    @classmethod
    def concat(cls, tables: list[_Table], n: int) -> _Table:
        if not tables:
            return cls.empty(n)
        fields = [f.name for f in dataclasses.fields(cls)]
        return cls(*(np.concatenate([getattr(t, f) for t in tables]) for f in fields))

    def params(self, i: int) -> dict:
        """Sample i's parameters as `_sample_params` returns them."""
        if self.kind[i] == IMAGE_KIND:
            images = [
                (int(h), int(w), tuple(COLOURS)[c], SHAPES[s])
                for h, w, c, s in self.images[i, : self.n_images[i]]
            ]
            return {"kind": "image", "images": images}
        if self.kind[i] == AUDIO_KIND:
            frames, pitch, contour = self.audio[i]
            return {
                "kind": "audio",
                "audio": (int(frames), tuple(PITCHES)[pitch], tuple(CONTOURS)[contour]),
            }
        if self.kind[i] == VIDEO_KIND:
            frames, colour, shape, direction = self.video[i]
            return {
                "kind": "video",
                "video": (
                    int(frames),
                    tuple(COLOURS)[colour],
                    SHAPES[shape],
                    DIRECTIONS[direction],
                ),
            }
        return {"kind": "text", "start": int(self.text[i, 0]), "words": int(self.text[i, 1])}

    def set(self, i: int, p: dict) -> None:
        """Sample i's parameters from `_sample_params`'s dict."""
        if p["kind"] == "image":
            self.kind[i], self.n_images[i] = IMAGE_KIND, len(p["images"])
            for k, (h, w, c, s) in enumerate(p["images"]):
                self.images[i, k] = (h, w, tuple(COLOURS).index(c), SHAPES.index(s))
        elif p["kind"] == "audio":
            frames, pitch, contour = p["audio"]
            self.kind[i] = AUDIO_KIND
            self.audio[i] = (frames, tuple(PITCHES).index(pitch), tuple(CONTOURS).index(contour))
        elif p["kind"] == "video":
            frames, colour, shape, direction = p["video"]
            self.kind[i] = VIDEO_KIND
            self.video[i] = (
                frames,
                tuple(COLOURS).index(colour),
                SHAPES.index(shape),
                DIRECTIONS.index(direction),
            )
        else:
            self.kind[i], self.text[i] = TEXT_KIND, (p["start"], p["words"])


def _image_caption(images) -> str:
    """ "a red circle", or "a red circle and a blue cross" (of (h, w, colour, shape) each)."""
    return " and ".join(f"a {c} {s}" for _, _, c, s in images)


def _audio_caption(audio) -> str:
    """ "a rising high tone" (of (frames, pitch, contour))."""
    return f"a {audio[2]} {audio[1]} tone"


def _digits_below(n: np.ndarray) -> np.ndarray:
    """Decimal digits of 0, 1, ..., n - 1 together: n, plus one for every number >= 10, ..."""
    total, power = n.copy(), 10
    while power <= int(n.max(initial=0)):
        total += np.maximum(n - power, 0)
        power *= 10
    return total


def _pixels(values) -> np.ndarray:
    """uint8 pixel values of values in [-1, 1] (clipped): the nearest whose default
    normalisation, x / 127.5 - 1, gives them back."""
    x = np.clip(np.asarray(values, np.float32), -1.0, 1.0)
    return np.rint((x + 1.0) * 127.5).astype(np.uint8)


def _whole_patches(r: float, p: int, side: int) -> int:
    """A shape's radius r in pixels rounded to whole patches of p pixels: at least one, at
    most half the image's shorter side (an image one patch wide: half a patch)."""
    return min(max(p, p * round(r / p)), side // 2)


def _on_grid(v: float, p: int, lo: float, hi: float) -> float:
    """A shape's centre v in pixels moved to the nearest line between patches of p pixels
    (pixel centres are whole numbers: the line between pixels p k - 1 and p k is p k - 0.5),
    where that line lies in [lo, hi], the centres that keep the shape on its image; else v
    (an image one patch wide, merge 1, has no line inside)."""
    line = p * round(v / p)
    return line - 0.5 if lo <= line <= hi else v


def _shape_mask(height: int, width: int, cy: float, cx: float, r: float, shape: str) -> np.ndarray:
    """The pixels of a shape of radius r centred at (cy, cx) in a height x width image."""
    y = np.arange(height, dtype=np.float32)[:, None]  # (broadcast: pixel rows, columns)
    x = np.arange(width, dtype=np.float32)[None, :]
    dy, dx = np.abs(y - cy), np.abs(x - cx)
    return {  # (only the shape drawn is computed)
        "circle": lambda: dy**2 + dx**2 < r**2,
        "square": lambda: (dy < r * 0.8) & (dx < r * 0.8),
        "triangle": lambda: (y > cy - r) & (y < cy + r) & (dx < (y - (cy - r)) / 2),
        "cross": lambda: ((dx < r / 3) & (dy < r)) | ((dy < r / 3) & (dx < r)),
    }[shape]()
