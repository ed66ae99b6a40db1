"""Record -> Sample: tokenizing, the sequence layout, media decoding.

One layout function serves both the index and training: `layout(record, sizes, limits)` turns a
parsed record plus its media sizes (read from headers by the index, checked against the decoded
media at load time) into the exact token sequence and encoder items. So the index's counts are the
counts training sees, and the oversize policy can repair a sample (a smaller image budget, a
trimmed clip, a cut sequence) from the index alone. The tokenizer (`jaxmllm.data.text.tokenizer`)
says how a record becomes token runs and media markers (`pieces`) and which id fills an item's
rows (`specials`).

Each encoder phase of the table has its media here (`MEDIA`, by phase name): how its files'
sizes are read from their headers, what parts an item becomes (an image one, a long clip several
chunks) and how they are decoded. A new modality adds its entry.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from jaxmllm.config import Config, ConfigError, phases
from jaxmllm.config.phases import BY_NAME, NAMES
from jaxmllm.data.media.audio import chunk_lengths, clip_frames, load_audio, read_info
from jaxmllm.data.media.image import image_grid, load_image, read_size
from jaxmllm.data.records.record import Record
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.samples import Item, Sample
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
    # The encoder phases the model has, comma-separated: a record with items of another phase
    # is refused at index time (`no_encoder`), naming model.<phase>
    encoders: str = ",".join(NAMES)
    # Nor do the values of pixels and frames (how they are normalised, which mel scale).
    image_mean: tuple[float, ...] = field(default=(0.5, 0.5, 0.5), compare=False)
    image_std: tuple[float, ...] = field(default=(0.5, 0.5, 0.5), compare=False)
    mel: str = field(default="jaxmllm", compare=False)
    # The bomb caps decide whether a file is decoded at all, not its counts: the loader applies
    # the training config's caps (a lowered cap rejects at load time, a raised one needs a rebuild
    # of the index to admit the files it refused).
    max_image_pixels: int = field(default=1 << 26, compare=False)
    max_audio_seconds: float = field(default=600.0, compare=False)
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
            encoders=",".join(p.name for p in phases.enabled(cfg.model)),
            image_mean=d.image_mean,
            image_std=d.image_std,
            mel=d.mel,
            max_image_pixels=d.max_image_pixels,
            max_audio_seconds=d.max_audio_seconds,
            template_date=d.template_date,
        )

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
    # per encoder phase: its units past this are cut (an image whole, a clip trimmed) with what
    # follows; a phase not listed has no limit
    max_units: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        out = {k: v for k, v in (("max_pixels", self.max_pixels),
                                 ("max_tokens", self.max_tokens)) if v is not None}  # fmt: skip
        out.update({f"max_{BY_NAME[p].unit}": n for p, n in self.max_units.items()})
        return out


@dataclass
class Sizes:
    """Media sizes of a record, per encoder phase (every phase of the table): (height, width)
    per image, (samples, rate) per clip."""

    media: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def __post_init__(self):
        self.media = {p: list(self.media.get(p, [])) for p in NAMES}


class Text(NamedTuple):
    """A run of token ids in a layout, and which of them are learned."""

    ids: np.ndarray
    loss: np.ndarray


class Part(NamedTuple):
    """An encoder item in a layout: one part of one of the record's media items."""

    phase: str  # its encoder phase
    source: int  # the record's item number in that phase
    part: int  # which part of it (a long clip's chunk; 0 for an image)
    units: int  # patches / frames it takes in the phase's bucket
    grid: tuple[int, int] | None = None  # an image's patch grid (rows, cols)


@dataclass
class Layout:
    """The exact sequence of a sample: its text runs and encoder parts in order, and whether a
    limit cut it."""

    ops: list[Text | Part]
    cut: bool = False

    def parts(self, phase: str | None = None) -> list[Part]:
        return [op for op in self.ops if isinstance(op, Part) and phase in (None, op.phase)]

    def counts(self) -> dict:
        """The sample in the lengths-file format."""
        out = {"text": int(sum(len(op.ids) for op in self.ops if isinstance(op, Text)))}
        out.update({BY_NAME[p].items: [op.units for op in self.parts(p)] for p in NAMES})
        return out

    def loss_tokens(self) -> int:
        return int(sum(op.loss.sum() for op in self.ops if isinstance(op, Text)))


