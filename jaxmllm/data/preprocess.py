"""Record -> Sample: tokenizing, the sequence layout, media decoding.

One layout function serves both the index and training: `layout(record, sizes, limits)` turns a
parsed record plus its media sizes (read from headers by the index, checked against the decoded
media at load time) into the exact token sequence and encoder items. So the index's counts are the
counts training sees, and the oversize policy can repair a sample (a smaller image budget, a
trimmed clip, a cut sequence) from the index alone. The tokenizer (`jaxmllm.data.text.tokenizer`)
says how a record becomes token runs and media markers (`pieces`) and which id fills an image's
or clip's rows (`specials`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from jaxmllm.config import Config, ConfigError
from jaxmllm.data.media.audio import Caps, chunk_lengths, clip_frames, load_audio, read_info
from jaxmllm.data.media.image import image_grid, load_image, read_size
from jaxmllm.data.records.record import Record
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.samples import Sample
from jaxmllm.data.text.tokenizer import DEFAULT_DATE, make_tokenizer, tokenizer_sha256

# ----------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class Params:
    """Everything that decides a record's counts; the index records it, training checks it."""

    tokenizer: str
    tokenizer_sha256: str
    patch_size: int
    merge: int
    image_min_pixels: int
    image_max_pixels: int
    audio_sample_rate: int
    audio_max_frames: int
    subsample: int
    n_mels: int = field(compare=False)  # does not change counts
    # Nor do the values of pixels and frames (how they are normalised, which mel scale).
    image_mean: tuple[float, ...] = field(default=(0.5, 0.5, 0.5), compare=False)
    image_std: tuple[float, ...] = field(default=(0.5, 0.5, 0.5), compare=False)
    mel: str = field(default="jaxmllm", compare=False)
    # The bomb caps decide whether a file is decoded at all, not its counts: the loader applies
    # the training config's caps (a lowered cap rejects at load time, a raised one needs a rebuild
    # of the index to admit the files it refused).
    max_image_pixels: int = field(default=1 << 26, compare=False)
    max_audio_seconds: float = field(default=600.0, compare=False)
    max_audio_samples: int = field(default=1 << 26, compare=False)
    max_media_bytes: int = field(default=1 << 30, compare=False)
    # A tokenizer directory's template date is part of tokenizer_sha256 (it decides counts).
    template_date: str = field(default=DEFAULT_DATE, compare=False)

    @classmethod
    def from_config(cls, cfg: Config) -> Params:
        d, v = cfg.data, cfg.model.vision
        sha = tokenizer_sha256(d.tokenizer, d.template_date)
        unit = v.patch_size * v.merge
        if d.image_max_pixels < unit * unit:
            raise ConfigError(
                f"data.image_max_pixels={d.image_max_pixels} is below one merge block "
                f"({unit}x{unit} pixels); raise it to at least {unit * unit}"
            )
        return cls(
            tokenizer=d.tokenizer,
            tokenizer_sha256=sha,
            patch_size=v.patch_size,
            merge=v.merge,
            image_min_pixels=d.image_min_pixels,
            image_max_pixels=d.image_max_pixels,
            audio_sample_rate=d.audio_sample_rate,
            audio_max_frames=d.audio_max_frames,
            subsample=cfg.model.audio.subsample,
            n_mels=cfg.model.audio.n_mels,
            image_mean=d.image_mean,
            image_std=d.image_std,
            mel=d.mel,
            max_image_pixels=d.max_image_pixels,
            max_audio_seconds=d.max_audio_seconds,
            max_audio_samples=d.max_audio_samples,
            max_media_bytes=d.max_media_bytes,
            template_date=d.template_date,
        )

    def audio_caps(self) -> Caps:
        """What a clip may cost before it is decoded."""
        return Caps(self.max_audio_seconds, self.max_audio_samples, self.max_media_bytes)

    def counted(self) -> dict:
        """The fields that decide counts (what an index must agree on)."""
        return {k: v for k, v in self.__dict__.items() if _field_compares(k)}


