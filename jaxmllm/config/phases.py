"""The phase table: the modalities the trainer knows, and every name each one goes by.

A step runs in phases: each encoder (with its projector) on a bucket of its own, then the LLM on
the text with the encoders' output rows in its placeholder slots. The LLM phase is always there;
the encoder phases are the entries of `ENCODERS`, in the order their work, buckets and exchanged
rows are laid out everywhere. Code iterates this table instead of naming a modality, so a new one
is an entry here, its encoder config section (`jaxmllm.config.model`: `enabled`, `freeze`, the
units it counts), its preprocessor (`jaxmllm.data.preprocess`) and its encoder module
(`jaxmllm.models`).

What an entry names, for the vision phase:
- name `vision`: the config sections `model.vision`, `pipeline.vision`, `init_from.vision`; the
  batch arrays' prefix (`vision_segment_ids`, `vision_tiles`, `llm_vision_src`, ...); the
  model's `vision` and `vision_projector` modules; `batch.vision_tiles`, `vision_documents`;
- item `image`: one item in messages ("image 2 of sample 7"), and its placeholder `<image>`;
- items `images`: a record's, a sample's and a lengths-file row's list of items;
- unit `patches`: what its bucket counts (the lengths index's units);
- capacity `vision_patches`: `batch.vision_patches`, its bucket per device and microbatch, and
  the batch array of its inputs;
- files `jpg`, `png`, ...: the file name extensions of its items where a data set names its media
  by file type (a WebDataset shard's members `000123.jpg`);
- pixels: its inputs are uint8 pixel values, normalised on the device (`config.spec.Inputs`).

The units an encoder counts and how they become rows come from its config section
(`units_per_token`, `units_per_row`, `input_width`, `position_dims`).

Records hold media of a few kinds (`KINDS`), each encoded in a phase's bucket: every phase takes
its own kind (named as the phase: an image, a clip), and the vision phase takes videos too
(`VIDEO`: a video is one vision item per temporal patch, `model.vision.temporal_patch` frames,
which the vision tower attends within, as Qwen2-VL's does). A kind names what a record calls
its items, its placeholder and its placeholder id; the plan, the batch and the model see only
the phases. Videos share the vision bucket rather than having one of their own: on a
video-heavy mix a bucket of their own plans less useful work (`jaxmllm.bench.balance --mix
video`: goodput 0.92 against 0.96 at 8 devices), since each bucket must hold the largest item
of its own kind however few of them the data has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LLM = "llm"  # the decoder's phase: text tokens and the encoders' rows in their slots


@dataclass(frozen=True)
class Phase:
    """One encoder phase (a modality): see the table in the module docstring."""

    name: str  # model.<name>, the batch arrays' prefix, the model's modules
    item: str  # one item, in messages; its text placeholder is <item>
    items: str  # the key of a record's, a sample's and a lengths row's list of items
    unit: str  # what its bucket counts
    capacity: str  # batch.<capacity>: its bucket per device and microbatch; its inputs' array
    reserved_id: int  # its placeholder id among jaxmllm's reserved ids (byte tokenizer)
    files: tuple[str, ...] = ()  # its items' file name extensions (lower case, no dot)
    # Its inputs are 8-bit pixel values, channels last (RGB): they travel to the devices as
    # uint8 and its encoder normalises them there (`config.spec.Inputs`): a quarter of
    # float32's bytes. Otherwise they are features (float32, or bf16: `Inputs`).
    pixels: bool = False

    @property
    def placeholder(self) -> str:
        """The text that places an item in a record (`<image>`)."""
        return f"<{self.item}>"

    @property
    def tiles(self) -> str:
        """batch.<tiles>: the attention tiles of block-sparse attention per bucket."""
        return f"{self.name}_tiles"

    @property
    def long_tiles(self) -> str:
        """batch.<long_tiles>: the attention tiles per bucket of the long step variants."""
        return f"{self.name}_long_tiles"

    @property
    def documents(self) -> str:
        """batch.<documents>: the most documents one row holds (cuDNN attention)."""
        return f"{self.name}_documents"

    @property
    def src(self) -> str:
        """The batch array that points each LLM slot of this phase at an encoder row."""
        return f"llm_{self.name}_src"

    def encoder(self, model: Any) -> Any:
        """This phase's encoder config section of a ModelConfig (`model.<name>`)."""
        return getattr(model, self.name)

    def enabled(self, model: Any) -> bool:
        """Whether the model has this encoder."""
        return bool(self.encoder(model).enabled)

    def per_token(self, model: Any) -> int:
        """Units per LLM token (a projector output row): vision merge**2, audio subsample."""
        return int(self.encoder(model).units_per_token)

    def per_row(self, model: Any) -> int:
        """Units per encoder row, what its attention sees: a patch, or `stride` frames."""
        return int(self.encoder(model).units_per_row)

    def bucket(self, batch: Any) -> int:
        """batch.<capacity> of a BatchConfig."""
        return int(getattr(batch, self.capacity))