class Preprocessor:
    """Turns parsed records into layouts (from sizes alone) and Samples (decoding media)."""

    def __init__(self, params: Params, tokenizer=None):
        self.p = params
        self.tokenizer = tokenizer or make_tokenizer(params.tokenizer, params.template_date)
        self.per_token = {name: media.per_token(params) for name, media in MEDIA.items()}

    def grid(self, h: int, w: int, limits: Limits = Limits()) -> tuple[int, int]:
        p = self.p
        budget = limits.max_pixels or p.image_max_pixels
        return image_grid(h, w, p.patch_size, p.merge, min(p.image_min_pixels, budget), budget)

    def sizes(self, record: Record) -> Sizes:
        """The media sizes of a record, read from the files' headers (nothing is decoded);
        raises RecordError for a file over the bomb caps or one that does not open."""
        return Sizes({p: [media.read_size(self, src, record.id) for src in record.media[p]]
                      for p, media in MEDIA.items()})  # fmt: skip

    def check_phases(self, record: Record) -> None:
        """Raises RecordError for a record with items of a phase the model has no encoder for."""
        for p in NAMES:
            if record.media[p] and p not in self.p.encoders.split(","):
                raise RecordError(
                    "no_encoder",
                    f"{len(record.media[p])} {BY_NAME[p].item} item(s), but the model has no {p} "
                    f"encoder (model.{p}.enabled: false): enable it, or leave such records out",
                    record.id,
                )

    def check(self, record: Record, sizes: Sizes) -> None:
        """Raises RecordError for an item its phase cannot use at all (a clip too short for
        one frame of features)."""
        for p, media in MEDIA.items():
            for j, size in enumerate(sizes.media[p]):
                media.check(self, j, size, record.id)

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
        budget = _Budget(limits)
        ops: list[Text | Part] = []
        for piece in pieces:
            if piece[0] == "text":
                keep = budget.take_tokens(len(piece[1]))
                if keep:
                    ops.append(Text(piece[1][:keep], piece[2][:keep]))
                if keep < len(piece[1]):
                    return Layout(ops, cut=True)
                continue
            phase, j = piece
            media, per = MEDIA[phase], self.per_token[phase]
            for c, (units, grid) in enumerate(media.parts(self, sizes.media[phase][j], limits)):
                keep = budget.take(phase, units, per, whole=media.whole)
                if keep:
                    ops.append(Part(phase, j, c, keep, grid))
                if keep < units:
                    return Layout(ops, cut=True)
        return Layout(ops)

    def sample(
        self,
        index: int,
        record: Record,
        sizes: Sizes,
        limits: Limits,
        keep: Mapping[str, tuple[int, ...]] | None = None,
        generation: bool = False,
    ) -> Sample:
        """Decodes the media and builds the Sample; checks the media against `sizes`.

        `keep[phase]`: numbers of the phase's Sample items (images; clip chunks) to decode; the
        others are None, their tokens laid out from `sizes` (another host encodes them). None =
        all. `generation`: the record as a prompt to generate from.
        """
        lay = self.layout(record, sizes, limits, generation)
        tokens, loss = [], []
        media: dict[str, list[Item | None]] = {p: [] for p in NAMES}
        decoded: dict[tuple[str, int], list[Item]] = {}  # (phase, source) -> its parts
        for op in lay.ops:
            if isinstance(op, Text):
                tokens.append(op.ids)
                loss.append(op.loss)
                continue
            items = media[op.phase]
            if keep is not None and len(items) not in keep.get(op.phase, ()):
                items.append(None)
            else:
                if (op.phase, op.source) not in decoded:
                    src, size = record.media[op.phase][op.source], sizes.media[op.phase][op.source]
                    decoded[op.phase, op.source] = MEDIA[op.phase].load(
                        self, src, size, limits, record.id
                    )
                items.append(_part(decoded[op.phase, op.source], op, record.id))
            rows = op.units // self.per_token[op.phase]
            tokens.append(np.full(rows, self.tokenizer.specials.media[op.phase], np.int32))
            loss.append(np.zeros(rows, bool))
        return Sample(
            id=index,
            tokens=np.concatenate(tokens).astype(np.int32),
            loss=np.concatenate(loss).astype(bool),
            media=media,
            grids=[op.grid for op in lay.parts() if op.grid is not None],
        )