def _field_compares(name: str) -> bool:
    return Params.__dataclass_fields__[name].compare


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Limits:
    """Per-record repairs chosen by the oversize policy (None = the config's value / no limit)."""

    max_pixels: int | None = None  # a smaller image budget (shrink)
    max_tokens: int | None = None  # the sequence is cut here (truncate / shrink)
    max_patches: int | None = None  # images past this many patches are cut with what follows
    max_frames: int | None = None  # audio past this many frames is trimmed, what follows cut

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class Sizes:
    """Media sizes of a record: (height, width) per image, (samples, rate) per clip."""

    images: list[tuple[int, int]]
    audio: list[tuple[int, int]]


@dataclass
class Layout:
    """The exact sequence of a sample: ops in order, and whether a limit cut it."""

    ops: list[tuple]  # ("text", ids, loss) | ("image", j, gh, gw) | ("audio", j, chunk, frames)
    cut: bool = False

    def counts(self, merge_area: int) -> dict:
        """The sample in the lengths-file format."""
        text = sum(len(op[1]) for op in self.ops if op[0] == "text")
        return {
            "text": int(text),
            "images": [op[2] * op[3] for op in self.ops if op[0] == "image"],
            "audio": [op[3] for op in self.ops if op[0] == "audio"],
        }

    def loss_tokens(self) -> int:
        return int(sum(op[2].sum() for op in self.ops if op[0] == "text"))


