"""JSONL manifests: one record a line, read at random by byte offsets found in one scan.

    {"id": "cap-1", "text": "<image> a cat on a mat", "images": ["img/cat.jpg"]}

Media paths are relative to the manifest (or data.media_root). Record k is the k-th non-blank
line; a line that is not JSON, or longer than the line cap (data.max_media_bytes), is kept as a
marker, so the parser rejects it as `malformed_line`: no line is read past the cap, so a file
of one 20 GB line costs no more memory than a short one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxmllm.data.records.record import MediaPaths
from jaxmllm.data.rejects import MAX_MEDIA_BYTES

SKIP = 1 << 20  # bytes read at a time while skipping the rest of an over-long line


class JsonlRecords:
    """Random access to the lines of a JSONL manifest (byte offsets found in one scan)."""

    def __init__(
        self, path: str | Path, paths: MediaPaths | None = None, max_line: int = MAX_MEDIA_BYTES
    ):
        self.path = Path(path)
        self.paths = paths or MediaPaths(self.path.parent)
        self.base_dir = self.paths.base
        self.max_line = max_line
        offsets, lines, long = [], [], []
        with open(self.path, "rb") as f:
            pos = n = 0
            while raw := f.readline(max_line + 1):
                n += 1
                size = len(raw)
                over = size > max_line and not raw.endswith(b"\n")
                while over and not raw.endswith(b"\n") and (raw := f.readline(SKIP)):
                    size += len(raw)  # (the rest of it, never held whole)
                if over or raw.strip():
                    offsets.append(pos)
                    lines.append(n)
                    long.append(over)
                pos += size
        self.offsets = np.asarray(offsets, np.int64)
        self.lines = np.asarray(lines, np.int64)
        self.long = np.asarray(long, bool)
        self._file = None

    def __len__(self) -> int:
        return len(self.offsets)

    def raw(self, k: int) -> tuple[object, int]:
        """(parsed JSON or a malformed marker, 1-based line number) of record k."""
        if self.long[k]:
            return {"__malformed__": self._too_long()}, int(self.lines[k])
        if self._file is None:
            self._file = open(self.path, "rb")  # noqa: SIM115  (one handle per process)
        self._file.seek(int(self.offsets[k]))
        text = self._file.readline(self.max_line + 1)  # (the file may have changed since)
        if len(text) > self.max_line and not text.endswith(b"\n"):
            return {"__malformed__": self._too_long()}, int(self.lines[k])
        return parse_line(text), int(self.lines[k])

    def _too_long(self) -> str:
        return (
            f"the line is longer than data.max_media_bytes={self.max_line} bytes (not read); "
            "raise it for records with large inline media"
        )

    def __getstate__(self):
        return {**self.__dict__, "_file": None}


def parse_line(text: bytes) -> object:
    """The JSON value of one manifest line, or a malformed marker the parser rejects."""
    try:
        return json.loads(text)
    # ValueError: JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits;
    # RecursionError: arrays or objects nested about a thousand deep.
    except (ValueError, RecursionError) as e:
        return {"__malformed__": f"not valid JSON: {type(e).__name__}: {e}"[:300]}
