"""Small video files for the tests, encoded with PyAV in tmp_path (nothing is downloaded).

Frame k of a `grey` video is flat grey at level `level(k)`, which survives lossy coding to a
level or two, so a decoded frame says which frame it was (`frame_number`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CODECS = {".mp4": "libx264", ".mkv": "libx264", ".webm": "libvpx-vp9"}


def level(k: int) -> int:
    """Frame k's grey level (frames up to 50 tell apart)."""
    return 10 + 4 * k


def frame_number(rgb: np.ndarray) -> int:
    """Which frame of a grey video a decoded frame is."""
    return int(round((float(rgb.mean()) - 10) / 4))


def grey_frames(n: int, height: int, width: int) -> np.ndarray:
    """n frames [n, height, width, 3] uint8, frame k at level(k)."""
    return np.stack([np.full((height, width, 3), level(k), np.uint8) for k in range(n)])


def write_video(
    path: Path,
    frames: np.ndarray,
    fps: int = 10,
    gop: int = 12,
    faststart: bool = False,
    title: str = "",
) -> Path:
    """Encodes uint8 RGB `frames` [n, h, w, 3] (h, w even) at `fps`, the codec by the file's
    suffix (H.264 in .mp4 / .mkv, VP9 in .webm), a keyframe at least every `gop` frames;
    `faststart`: an MP4's index before its data (as streamed files have it); `title`: the
    container's title tag."""
    import av

    path = Path(path)
    options = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), "w", options=options) as container:
        if title:
            container.metadata["title"] = title
        stream = container.add_stream(CODECS[path.suffix], rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.codec_context.gop_size = gop
        for rgb in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_empty(path: Path, height: int = 32, width: int = 48, fps: int = 10) -> Path:
    """A container with a video stream and no frame (its header written, nothing muxed)."""
    import av

    path = Path(path)
    container = av.open(str(path), "w")
    stream = container.add_stream(CODECS[path.suffix], rate=fps)
    stream.height, stream.width = height, width
    stream.pix_fmt = "yuv420p"
    container.start_encoding()
    container.close()
    return path


def moving_frames(n: int, height: int, width: int, direction: str = "right") -> np.ndarray:
    """A white square crossing n frames of noise-free dark grey left or right."""
    frames = np.full((n, height, width, 3), 40, np.uint8)
    side = max(2, height // 3)
    for k in range(n):
        x = int((width - side) * (k / max(n - 1, 1)))
        x = x if direction == "right" else width - side - x
        top = (height - side) // 2
        frames[k, top : top + side, x : x + side] = 230
    return frames