class Preprocessor:
    """Turns parsed records into layouts (from sizes alone) and Samples (decoding media)."""

    def __init__(self, params: Params, tokenizer=None):
        self.p = params
        self.tokenizer = tokenizer or make_tokenizer(params.tokenizer, params.template_date)

    def grid(self, h: int, w: int, limits: Limits = Limits()) -> tuple[int, int]:
        p = self.p
        budget = limits.max_pixels or p.image_max_pixels
        return image_grid(h, w, p.patch_size, p.merge, min(p.image_min_pixels, budget), budget)

    def sizes(self, record: Record) -> Sizes:
        """The media sizes of a record, read from the files' headers (nothing is decoded);
        raises RecordError for a file over the bomb caps or one that does not open."""
        p = self.p
        return Sizes(
            images=[
                read_size(src, record.id, p.max_image_pixels, p.max_media_bytes)
                for src in record.images
            ],
            audio=[read_info(src, record.id, caps=p.audio_caps()) for src in record.audio],
        )

    def clip_chunks(self, samples: int, rate: int) -> list[int]:
        p = self.p
        frames = clip_frames(samples, rate, p.audio_sample_rate, p.subsample)
        return chunk_lengths(frames, p.audio_max_frames)

    def layout(
        self, record: Record, sizes: Sizes, limits: Limits = Limits(), generation: bool = False
    ) -> Layout:
        """The token sequence and encoder items of `record`, cut where `limits` say;
        `generation`: the prompt that generation continues (the tokenizer's `pieces`)."""
        pieces = self.tokenizer.pieces(record, generation)
        merge_area = self.p.merge**2
        budget = _Budget(limits)
        ops: list[tuple] = []
        for piece in pieces:
            if piece[0] == "text":
                keep = budget.take_tokens(len(piece[1]))
                if keep:
                    ops.append(("text", piece[1][:keep], piece[2][:keep]))
                if keep < len(piece[1]):
                    return Layout(ops, cut=True)
            elif piece[0] == "image":
                gh, gw = self.grid(*sizes.images[piece[1]], limits)
                if not budget.take_image(gh * gw, merge_area):
                    return Layout(ops, cut=True)
                ops.append(("image", piece[1], gh, gw))
            else:
                for c, frames in enumerate(self.clip_chunks(*sizes.audio[piece[1]])):
                    keep = budget.take_frames(frames, self.p.subsample)
                    if keep:
                        ops.append(("audio", piece[1], c, keep))
                    if keep < frames:
                        return Layout(ops, cut=True)
        return Layout(ops)

    def sample(
        self,
        index: int,
        record: Record,
        sizes: Sizes,
        limits: Limits,
        keep_images=None,
        keep_audio=None,
        generation: bool = False,
    ) -> Sample:
        """Decodes the media and builds the Sample; checks the media against `sizes`.

        `keep_images` / `keep_audio`: numbers of the images / clip chunks (the Sample's audio
        items) to decode; the others are None, their tokens laid out from `sizes` (another host
        encodes them). None = all. `generation`: the record as a prompt to generate from.
        """
        lay = self.layout(record, sizes, limits, generation)
        p, special = self.p, self.tokenizer.specials
        tokens, loss, images, audio = [], [], [], []
        clips: dict[int, list[np.ndarray]] = {}
        for op in lay.ops:
            if op[0] == "text":
                tokens.append(op[1])
                loss.append(op[2])
                continue
            if op[0] == "image" and keep_images is not None and len(images) not in keep_images:
                images.append(None)
                rows, marker = op[2] * op[3] // p.merge**2, special.image
            elif op[0] == "audio" and keep_audio is not None and len(audio) not in keep_audio:
                audio.append(None)
                rows, marker = op[3] // p.subsample, special.audio
            elif op[0] == "image":
                budget = limits.max_pixels or p.image_max_pixels
                patches, pos = load_image(
                    record.images[op[1]],
                    p.patch_size,
                    p.merge,
                    min(p.image_min_pixels, budget),
                    budget,
                    record.id,
                    max_image_pixels=p.max_image_pixels,
                    mean=p.image_mean,
                    std=p.image_std,
                    max_bytes=p.max_media_bytes,
                )
                if len(patches) != op[2] * op[3]:
                    raise RecordError(
                        "changed_since_index",
                        f"image {op[1]} has {len(patches)} patches, the index says {op[2] * op[3]}",
                        record.id,
                    )
                images.append((patches, pos))
                rows, marker = len(patches) // p.merge**2, special.image
            else:
                j, c, frames = op[1], op[2], op[3]
                if j not in clips:
                    clips[j] = load_audio(
                        record.audio[j],
                        p.audio_sample_rate,
                        p.n_mels,
                        p.subsample,
                        p.audio_max_frames,
                        expect_samples=sizes.audio[j][0],
                        record_id=record.id,
                        mel=p.mel,
                        caps=p.audio_caps(),
                    )
                chunk = clips[j][c][:frames] if c < len(clips[j]) else clips[j][0][:0]
                if len(chunk) != frames:
                    raise RecordError(
                        "changed_since_index", f"clip {j} is shorter than indexed", record.id
                    )
                audio.append(chunk)
                rows, marker = frames // p.subsample, special.audio
            tokens.append(np.full(rows, marker, np.int32))
            loss.append(np.zeros(rows, bool))
        return Sample(
            id=index,
            tokens=np.concatenate(tokens).astype(np.int32),
            loss=np.concatenate(loss).astype(bool),
            images=images,
            audio=audio,
            grids=[(op[2], op[3]) for op in lay.ops if op[0] == "image"],
        )


class _Budget:
    """Running totals against Limits while a layout is built."""

    def __init__(self, limits: Limits):
        inf = math.inf
        self.tokens_left = limits.max_tokens if limits.max_tokens is not None else inf
        self.patches_left = limits.max_patches if limits.max_patches is not None else inf
        self.frames_left = limits.max_frames if limits.max_frames is not None else inf

    def take_tokens(self, n: int) -> int:
        keep = int(min(n, self.tokens_left))
        self.tokens_left -= keep
        return keep

    def take_image(self, patches: int, merge_area: int) -> bool:
        rows = patches // merge_area
        if patches > self.patches_left or rows > self.tokens_left:
            return False
        self.patches_left -= patches
        self.tokens_left -= rows
        return True

    def take_frames(self, frames: int, subsample: int) -> int:
        keep = int(min(frames, self.frames_left, self.tokens_left * subsample))
        keep -= keep % subsample
        self.frames_left -= keep
        self.tokens_left -= keep // subsample
        return keep
