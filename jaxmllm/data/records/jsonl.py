"""JSON data files read at random: JSON lines (one record a line) by the byte offsets of its
lines, found in one scan; a JSON list (`jsonarray`) by its elements'.

    {"id": "cap-1", "text": "<image> a cat on a mat", "images": ["img/cat.jpg"]}

Media paths are relative to the manifest (or data.media_root). Record k is the k-th non-blank
line; a line that is not JSON is kept as a marker, so the parser rejects it as `malformed_line`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxmllm.data.records.jsonarray import scan_array


class JsonRecords:
    """Random access to the records of a JSON file, by the byte range of each (found in one
    scan): the non-blank lines of JSON lines, or the elements of one JSON list
    (`jsonarray.scan_array`)."""

    def __init__(self, path: str | Path, scan: dict[str, np.ndarray] | None = None, array=False):
        self.path = Path(path)
        if scan is None:
            scan = scan_array(self.path) if array else scan_lines(self.path)
        self.starts, self.ends, self.lines = scan["starts"], scan["ends"], scan["lines"]
        self._file = None

    def scan(self) -> dict[str, np.ndarray]:
        """What opening found (saved with the index, so training does not scan it again)."""
        return {"starts": self.starts, "ends": self.ends, "lines": self.lines}

    def __len__(self) -> int:
        return len(self.starts)

    def raw(self, k: int) -> tuple[object, int]:
        """(parsed JSON or a malformed marker, the 1-based line it starts on) of record k."""
        if self._file is None:
            self._file = open(self.path, "rb")  # noqa: SIM115  (one handle per process)
        self._file.seek(int(self.starts[k]))
        return parse_line(self._file.read(int(self.ends[k] - self.starts[k]))), int(self.lines[k])

    def where(self, k: int) -> str:
        return f"{self.path.name} line {int(self.lines[k])}"

    def fallback_id(self, k: int) -> str:
        return f"{self.path.name}:{int(self.lines[k])}"

    def __getstate__(self):
        return {**self.__dict__, "_file": None}


def scan_lines(path: Path) -> dict[str, np.ndarray]:
    """Byte ranges and 1-based line numbers of the non-blank lines of `path`."""
    starts, ends, lines = [], [], []
    with open(path, "rb") as f:
        pos = 0
        for n, raw in enumerate(f, start=1):
            if raw.strip():
                starts.append(pos)
                ends.append(pos + len(raw))
                lines.append(n)
            pos += len(raw)
    as_array = lambda x: np.asarray(x, np.int64)
    return {"starts": as_array(starts), "ends": as_array(ends), "lines": as_array(lines)}


def parse_line(text: bytes) -> object:
    """The JSON value of one manifest line, or a malformed marker the parser rejects."""
    try:
        return json.loads(text)
    # ValueError: JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits;
    # RecursionError: arrays or objects nested about a thousand deep.
    except (ValueError, RecursionError) as e:
        return {"__malformed__": f"not valid JSON: {type(e).__name__}: {e}"[:300]}
