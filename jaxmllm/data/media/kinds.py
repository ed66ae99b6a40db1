"""Each kind of media of the table (`jaxmllm.config.phases.KINDS`) as preprocessing reads it:
how its files' sizes are read from their headers, what parts an item becomes in its phase's
bucket (an image one, a video one per temporal patch, a long clip several chunks) and how they
are decoded (`MEDIA`, by kind; `jaxmllm.data.preprocess.Preprocessor` calls them). Each is a
`jaxmllm.data.media.kind.MediaKind`, given the parameters (`jaxmllm.data.params`) and nothing of
the preprocessor. A new modality adds its entry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxmllm.data.media.audio import (
    GEMMA4,
    chunk_positions,
    load_audio,
    read_info,
    valid_frames,
)
from jaxmllm.data.media.image import load_image, read_size
from jaxmllm.data.media.kind import Decoding, MediaKind, PartOf
from jaxmllm.data.media.video import (
    VideoInfo,
    VideoRule,
    frame_indices,
    load_video,
    read_video_info,
    video_parts,
    video_time_step,
)
from jaxmllm.data.params import Limits, Params
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.samples import Item

if TYPE_CHECKING:
    from jaxmllm.config import Config


class Images:
    """The vision phase's own items: images, patchified at a native resolution within the pixel
    budget, one part each, taken whole."""

    size_key = "image_sizes"  # an index row's (height, width) of each image
    size_types = (int, int)
    whole = True  # an image is never cut: it fits whole or the sample is cut before it
    pixels = True  # data.on_oversize: shrink lowers its pixel budget

    def per_token(self, p: Params) -> int:
        """A merge block's patches: the projector makes one LLM token of each."""
        return p.merge**2

    def largest(self, cfg: Config) -> int:
        """The most patches a vision item can have: `data.image_max_pixels` (with
        model.vision.video, or a video frame's `data.video_frame_max_pixels`) in merge blocks."""
        v, d = cfg.model.vision, cfg.data
        unit = v.patch_size * v.merge
        return max(d.image_max_pixels, d.video_frame_max_pixels * v.video) // unit**2 * v.merge**2

    def read_size(self, p: Params, src: Any, record_id: str) -> tuple[int, int]:
        """(height, width) as displayed, from the header (within data.max_image_* caps and
        data.worker_memory for its decoding at data.image_max_pixels)."""
        return read_size(src, record_id, p.image_caps(), grid=p.image_grid())

    def check(self, p: Params, j: int, size: tuple[int, int], record_id: str) -> None:
        """Nothing to refuse: `image_grid` upscales the smallest image to the minimum pixels."""

    def parts(self, p: Params, size, limits: Limits) -> list[PartOf]:
        """One part: the image's patches on its grid within the record's pixel budget."""
        gh, gw = p.patch_grid(*size, limits.max_pixels or 0)
        return [(gh * gw, (gh, gw))]

    def stamps(self, p: Params, size, limits: Limits) -> list[float] | None:
        """None: no time is written before an image."""
        return None

    def load(
        self,
        p: Params,
        src,
        size,
        limits: Limits,
        record_id: str,
        parts=None,
        item: int = 0,
        decoding: Decoding | None = None,
    ) -> list[Item | None]:
        """The image decoded, resized to its grid within the record's pixel budget, as
        (patches, positions): its one part."""
        patch, merge, low, high, rule = p.image_grid(limits.max_pixels or 0)
        patches, pos = load_image(src, patch, merge, low, high, record_id, p.image_caps(), rule)
        return [(patches, pos)]


class Clips:
    """The audio phase's items: clips as log-mel frames, cut into chunks of at most
    `audio_max_frames` (one part each); a limit trims a chunk to whole LLM tokens."""

    size_key = "audio_samples"  # an index row's (samples, sample rate) of each clip
    size_types = (int, int)
    whole = False
    pixels = False

    def per_token(self, p: Params) -> int:
        """Log-mel frames the audio encoder's stem and projector make one LLM token of."""
        return p.subsample

    def largest(self, cfg: Config) -> int:
        """The most frames a part (a chunk of a clip) can have."""
        return cfg.data.audio_max_frames

    def read_size(self, p: Params, src: Any, record_id: str) -> tuple[int, int]:
        """(samples, sample rate) from the header, within the data.max_audio_* caps."""
        return read_info(src, record_id, caps=p.audio_caps())

    def check(self, p: Params, j: int, size: tuple[int, int], record_id: str) -> None:
        """Refuses a clip too short for one LLM token's frames (`audio_too_short`)."""
        samples, rate = size
        if not p.clip_chunks(samples, rate):
            raise RecordError("audio_too_short", f"clip {j}: {samples / rate:.3f} s", record_id)

    def parts(self, p: Params, size, limits: Limits) -> list[PartOf]:
        """A part per chunk of at most data.audio_max_frames frames (a limit trims the last
        one taken, `preprocess._Budget`)."""
        return [(frames, None) for frames in p.clip_chunks(*size)]

    def stamps(self, p: Params, size, limits: Limits) -> list[float] | None:
        """None: no time is written before a clip's chunks."""
        return None

    def load(
        self,
        p: Params,
        src,
        size,
        limits: Limits,
        record_id: str,
        parts=None,
        item: int = 0,
        decoding: Decoding | None = None,
    ) -> list[Item | None]:
        """The clip decoded to log-mel frames at data.audio_sample_rate, cut in its chunks,
        each with its frames' positions (-1 on the frames that pad its last LLM token, Gemma
        4's: `chunk_positions`)."""
        chunks = load_audio(
            src,
            p.audio_sample_rate,
            p.n_mels,
            p.subsample,
            p.audio_max_frames,
            expect_samples=size[0],
            record_id=record_id,
            mel=p.mel,
            caps=p.audio_caps(),
        )
        valid = sum(map(len, chunks))  # (Gemma 4's framing: its last token's padding less)
        if p.audio_framing == GEMMA4:
            valid = valid_frames(size[0], size[1], p.audio_sample_rate)
        return list(zip(chunks, chunk_positions([len(c) for c in chunks], valid), strict=True))


