"""The parameters of preprocessing, below everything that reads them: `Params`, what decides a
record's counts (the index records them, training checks them) and what caps its media's
decoding; `Limits`, a record's repairs chosen by the oversize policy.

The media kinds (`jaxmllm.data.media.kinds`) and the preprocessor (`jaxmllm.data.preprocess`)
both take these and nothing of each other: a kind is given the Params and the Limits of the
record it reads, and derives its rule and caps from them (`Params.image_caps`, `video_rule`...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from jaxmllm.config import Config, ConfigError, phases
from jaxmllm.config.phases import BY_NAME, NAMES
from jaxmllm.data import budget
from jaxmllm.data.media.audio import Caps, chunk_lengths, clip_frames, framing
from jaxmllm.data.media.image import Grid, ImageCaps, image_grid
from jaxmllm.data.media.jpeg import ScanCaps
from jaxmllm.data.media.video import VideoCaps, VideoRule
from jaxmllm.data.text.pretrained import MAX_TOKENIZER_BYTES
from jaxmllm.data.text.tokenizer import DEFAULT_DATE, tokenizer_sha256


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
    encoders: str = ",".join(NAMES)  # is refused at index time (`no_encoder`)
    image_resize: str = "round"  # data.image_resize: `image.image_grid`'s rule
    # Videos' sampling and resize rule (jaxmllm.data.media.video)
    temporal_patch: int = 1
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 768
    video_frame_min_pixels: int = 3136
    video_frame_max_pixels: int = 602112
    video_max_pixels: int = 3211264
    video_timestamps: bool = False  # (Qwen3-VL's: the time before each temporal patch)
    # How a clip's frames are counted (data.mel's: `jaxmllm.data.media.audio.clip_frames`)
    audio_framing: str = "hop"
    # M-RoPE's time per second of video (model.vision.tokens_per_second; 0: one step per
    # temporal patch): it places tokens, it does not count them
    video_tokens_per_second: float = field(default=0.0, compare=False)
    # Nor do the values of frames (which mel scale). (Pixels load as uint8: the encoder
    # normalises them on the device, by data.image_mean and image_std: `config.spec.Inputs`.)
    mel: str = field(default="jaxmllm", compare=False)
    # The bomb caps decide whether a file is decoded at all, not its counts: the loader applies
    # the training config's caps (a lowered cap rejects at load time, a raised one needs a rebuild
    # of the index to admit the files it refused).
    max_image_pixels: int = field(default=1 << 26, compare=False)
    max_image_scans: int = field(default=100, compare=False)
    max_image_scan_pixels: int = field(default=1 << 30, compare=False)
    max_audio_seconds: float = field(default=600.0, compare=False)
    max_audio_samples: int = field(default=1 << 26, compare=False)
    max_media_bytes: int = field(default=1 << 30, compare=False)
    max_video_seconds: float = field(default=3600.0, compare=False)
    max_video_decoded_pixels: int = field(default=1 << 38, compare=False)
    # A tokenizer directory's template date is part of tokenizer_sha256 (it decides counts).
    template_date: str = field(default=DEFAULT_DATE, compare=False)
    max_tokenizer_bytes: int = field(default=MAX_TOKENIZER_BYTES, compare=False)
    # The memory one record may cost a process reading it (`jaxmllm.data.budget`), in bytes,
    # resolved for the processes reading side by side (0: no budget)
    worker_memory: int = field(default=0, compare=False)

    @classmethod
    def from_config(cls, cfg: Config) -> Params:
        """The parameters of the config's data and encoders; refuses an image budget below one
        merge block."""
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
            image_resize=d.image_resize,
            audio_sample_rate=d.audio_sample_rate,
            audio_max_frames=d.audio_max_frames,
            subsample=cfg.model.audio.subsample,
            n_mels=cfg.model.audio.n_mels,
            encoders=",".join(p.name for p in phases.enabled(cfg.model)),
            temporal_patch=v.temporal_patch,
            video_fps=d.video_fps,
            video_min_frames=d.video_min_frames,
            video_max_frames=d.video_max_frames,
            video_frame_min_pixels=d.video_frame_min_pixels,
            video_frame_max_pixels=d.video_frame_max_pixels,
            video_max_pixels=d.video_max_pixels,
            video_timestamps=d.video_timestamps,
            audio_framing=framing(d.mel),
            video_tokens_per_second=v.tokens_per_second,
            mel=d.mel,
            max_image_pixels=d.max_image_pixels,
            max_image_scans=d.max_image_scans,
            max_image_scan_pixels=d.max_image_scan_pixels,
            max_audio_seconds=d.max_audio_seconds,
            max_audio_samples=d.max_audio_samples,
            max_media_bytes=d.max_media_bytes,
            max_video_seconds=d.max_video_seconds,
            max_video_decoded_pixels=d.max_video_decoded_pixels,
            template_date=d.template_date,
            max_tokenizer_bytes=d.max_tokenizer_bytes,
            worker_memory=budget.resolve(d.worker_memory, max(1, d.workers)),
        )

    def image_caps(self) -> ImageCaps:
        """What an image may cost before it is decoded (`image.open_image` refuses it past any)."""
        return ImageCaps(
            max_pixels=self.max_image_pixels,
            max_bytes=self.max_media_bytes,
            scans=self.scan_caps(),
            max_memory=self.worker_memory,
        )

    def scan_caps(self) -> ScanCaps:
        """What a JPEG's scans may cost (an image's, an MJPEG video's frames')."""
        return ScanCaps(self.max_image_scans, self.max_image_scan_pixels)

    def image_grid(self, max_pixels: int = 0) -> Grid:
        """What images are resized to (`image.Grid`), within `max_pixels` (default
        data.image_max_pixels)."""
        high = max_pixels or self.image_max_pixels
        low = min(self.image_min_pixels, high)
        return (self.patch_size, self.merge, low, high, self.image_resize)

    def patch_grid(self, h: int, w: int, max_pixels: int = 0) -> tuple[int, int]:
        """The patch grid (rows, cols) an h x w image is resized to (`image.image_grid`), within
        `max_pixels` (default data.image_max_pixels; the oversize policy's shrink lowers it)."""
        return image_grid(h, w, *self.image_grid(max_pixels))

    def audio_caps(self) -> Caps:
        """What a clip may cost before it is decoded."""
        return Caps(
            self.max_audio_seconds,
            self.max_audio_samples,
            self.max_media_bytes,
            self.worker_memory,
            self.audio_sample_rate,
        )

    def clip_chunks(self, samples: int, rate: int) -> list[int]:
        """The log-mel frames of each chunk a clip of `samples` at `rate` Hz is cut into (at
        most data.audio_max_frames each; none for a clip too short for one LLM token)."""
        frames = clip_frames(
            samples, rate, self.audio_sample_rate, self.subsample, self.audio_framing
        )
        return chunk_lengths(frames, self.audio_max_frames)

    def video_caps(self) -> VideoCaps:
        """What a video may cost before a frame of it is decoded (`video.read_video_info`)."""
        return VideoCaps(
            max_seconds=self.max_video_seconds,
            max_pixels=self.max_image_pixels,
            max_decoded=self.max_video_decoded_pixels,
            max_bytes=self.max_media_bytes,
            scans=self.scan_caps(),
        )

    def video_rule(self, max_pixels: int | None = None) -> VideoRule:
        """Videos' sampling and resize rule, within `max_pixels` for all of a video's frames
        (default data.video_max_pixels; the oversize policy's shrink lowers it)."""
        return VideoRule.of(self, max_pixels)

    def counted(self) -> dict:
        """The fields that decide counts (what an index must agree on); a field newer than
        the index format (`SINCE`) only where it is not its default, so the indexes built
        before it keep their keys."""
        fields = Params.__dataclass_fields__
        return {
            k: v
            for k, v in self.__dict__.items()
            if fields[k].compare and not (k in SINCE and v == SINCE[k])
        }


# Count-deciding fields added since indexes were first built, and their defaults
SINCE = {"video_timestamps": False, "image_resize": "round", "audio_framing": "hop"}


@dataclass(frozen=True)
class Limits:
    """Per-record repairs chosen by the oversize policy (None = the config's value / no limit)."""

    max_pixels: int | None = None  # a smaller image budget (shrink)
    video_pixels: int | None = None  # a smaller video budget (shrink: data.video_max_pixels')
    max_tokens: int | None = None  # the sequence is cut here (truncate / shrink)
    # per encoder phase: its units past this are cut (an image whole, a clip trimmed) with what
    # follows; a phase not listed has no limit
    max_units: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        """The limits set, as a reject's or a summary's JSON names them (the encoder phases'
        as `max_<unit>`: `max_patches`, `max_frames`)."""
        out = {
            k: v
            for k, v in (
                ("max_pixels", self.max_pixels),
                ("video_pixels", self.video_pixels),
                ("max_tokens", self.max_tokens),
            )
            if v is not None
        }
        out.update({f"max_{BY_NAME[p].unit}": n for p, n in self.max_units.items()})
        return out