VISION = Phase(
    "vision",
    "image",
    "images",
    "patches",
    "vision_patches",
    reserved_id=259,
    files=("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff", "ppm", "tga", "avif", "qoi"),
    pixels=True,
)
AUDIO = Phase(
    "audio",
    "audio",
    "audio",
    "frames",
    "audio_frames",
    reserved_id=260,
    files=("wav", "flac", "ogg", "oga", "mp3"),
)

ENCODERS: tuple[Phase, ...] = (VISION, AUDIO)  # (the order of every per-phase layout)
BY_NAME = {p.name: p for p in ENCODERS}
NAMES = tuple(BY_NAME)  # the encoder phases' names, in order
PHASES = (LLM, *NAMES)  # every phase of a step, the LLM's first


@dataclass(frozen=True)
class Kind:
    """A kind of media item records hold, and the encoder phase whose bucket takes its items."""

    name: str  # the key of its sources and sizes in a record, of its placeholder id, its media
    item: str  # one item, in messages and a record's content parts; its placeholder is <item>
    items: str  # the key of a record's list of items (a lengths row's is its phase's `items`)
    phase: str  # the encoder phase that encodes it
    reserved_id: int  # its placeholder id among jaxmllm's reserved ids (byte tokenizer)
    files: tuple[str, ...] = ()  # its items' file name extensions (a WebDataset shard's members)

    @property
    def placeholder(self) -> str:
        """The text that places an item in a record (`<video>`)."""
        return f"<{self.item}>"

    @classmethod
    def own(cls, p: Phase) -> Kind:
        """The kind a phase takes as its own (named as the phase: `vision` is images)."""
        return cls(p.name, p.item, p.items, p.name, p.reserved_id, p.files)


VIDEO = Kind(
    "video",
    "video",
    "videos",
    "vision",
    reserved_id=263,
    files=("mp4", "webm", "mkv", "mov", "avi"),
)
KINDS: tuple[Kind, ...] = (*(Kind.own(p) for p in ENCODERS), VIDEO)  # (the order of flags)
KIND = {k.name: k for k in KINDS}


def kinds_of(phase_name: str) -> tuple[Kind, ...]:
    """The kinds of media an encoder phase's bucket takes."""
    return tuple(k for k in KINDS if k.phase == phase_name)


def phase(name: str) -> Phase:
    """The encoder phase called `name`."""
    if name not in BY_NAME:
        raise KeyError(f"no encoder phase {name!r}: one of {', '.join(NAMES)}")
    return BY_NAME[name]


def enabled(model: Any) -> tuple[Phase, ...]:
    """The encoder phases a ModelConfig has, in order."""
    return tuple(p for p in ENCODERS if p.enabled(model))


def in_batch(model: Any, batch: Any) -> tuple[Phase, ...]:
    """The encoder phases a step runs: those the model has whose bucket (batch.<capacity>) is
    not zero. A phase the data has no items of gets a zero bucket (`resolve.sizing.resolve_batch`):
    its encoder is left out of the step, its parameters kept (and not trained)."""
    return tuple(p for p in enabled(model) if p.bucket(batch) > 0)