def _part(parts: list[Item], op: Part, record_id: str) -> Item:
    """Part `op.part` of a decoded item, as the layout took it: whole where its phase takes
    items whole (the index's units exactly), else cut to the layout's units."""
    values, pos = parts[op.part] if op.part < len(parts) else (np.zeros(0), np.zeros(0, np.int32))
    whole = MEDIA[op.phase].whole
    if (len(values) != op.units) if whole else (len(values) < op.units):
        phase = BY_NAME[op.phase]
        raise RecordError(
            "changed_since_index",
            f"{phase.item} {op.source} has {len(values)} {phase.unit}, the index says {op.units}",
            record_id,
        )
    return values[: op.units], pos[: op.units]


# ----------------------------------------------------------------------------- media


class Images:
    """The vision phase's items: images, patchified at a native resolution within the pixel
    budget, one part each, taken whole."""

    size_key = "image_sizes"  # an index row's (height, width) of each image
    whole = True  # an image is never cut: it fits whole or the sample is cut before it

    def per_token(self, p: Params) -> int:
        return p.merge**2

    def read_size(self, pre: Preprocessor, src: Any, record_id: str) -> tuple[int, int]:
        return read_size(src, record_id, pre.p.max_image_pixels)

    def check(self, pre: Preprocessor, j: int, size: tuple[int, int], record_id: str) -> None:
        pass  # (image_grid upscales the smallest image to the minimum pixels)

    def parts(self, pre: Preprocessor, size, limits: Limits) -> list[tuple[int, tuple | None]]:
        gh, gw = pre.grid(*size, limits)
        return [(gh * gw, (gh, gw))]

    def load(self, pre: Preprocessor, src, size, limits: Limits, record_id: str) -> list[Item]:
        p = pre.p
        budget = limits.max_pixels or p.image_max_pixels
        patches, pos = load_image(
            src,
            p.patch_size,
            p.merge,
            min(p.image_min_pixels, budget),
            budget,
            record_id,
            max_image_pixels=p.max_image_pixels,
            mean=p.image_mean,
            std=p.image_std,
        )
        return [(patches, pos)]


class Clips:
    """The audio phase's items: clips as log-mel frames, cut into chunks of at most
    `audio_max_frames` (one part each); a limit trims a chunk to whole LLM tokens."""

    size_key = "audio_samples"  # an index row's (samples, sample rate) of each clip
    whole = False

    def per_token(self, p: Params) -> int:
        return p.subsample

    def read_size(self, pre: Preprocessor, src: Any, record_id: str) -> tuple[int, int]:
        return read_info(src, record_id, pre.p.max_audio_seconds)

    def check(self, pre: Preprocessor, j: int, size: tuple[int, int], record_id: str) -> None:
        samples, rate = size
        if not pre.clip_chunks(samples, rate):
            raise RecordError("audio_too_short", f"clip {j}: {samples / rate:.3f} s", record_id)

    def parts(self, pre: Preprocessor, size, limits: Limits) -> list[tuple[int, tuple | None]]:
        return [(frames, None) for frames in pre.clip_chunks(*size)]

    def load(self, pre: Preprocessor, src, size, limits: Limits, record_id: str) -> list[Item]:
        p = pre.p
        chunks = load_audio(
            src,
            p.audio_sample_rate,
            p.n_mels,
            p.subsample,
            p.audio_max_frames,
            expect_samples=size[0],
            record_id=record_id,
            max_seconds=p.max_audio_seconds,
            mel=p.mel,
        )
        return [(c, np.arange(len(c), dtype=np.int32)) for c in chunks]


# Per encoder phase of the table (jaxmllm.config.phases), its media (a test holds the two equal)
MEDIA = {"vision": Images(), "audio": Clips()}


class _Budget:
    """Running totals against Limits while a layout is built."""

    def __init__(self, limits: Limits):
        inf = math.inf
        self.tokens_left = limits.max_tokens if limits.max_tokens is not None else inf
        self.units_left = {p: limits.max_units.get(p, inf) for p in NAMES}

    def take_tokens(self, n: int) -> int:
        keep = int(min(n, self.tokens_left))
        self.tokens_left -= keep
        return keep

    def take(self, phase: str, units: int, per_token: int, whole: bool) -> int:
        """Units of an encoder part the limits let in: all or none where it is taken `whole`,
        else as many whole LLM tokens' worth as fit."""
        left = self.units_left[phase]
        if whole:
            keep = units if units <= left and units // per_token <= self.tokens_left else 0
        else:
            keep = int(min(units, left, self.tokens_left * per_token))
            keep -= keep % per_token
        self.units_left[phase] = left - keep
        self.tokens_left -= keep // per_token
        return keep