def frame_times(info: VideoInfo, rule: VideoRule) -> list[float]:
    """Each temporal patch's time in seconds: the mean of its first and last sampled frames'
    (frame index / the video's frame rate), as Qwen3-VL's processor computes the timestamps
    it writes before each (its `_calculate_timestamps`)."""
    count = video_parts(info, rule)[0]
    t = rule.temporal_patch
    seconds = frame_indices(info.frames, count * t) / info.rate
    return [float((seconds[k * t] + seconds[k * t + t - 1]) / 2) for k in range(count)]


class Videos:
    """Videos, in the vision phase: frames sampled and resized by the video rule
    (`jaxmllm.data.media.video`), one part per temporal patch, each taken whole (a cut keeps
    the video's first temporal patches)."""

    size_key = "video_sizes"  # an index row's (frames, frame rate, height, width) of each video
    size_types = (int, float, int, int)
    whole = True
    pixels = True

    def per_token(self, p: Params) -> int:
        """A merge block's patches, as an image's."""
        return p.merge**2

    def read_size(self, p: Params, src: Any, record_id: str) -> tuple:
        """(frames, frame rate, height, width) from the container's header, within the
        data.max_video_* caps (an MJPEG video's frames within the JPEG scan caps)."""
        return read_video_info(src, record_id, p.video_caps()).as_size()

    def check(self, p: Params, j: int, size: tuple, record_id: str) -> None:
        """Refuses a video too short for one temporal patch (`video_too_short`)."""
        info = VideoInfo.of(size)
        if not video_parts(info, p.video_rule())[0]:
            raise RecordError(
                "video_too_short",
                f"video {j}: {info.frames} frames at {info.rate:g} fps give fewer sampled frames "
                f"than one temporal patch ({p.temporal_patch})",
                record_id,
            )

    def parts(self, p: Params, size, limits: Limits) -> list[PartOf]:
        """A part per temporal patch, on the frames' grid within the record's video budget
        (and M-RoPE's time step per temporal patch, where placed in absolute time)."""
        info, rule = VideoInfo.of(size), p.video_rule(limits.video_pixels)
        count, (gh, gw) = video_parts(info, rule)
        tps = p.video_tokens_per_second
        if not tps or not count:
            return [(gh * gw, (gh, gw))] * count
        step = video_time_step(info, count * rule.temporal_patch, rule.temporal_patch, tps)
        return [(gh * gw, (gh, gw, step))] * count  # (M-RoPE's time step: `grids`)

    def stamps(self, p: Params, size, limits: Limits) -> list[float] | None:
        """Each temporal patch's time, where it is written before it (data.video_timestamps:
        Qwen3-VL's `<1.5 seconds>`), else None."""
        if not p.video_timestamps:
            return None
        return frame_times(VideoInfo.of(size), p.video_rule(limits.video_pixels))

    def load(
        self,
        p: Params,
        src,
        size,
        limits: Limits,
        record_id: str,
        parts=None,
        item: int = 0,
        decoding: Decoding | None = None,
    ) -> list[Item | None]:
        """The video's temporal patches (`item`: its number in the record): from the frame
        cache where the load has one (`decoding.frames`) and it holds them, else decoded;
        `decoding.counts` counts which (frames/cache_hit, frames/decoded_<why>)."""
        decoding = decoding or Decoding()
        info, rule = VideoInfo.of(size), p.video_rule(limits.video_pixels)
        cache, counts = decoding.frames, decoding.counts
        cached = None
        if cache is not None:

            def cached(want, shape):
                groups, why = cache.groups(record_id, item, src, want, shape, rule)
                counts["cache_hit" if groups is not None else f"decoded_{why}"] += 1
                return groups

        else:
            counts["decoded"] += 1
        return load_video(src, info, rule, record_id, parts, p.video_caps(), cached=cached)


# Per kind of media of the table (jaxmllm.config.phases.KINDS), its media (a test holds the two
# equal)
MEDIA: dict[str, MediaKind] = {"vision": Images(), "audio": Clips(), "video": Videos()}
