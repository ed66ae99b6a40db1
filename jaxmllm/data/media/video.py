"""Videos: header info, the frame-sampling and pixel-budget rules, seek-based decoding (PyAV),
temporal patches.

The rules are Qwen2-VL's video processor's (transformers' `Qwen2VLVideoProcessor` with
`cap_pixels_per_frame=True`, which is qwen-vl-utils' reference behaviour), applied to the header
by the index and to the same header by preprocessing, so the index's counts are what training
sees:

- frames: `n = duration x data.video_fps` (duration = frames / frame rate from the header),
  at least `data.video_min_frames`, at most `data.video_max_frames` and the video's frames, then
  rounded down to a multiple of `model.vision.temporal_patch` (`sampled_frames`); frame i of n
  is the video's frame `floor(i x frames / n)` (`frame_indices`);
- size: each frame within `min(data.video_frame_max_pixels, data.video_max_pixels x
  temporal_patch // n)` pixels (the video's budget split over its frames), and at least
  `1.05 x data.video_frame_min_pixels`, on the patch x merge grid, aspect ratio kept
  (`frame_grid`, the images' `image_grid`);
- temporal patches: every `temporal_patch` frames of a patch side by side, frame-major, each
  frame's patch as an image's (rows, columns, channels), in the images' merge-block order; each
  temporal patch is one vision item, which the vision tower attends within (Qwen2-VL's).

Decoding reads the container's packet index first (demuxing only: which packets are keyframes),
then for each sampled frame seeks to the keyframe before it unless decoding on from where it is
is cheaper, so a long video sampled at 2 fps decodes only the groups of pictures that hold its
samples: at most one seek per group of pictures, however many frames it samples from it. Frames
are converted to RGB and resized by FFmpeg's swscale (bicubic) in one pass. The decoder runs
FFmpeg's frame and slice threads, as many as the process's share of the cores (the loader's
workers split them: `set_decode_threads`); the frames are the same whatever the threads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from jaxmllm.data.media.container import failure, name_of, open_video
from jaxmllm.data.media.image import MAX_PIXELS, image_grid, patchify
from jaxmllm.data.media.jpeg import ScanCaps, check_frame
from jaxmllm.data.rejects import MAX_MEDIA_BYTES, RecordError

Source = str | Path | bytes
MAX_SECONDS = 3600.0  # the default of data.max_video_seconds
MAX_DECODED_PIXELS = 1 << 38  # the default of data.max_video_decoded_pixels
MAX_RATE = 1000.0  # frames a second: a header saying more is broken or hostile
# How many frames past the header's count a stream may hold before decoding stops (a header
# that undercounts, by a little in honest files, by millions in hostile ones)
FRAME_SLACK = 1.05


@dataclass(frozen=True)
class VideoCaps:
    """What a video may cost before a frame of it is decoded (`read_video_info` refuses it
    past any, `load_video` checks again with the training config's): the defaults are the data
    config's."""

    max_seconds: float = MAX_SECONDS  # data.max_video_seconds: its length
    max_pixels: int = MAX_PIXELS  # data.max_image_pixels: a frame's width x height
    max_decoded: int = MAX_DECODED_PIXELS  # data.max_video_decoded_pixels: frames x pixels
    max_bytes: int = MAX_MEDIA_BYTES  # data.max_media_bytes: the file's size
    # An MJPEG video's frames are JPEGs: held to an image's scan caps (`check_jpeg_frame`;
    # None: not walked before they are decoded)
    scans: ScanCaps | None = None


@dataclass(frozen=True)
class VideoInfo:
    """What the index reads of a video from its header: frames, frame rate, display size."""

    frames: int  # frames in the stream (the header's count, else duration x rate)
    rate: float  # frames a second
    height: int
    width: int

    def as_size(self) -> tuple:
        """The index row's entry (`video_sizes`)."""
        return (self.frames, self.rate, self.height, self.width)

    @classmethod
    def of(cls, size: Sequence) -> VideoInfo:
        """The info of an index row's `video_sizes` entry (`as_size`'s inverse)."""
        frames, rate, height, width = size
        return cls(int(frames), float(rate), int(height), int(width))


@dataclass(frozen=True)
class VideoRule:
    """The sampling and resize rule's settings (`data.video_*`, the vision tower's patches)."""

    fps: float  # frames sampled a second
    min_frames: int
    max_frames: int
    frame_min_pixels: int  # a frame's least pixels (upscaled to it)
    frame_max_pixels: int  # a frame's most pixels
    max_pixels: int  # all of a video's sampled frames together (split over them)
    temporal_patch: int  # frames a temporal patch
    patch: int  # patch side in pixels
    merge: int  # patches a merge block's side

    @classmethod
    def of(cls, p, max_pixels: int | None = None) -> VideoRule:
        """The rule of preprocessing's `Params` (`max_pixels`: a smaller video budget)."""
        return cls(
            fps=p.video_fps,
            min_frames=p.video_min_frames,
            max_frames=p.video_max_frames,
            frame_min_pixels=p.video_frame_min_pixels,
            frame_max_pixels=p.video_frame_max_pixels,
            max_pixels=max_pixels or p.video_max_pixels,
            temporal_patch=p.temporal_patch,
            patch=p.patch_size,
            merge=p.merge,
        )


def sampled_frames(info: VideoInfo, rule: VideoRule) -> int:
    """How many frames a video gives (0: too short for one temporal patch)."""
    t = rule.temporal_patch
    most = math.floor(min(rule.max_frames, info.frames) / t) * t
    n = info.frames / info.rate * rule.fps
    n = min(max(n, rule.min_frames), most, info.frames)
    return int(math.floor(n / t) * t)


def frame_indices(total: int, n: int) -> np.ndarray:
    """The sampled frames' indices among `total`: n evenly spaced from frame 0."""
    return np.floor(np.arange(n, dtype=np.float64) * (total / n)).astype(np.int64)


def frame_max_pixels(n: int, rule: VideoRule) -> int:
    """A frame's pixel budget when the video gives n frames."""
    share = rule.max_pixels * rule.temporal_patch // n
    return max(min(rule.frame_max_pixels, share), int(rule.frame_min_pixels * 1.05))


def frame_grid(info: VideoInfo, n: int, rule: VideoRule) -> tuple[int, int]:
    """Each sampled frame's patch grid (rows, cols) for a video giving n frames."""
    most = frame_max_pixels(n, rule)
    least = min(rule.frame_min_pixels, most)
    return image_grid(info.height, info.width, rule.patch, rule.merge, least, most)


def video_time_step(info: VideoInfo, n: int, temporal_patch: int, tokens_per_second: float):
    """M-RoPE's time step per temporal patch of a video giving n frames, in absolute time
    (Qwen2.5-VL): tokens_per_second x the seconds a temporal patch spans, `temporal_patch /
    sampled fps` (transformers' `second_per_grid_ts`, the sampled fps its VideoMetadata's:
    n / frames x rate), both in float32 as its `get_rope_index` multiplies them."""
    return time_step(tokens_per_second, temporal_patch / (n / info.frames * info.rate))


def time_step(tokens_per_second: float, seconds: float) -> float:
    """tokens_per_second x `seconds` (a temporal patch's span) as transformers multiplies
    them: float32 (its `second_per_grid_ts` tensor), the product rounded to float32."""
    return float(np.float32(tokens_per_second) * np.float32(seconds))


def video_parts(info: VideoInfo, rule: VideoRule) -> tuple[int, tuple[int, int]]:
    """(temporal patches, each one's patch grid) of a video."""
    n = sampled_frames(info, rule)
    if n == 0:
        return 0, (0, 0)
    return n // rule.temporal_patch, frame_grid(info, n, rule)


# ----------------------------------------------------------------------------- headers


def read_video_info(src: Source, record_id: str = "?", caps: VideoCaps = VideoCaps()) -> VideoInfo:
    """The video's frames, rate and size from its container's header, without decoding a frame;
    refuses one over `caps` (`video_too_large`) and a truncated one (its last packets missing:
    only the tail of the packet index is read); an MJPEG one's frames are held to an image's
    JPEG bounds (`caps.scans`: `check_jpeg_frame`)."""
    with open_video(src, record_id, caps.max_bytes) as (container, stream):
        info = _header(container, stream, src, record_id)
        check_caps(info, src, record_id, caps)
        if caps.scans is not None and stream.codec_context.name == "mjpeg":
            for packet in container.demux(stream):
                check_jpeg_frame(packet, info, caps.scans, src, record_id)
            container.seek(0)
        _check_tail(container, stream, info, src, record_id)
    return info


def check_jpeg_frame(packet, info: VideoInfo, scans: ScanCaps, src, record_id) -> None:
    """An MJPEG frame (a packet: one JPEG) held to an image's JPEG bounds (`jpeg.check_frame`)
    before it is decoded: FFmpeg's MJPEG decoder reads progressive frames too."""
    data = bytes(packet)
    when = float(packet.pts * packet.time_base) if packet.pts is not None else 0.0
    at = f"MJPEG frame at {when:.2f} s"
    check_frame(
        data,
        info.width,
        info.height,
        scans,
        at if src is None else f"{name_of(src)}: {at}",
        record_id,
    )


def _header(container, stream, src: Source, record_id: str) -> VideoInfo:
    """The stream's frames, rate and display size from the container's header (a count, or
    a duration x rate where the container keeps none); refuses a rate past MAX_RATE and an
    empty stream as undecodable."""
    cc = stream.codec_context
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    if not rate or rate <= 0 or rate > MAX_RATE:
        raise RecordError("undecodable_media", f"{name_of(src)}: frame rate {rate}", record_id)
    frames = int(stream.frames or 0)
    if frames <= 0:  # (Matroska, WebM: no count in the header, a duration)
        seconds = _duration(container, stream)
        frames = int(round(seconds * rate)) if seconds else 0
    if frames <= 0 or cc.width <= 0 or cc.height <= 0:
        detail = (
            f"{name_of(src)}: empty or unknown length ({frames} frames, {cc.width}x{cc.height})"
        )
        raise RecordError("undecodable_media", detail, record_id)
    return VideoInfo(frames, float(rate), int(cc.height), int(cc.width))


def _duration(container, stream) -> float:
    """The stream's length in seconds: its own duration, else the container's (FFmpeg keeps
    that in microseconds)."""
    if stream.duration is not None and stream.time_base:
        return float(stream.duration * stream.time_base)
    return (container.duration or 0) / 1_000_000  # (AV_TIME_BASE)


def check_caps(info: VideoInfo, src, record_id: str, caps: VideoCaps) -> None:
    """Refuses (`video_too_large`) a video whose header says it is longer, its frames larger
    or all its frames together more pixels than `caps` allow."""
    seconds = info.frames / info.rate
    pixels = info.height * info.width
    if seconds > caps.max_seconds:
        detail = f"{name_of(src)}: {seconds:.1f} s > data.max_video_seconds={caps.max_seconds}"
        raise RecordError("video_too_large", detail, record_id)
    if pixels > caps.max_pixels:
        detail = (
            f"{name_of(src)}: frames of {info.width}x{info.height} = {pixels} pixels > "
            f"data.max_image_pixels={caps.max_pixels}"
        )
        raise RecordError("video_too_large", detail, record_id)
    if info.frames * pixels > caps.max_decoded:
        detail = (
            f"{name_of(src)}: {info.frames} frames x {pixels} pixels > "
            f"data.max_video_decoded_pixels={caps.max_decoded}"
        )
        raise RecordError("video_too_large", detail, record_id)


def _check_tail(container, stream, info: VideoInfo, src, record_id) -> None:
    """A file cut short loses its last packets: seek to the last keyframe before the header's
    end and demux to the end; the last packet must reach within a second of that end."""
    end = _start(stream) + info.frames / info.rate
    last = None
    try:
        container.seek(_pts(max(end - 1.0, 0.0), stream), stream=stream, backward=True)
        for packet in container.demux(stream):
            if packet.pts is not None:
                last = max(last or 0.0, float(packet.pts * stream.time_base))
    except Exception as e:  # noqa: BLE001  FFmpeg raises its own errors on broken files
        raise RecordError("undecodable_media", failure(src, e), record_id) from None
    frame = 1.0 / info.rate
    if last is None or last + frame < end - max(1.0, 2 * frame):
        at = "no packet" if last is None else f"the last packet at {last:.2f} s"
        detail = f"{name_of(src)}: truncated ({at}, the header says {end:.2f} s)"
        raise RecordError("undecodable_media", detail, record_id)


# ----------------------------------------------------------------------------- decoding


def load_video(
    src: Source,
    info: VideoInfo,
    rule: VideoRule,
    record_id: str = "?",
    parts: Sequence[int] | None = None,
    caps: VideoCaps = VideoCaps(),
    cached: Callable | None = None,
) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """The video's temporal patches as vision items, from the header `info` the index read
    (checked again: `caps` are the training config's): per temporal patch (patches [gh*gw,
    temporal_patch * patch*patch*3] uint8 pixels, normalised on the device as an image's,
    positions [gh*gw, 2] as (row, col)). `parts`: only these temporal patches are decoded
    (the others None: another host encodes them); None = all. `cached(want, shape)`: the
    frame cache's pixels of temporal patches `want` (as `patches_of` makes them) for a video
    sampled to `shape` = (frames, H, W), or None to decode them here."""
    check_caps(info, src, record_id, caps)
    count, (gh, gw) = video_parts(info, rule)
    t = rule.temporal_patch
    want = list(range(count)) if parts is None else sorted(set(parts) & set(range(count)))
    shape = (count * t, gh * rule.patch, gw * rule.patch)
    blocks = cached(want, shape) if cached is not None and want else None
    if blocks is None:
        frames = sampled_frames_of(src, info, rule, record_id, want, caps)
        blocks = patches_of(frames, rule)
    out: list[tuple[np.ndarray, np.ndarray] | None] = [None] * count
    positions = patchify(
        np.zeros((gh * rule.patch, gw * rule.patch, 1), np.uint8), rule.patch, rule.merge
    )[1]
    for j, k in enumerate(want):
        out[k] = (blocks[j], positions)
    return out


def patches_of(frames: np.ndarray, rule: VideoRule) -> list[np.ndarray]:
    """Sampled frames [k x temporal_patch, H, W, 3] as k temporal patches' pixels
    (`temporal_patch`): what the vision tower takes, what the frame cache stores."""
    t = rule.temporal_patch
    return [
        temporal_patch(frames[j : j + t], rule.patch, rule.merge) for j in range(0, len(frames), t)
    ]


def sampled_frames_of(
    src: Source,
    info: VideoInfo,
    rule: VideoRule,
    record_id: str,
    want: Sequence[int] | None = None,
    caps: VideoCaps = VideoCaps(),
) -> np.ndarray:
    """The frames the rule samples of temporal patches `want` (None: all), decoded and resized:
    uint8 [len(want) x temporal_patch, H, W, 3] (what `load_video` patches, what the frame
    cache stores); `caps`: the file's size and an MJPEG video's frames' scans."""
    count, (gh, gw) = video_parts(info, rule)
    t = rule.temporal_patch
    want = range(count) if want is None else want
    index = frame_indices(info.frames, count * t)
    size = (gw * rule.patch, gh * rule.patch)
    frames = decode_frames(
        src,
        info,
        [int(index[k * t + f]) for k in want for f in range(t)],
        size,
        record_id,
        caps=caps,
    )
    if not frames:
        return np.zeros((0, size[1], size[0], 3), np.uint8)
    return np.stack(frames)


def temporal_patch(frames: np.ndarray, patch: int, merge: int) -> np.ndarray:
    """One temporal patch's pixels [gh*gw, t*patch*patch*C] uint8 from its t frames [t, H, W,
    C]: per patch its frames side by side (frame-major), each frame's patch as an image's
    (rows, columns, channels), in the merge-block order of `image.patchify`."""
    t, h, w, c = frames.shape
    gh, gw = h // patch, w // patch
    x = frames.reshape(t, gh // merge, merge, patch, gw // merge, merge, patch, c)
    return x.transpose(1, 4, 2, 5, 0, 3, 6, 7).reshape(gh * gw, t * patch * patch * c)


def decode_frames(
    src: Source,
    info: VideoInfo,
    indices: Sequence[int],
    size: tuple[int, int],
    record_id: str,
    counts: dict | None = None,
    caps: VideoCaps = VideoCaps(),
) -> list[np.ndarray]:
    """Frames `indices` (ascending, of the header's count) as uint8 RGB [height, width, 3] at
    `size` = (width, height): each the first frame shown at or after its index's time (the
    last frame for an index past a stream shorter than its header, by at most a frame).
    `counts`, when given, gets the frames decoded and the seeks made (`decoded`, `seeks`);
    `caps`: the file's size and an MJPEG video's frames' scans."""
    if not indices:
        return []
    with open_video(src, record_id, caps.max_bytes) as (container, stream):
        try:
            mjpeg = caps.scans if stream.codec_context.name == "mjpeg" else None
            decoder = _Decoder(container, stream, info, size, mjpeg, (None, record_id))
            frames = decoder.frames(list(indices))
            if counts is not None:
                counts.update(decoded=decoder.decoded, seeks=decoder.seeks)
            return frames
        except RecordError as e:  # (the decoder's own findings: named here)
            raise RecordError(e.reason, f"{name_of(src)}: {e.detail}", record_id) from None
        except Exception as e:  # noqa: BLE001  FFmpeg's errors on broken or hostile streams
            raise RecordError("undecodable_media", failure(src, e), record_id) from None


class _Decoder:
    """Seek-based sampling: decode on from the current position, or seek to the keyframe
    before a wanted frame when that keyframe lies past the position (the frames between would
    otherwise be decoded for nothing)."""

    def __init__(self, container, stream, info: VideoInfo, size, jpeg=None, named=("", "?")):
        self.container, self.stream, self.info, self.size = container, stream, info, size
        self.jpeg, self.named = jpeg, named  # (an MJPEG stream's frame bounds; src, record)
        self.start = _start(stream)
        self.keys = self._keyframes()  # seconds, ascending
        self.budget = int(info.frames * FRAME_SLACK) + 2  # frames decoding may pass through
        self.decoded = self.seeks = 0

    def _keyframes(self) -> np.ndarray:
        """The keyframes' times (seconds, ascending) from a pass over the packets (no decoding);
        refuses more packets than the header's frames allow and checks an MJPEG stream's frames."""
        tb, most = self.stream.time_base, int(self.info.frames * FRAME_SLACK) + 2
        keys, packets = [], 0
        for packet in self.container.demux(self.stream):
            packets += 1
            if packets > most:
                raise RecordError(
                    "undecodable_media",
                    f"more than {most} packets, the header says {self.info.frames} frames",
                )
            if self.jpeg is not None:  # (each frame a JPEG: bounded before any is decoded)
                check_jpeg_frame(packet, self.info, self.jpeg, *self.named)
            if packet.is_keyframe and packet.pts is not None:
                keys.append(float(packet.pts * tb))
        return np.unique(np.asarray(keys or [self.start], np.float64))

    def frames(self, indices: list[int]) -> list[np.ndarray]:
        """The frames shown at `indices` (ascending) as RGB at the decoder's size: decoding on from
        where it is, or seeking to the keyframe before the next wanted frame when that lies
        ahead; a stream a frame or so short of its header repeats its last frame."""
        rate = self.info.rate
        shown = [self.start + i / rate for i in indices]  # when each wanted frame is shown
        out: list[np.ndarray] = []
        decoded, pos, last = None, -math.inf, None
        k = 0
        while k < len(shown):
            if decoded is None or self._key_before(shown[k]) > pos:
                key = self._key_before(shown[k])
                self.container.seek(_pts(key, self.stream), stream=self.stream, backward=True)
                decoded = self.container.decode(self.stream)
                self.seeks += 1
            for frame in decoded:
                self.decoded += 1
                if self.decoded > self.budget:
                    raise RecordError("undecodable_media", "more frames than the header says")
                pos = frame.time if frame.time is not None else pos
                last = frame
                while k < len(shown) and pos >= shown[k] - 0.5 / rate:  # (within half a frame)
                    out.append(self._rgb(frame))
                    k += 1
                if k == len(shown) or self._key_before(shown[k]) > pos:  # (seek on to it)
                    break
            else:  # the stream ended: a frame or so short of the header is the last one's
                if last is None or k < len(shown) and shown[k] - pos > 2.0 / rate:
                    raise RecordError(
                        "undecodable_media",
                        f"truncated: no frame at {shown[k]:.2f} s (the last at {pos:.2f} s)",
                    )
                out += [self._rgb(last)] * (len(shown) - k)
                k = len(shown)
        return out

    def _key_before(self, t: float) -> float:
        """The last keyframe shown at or before time t (a quarter frame's leeway)."""
        at = int(np.searchsorted(self.keys, t + 0.25 / self.info.rate, "right")) - 1
        return float(self.keys[max(at, 0)])

    def _rgb(self, frame) -> np.ndarray:
        """A decoded frame converted and resized to the target size by swscale (bicubic)."""
        width, height = self.size
        rgb = frame.reformat(width=width, height=height, format="rgb24", interpolation="BICUBIC")
        return rgb.to_ndarray()


# ----------------------------------------------------------------------------- containers


def _start(stream) -> float:
    """When the stream's first frame is shown, in seconds (0 without a start time)."""
    return float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0


def _pts(seconds: float, stream) -> int:
    """`seconds` in the stream's time base (what a seek takes)."""
    return int(Fraction(seconds).limit_denominator(1 << 20) / stream.time_base)
