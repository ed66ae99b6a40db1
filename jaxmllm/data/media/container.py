"""A video file opened with FFmpeg (PyAV) for reading: its first video stream, decoded by the
process's share of the cores.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from jaxmllm.data.rejects import MAX_MEDIA_BYTES, RecordError, check_media_file

Source = str | Path | bytes
# Decoder threads per process (FFmpeg's frame and slice threads): the process's share of the
# cores it may run on. The loader's worker processes decode side by side, so each gets
# cores // workers (`set_decode_threads`); 0 = every core (decoding in the training process).
_THREADS = [0]


class open_video:
    """`with open_video(src, record_id) as (container, stream)`: the first video stream, opened for
    reading with one decoder thread; a file that does not open is `undecodable_media`."""

    def __init__(self, src: Source, record_id: str, max_bytes: int = MAX_MEDIA_BYTES):
        """A video file to open (`src`: a path or inline bytes), refused past `max_bytes`."""
        self.src, self.record_id, self.max_bytes = src, record_id, max_bytes

    def __enter__(self):
        """Opens the container with PyAV: it and its first video stream, decoder threads set;
        refuses a file over the size cap, one FFmpeg cannot read, one without a video stream."""
        import av  # (PyAV: FFmpeg's libraries as a wheel; imported only where videos are read)

        check_media_file(self.src, self.record_id, self.max_bytes)  # (data.max_media_bytes)
        data = io.BytesIO(self.src) if isinstance(self.src, bytes) else str(self.src)
        try:
            self.container = av.open(data, mode="r", **open_options(av.__version__))
        except Exception as e:  # noqa: BLE001  anything FFmpeg says about a file it cannot read
            raise RecordError("undecodable_media", failure(self.src, e), self.record_id) from None
        if not self.container.streams.video:
            self.container.close()
            raise RecordError(
                "undecodable_media", f"{name_of(self.src)}: no video stream", self.record_id
            )
        stream = self.container.streams.video[0]
        threads = decode_threads()
        # (frame threads decode several frames at once; FFmpeg's output is the same, bit for
        # bit, whatever the threads: H.264 and VP9 decoding is exact)
        stream.thread_type = "AUTO" if threads > 1 else "SLICE"
        stream.thread_count = threads
        return self.container, stream

    def __exit__(self, *exc):
        """Closes the container; exceptions go on."""
        self.container.close()
        return False


def open_options(version: str) -> dict[str, str]:
    """`av.open`'s keywords: PyAV < 19 raises on metadata that is not UTF-8 unless told to
    ignore it; 19 dropped the keyword (a TypeError) and never raises (surrogateescape)."""
    return {"metadata_errors": "ignore"} if int(version.split(".")[0]) < 19 else {}


def cores() -> int:
    """The cores this process may run on (its affinity; the machine's where unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (macOS)
        return os.cpu_count() or 1


def share_of_cores(workers: int) -> int:
    """Decoder threads for each of `workers` processes decoding side by side (0: one process)."""
    return max(1, cores() // max(1, workers))


def set_decode_threads(n: int) -> None:
    """This process's decoder threads from now on (0: every core it may run on)."""
    _THREADS[0] = int(n)


def decode_threads() -> int:
    """FFmpeg threads a video decoder takes: this process's share (`set_decode_threads`), else
    every core."""
    return _THREADS[0] or cores()


def failure(src: Source, e: Exception) -> str:
    """What FFmpeg said about `src`, for a reject's detail."""
    return f"{name_of(src)}: {type(e).__name__}: {e}"[:500]


def name_of(src: Source) -> str:
    """A video as messages name it: its path, or its inline bytes' count."""
    return f"<{len(src)} inline bytes>" if isinstance(src, bytes) else str(src)
