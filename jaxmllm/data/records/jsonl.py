"""JSONL manifests: one record a line, read at random by byte offsets found in one scan.

    {"id": "cap-1", "text": "<image> a cat on a mat", "images": ["img/cat.jpg"]}

Media paths are relative to the manifest (or data.media_root). Record k is the k-th non-blank
line; a line that is not JSON is kept as a marker, so the parser rejects it as `malformed_line`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


class JsonlRecords:
    """Random access to the lines of a JSONL manifest (byte offsets found in one scan)."""

    def __init__(self, path: str | Path, scan: dict[str, np.ndarray] | None = None):
        self.path = Path(path)
        scan = scan if scan is not None else scan_lines(self.path)
        self.offsets, self.lines = scan["offsets"], scan["lines"]
        self._file = None

    def scan(self) -> dict[str, np.ndarray]:
        """What opening found (saved with the index, so training does not scan it again)."""
        return {"offsets": self.offsets, "lines": self.lines}

    def __len__(self) -> int:
        return len(self.offsets)

    def raw(self, k: int) -> tuple[object, int]:
        """(parsed JSON or a malformed marker, 1-based line number) of record k."""
        if self._file is None:
            self._file = open(self.path, "rb")  # noqa: SIM115  (one handle per process)
        self._file.seek(int(self.offsets[k]))
        text = self._file.readline()
        return parse_line(text), int(self.lines[k])

    def where(self, k: int) -> str:
        return f"{self.path.name} line {int(self.lines[k])}"

    def fallback_id(self, k: int) -> str:
        return f"{self.path.name}:{int(self.lines[k])}"

    def __getstate__(self):
        return {**self.__dict__, "_file": None}


def scan_lines(path: Path) -> dict[str, np.ndarray]:
    """Byte offsets and 1-based line numbers of the non-blank lines of `path`."""
    offsets, lines = [], []
    with open(path, "rb") as f:
        pos = 0
        for n, raw in enumerate(f, start=1):
            if raw.strip():
                offsets.append(pos)
                lines.append(n)
            pos += len(raw)
    return {"offsets": np.asarray(offsets, np.int64), "lines": np.asarray(lines, np.int64)}


def parse_line(text: bytes) -> object:
    """The JSON value of one manifest line, or a malformed marker the parser rejects."""
    try:
        return json.loads(text)
    # ValueError: JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits;
    # RecursionError: arrays or objects nested about a thousand deep.
    except (ValueError, RecursionError) as e:
        return {"__malformed__": f"not valid JSON: {type(e).__name__}: {e}"[:300]}
