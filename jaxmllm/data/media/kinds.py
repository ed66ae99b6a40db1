"""Each kind of media of the table (`jaxmllm.config.phases.KINDS`) as preprocessing reads it:
how its files' sizes are read from their headers, what parts an item becomes in its phase's
bucket (an image one, a video one per temporal patch, a long clip several chunks) and how they
are decoded (`MEDIA`, by kind; `jaxmllm.data.preprocess.Preprocessor` calls them). A new
modality adds its entry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from jaxmllm.data.media.audio import load_audio, read_info
from jaxmllm.data.media.image import load_image, read_size
from jaxmllm.data.media.video import (
    VideoInfo,
    VideoRule,
    frame_indices,
    load_video,
    read_video_info,
    video_parts,
    video_time_step,
)
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.samples import Item

if TYPE_CHECKING:
    from jaxmllm.config import Config
    from jaxmllm.data.preprocess import Limits, Params, Preprocessor


class Images:
    """The vision phase's own items: images, patchified at a native resolution within the pixel
    budget, one part each, taken whole."""

    size_key = "image_sizes"  # an index row's (height, width) of each image
    size_types = (int, int)
    whole = True  # an image is never cut: it fits whole or the sample is cut before it
    pixels = True  # data.on_oversize: shrink lowers its pixel budget

    def per_token(self, p: Params) -> int:
        return p.merge**2

    def largest(self, cfg: Config) -> int:
        """The most patches a vision item can have: `data.image_max_pixels` (with
        model.vision.video, or a video frame's `data.video_frame_max_pixels`) in merge blocks."""
        v, d = cfg.model.vision, cfg.data
        unit = v.patch_size * v.merge
        return max(d.image_max_pixels, d.video_frame_max_pixels * v.video) // unit**2 * v.merge**2

    def read_size(self, pre: Preprocessor, src: Any, record_id: str) -> tuple[int, int]:
        return read_size(src, record_id, pre.p.image_caps(), grid=pre.p.image_grid())

    def check(self, pre: Preprocessor, j: int, size: tuple[int, int], record_id: str) -> None:
        pass  # (image_grid upscales the smallest image to the minimum pixels)

    def parts(self, pre: Preprocessor, size, limits: Limits) -> list[tuple[int, tuple | None]]:
        gh, gw = pre.grid(*size, limits)
        return [(gh * gw, (gh, gw))]

    def stamps(self, pre: Preprocessor, size, limits: Limits) -> list[float] | None:
        return None  # (no time written before its part)

    def load(
        self,
        pre: Preprocessor,
        src,
        size,
        limits: Limits,
        record_id: str,
        parts=None,
        item: int = 0,
    ) -> list[Item]:
        p = pre.p
        budget = limits.max_pixels or p.image_max_pixels
        low = min(p.image_min_pixels, budget)
        caps = p.image_caps()
        patches, pos = load_image(src, p.patch_size, p.merge, low, budget, record_id, caps)
        return [(patches, pos)]


class Clips:
    """The audio phase's items: clips as log-mel frames, cut into chunks of at most
    `audio_max_frames` (one part each); a limit trims a chunk to whole LLM tokens."""

    size_key = "audio_samples"  # an index row's (samples, sample rate) of each clip
    size_types = (int, int)
    whole = False
    pixels = False

    def per_token(self, p: Params) -> int:
        return p.subsample

    def largest(self, cfg: Config) -> int:
        """The most frames a part (a chunk of a clip) can have."""
        return cfg.data.audio_max_frames

    def read_size(self, pre: Preprocessor, src: Any, record_id: str) -> tuple[int, int]:
        return read_info(src, record_id, caps=pre.p.audio_caps())

    def check(self, pre: Preprocessor, j: int, size: tuple[int, int], record_id: str) -> None:
        samples, rate = size
        if not pre.clip_chunks(samples, rate):
            raise RecordError("audio_too_short", f"clip {j}: {samples / rate:.3f} s", record_id)

    def parts(self, pre: Preprocessor, size, limits: Limits) -> list[tuple[int, tuple | None]]:
        return [(frames, None) for frames in pre.clip_chunks(*size)]

    def stamps(self, pre: Preprocessor, size, limits: Limits) -> list[float] | None:
        return None  # (no time written before its parts)

    def load(
        self,
        pre: Preprocessor,
        src,
        size,
        limits: Limits,
        record_id: str,
        parts=None,
        item: int = 0,
    ) -> list[Item]:
        p = pre.p
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
        return [(c, np.arange(len(c), dtype=np.int32)) for c in chunks]


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
        return p.merge**2

    def read_size(self, pre: Preprocessor, src: Any, record_id: str) -> tuple:
        return read_video_info(src, record_id, pre.p.video_caps()).as_size()

    def check(self, pre: Preprocessor, j: int, size: tuple, record_id: str) -> None:
        info = VideoInfo.of(size)
        if not video_parts(info, pre.video_rule())[0]:
            raise RecordError(
                "video_too_short",
                f"video {j}: {info.frames} frames at {info.rate:g} fps give fewer sampled frames "
                f"than one temporal patch ({pre.p.temporal_patch})",
                record_id,
            )

    def parts(self, pre: Preprocessor, size, limits: Limits) -> list[tuple[int, tuple | None]]:
        info, rule = VideoInfo.of(size), pre.video_rule(limits)
        count, (gh, gw) = video_parts(info, rule)
        tps = pre.p.video_tokens_per_second
        if not tps or not count:
            return [(gh * gw, (gh, gw))] * count
        step = video_time_step(info, count * rule.temporal_patch, rule.temporal_patch, tps)
        return [(gh * gw, (gh, gw, step))] * count  # (M-RoPE's time step: `grids`)

    def stamps(self, pre: Preprocessor, size, limits: Limits) -> list[float] | None:
        """Each temporal patch's time, where it is written before it (data.video_timestamps:
        Qwen3-VL's `<1.5 seconds>`), else None."""
        if not pre.p.video_timestamps:
            return None
        return frame_times(VideoInfo.of(size), pre.video_rule(limits))

    def load(
        self,
        pre: Preprocessor,
        src,
        size,
        limits: Limits,
        record_id: str,
        parts=None,
        item: int = 0,
    ) -> list[Item | None]:
        """The video's temporal patches (`item`: its number in the record): from the frame
        cache where the preprocessor has one (`pre.frames`) and it holds them, else decoded;
        `pre.frame_counts` counts which (frames/cache_hit, frames/decoded_<why>)."""
        info, rule = VideoInfo.of(size), pre.video_rule(limits)
        cached = None
        if pre.frames is not None:

            def cached(want, shape):
                groups, why = pre.frames.groups(record_id, item, src, want, shape, rule)
                pre.frame_counts["cache_hit" if groups is not None else f"decoded_{why}"] += 1
                return groups

        else:
            pre.frame_counts["decoded"] += 1
        caps = pre.p.video_caps()
        return load_video(src, info, rule, record_id, parts, caps, cached=cached)


# Per kind of media of the table (jaxmllm.config.phases.KINDS), its media (a test holds the two
# equal)
MEDIA = {"vision": Images(), "audio": Clips(), "video": Videos()}
