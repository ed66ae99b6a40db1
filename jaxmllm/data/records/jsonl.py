"""JSON data files read at random: JSON lines (one record a line) by the byte offsets of its
lines, found in one scan; a JSON list (`jsonarray`) by its elements'.

    {"id": "cap-1", "text": "<image> a cat on a mat", "images": ["img/cat.jpg"]}

Media paths are relative to the manifest (or data.media_root). Record k is the k-th non-blank
line; a line that is not JSON, or longer than the line cap (data.max_media_bytes), is kept as a
marker, so the parser rejects it as `malformed_line`: no line is read past the cap, so a file
of one 20 GB line costs no more memory than a short one. (A JSON list is parsed whole once when
opened; an element over the cap is likewise a marker, never read again.)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxmllm.data import budget
from jaxmllm.data.records.handles import pread
from jaxmllm.data.records.jsonarray import scan_array
from jaxmllm.data.rejects import MAX_MEDIA_BYTES

SKIP = 1 << 20  # bytes read at a time while skipping the rest of an over-long line


class JsonRecords:
    """Random access to the records of a JSON file, by the byte range of each (found in one
    scan): the non-blank lines of JSON lines, or the elements of one JSON list
    (`jsonarray.scan_array`)."""

    def __init__(
        self,
        path: str | Path,
        scan: dict[str, np.ndarray] | None = None,
        array: bool = False,
        max_bytes: int = MAX_MEDIA_BYTES,
        max_memory: int = 0,
    ):
        self.path = Path(path)
        self.max_line = max_bytes
        self.max_memory = max_memory  # data.worker_memory: budget.JSON_FACTOR x a line
        if scan is None:
            scan = scan_array(self.path) if array else scan_lines(self.path, max_bytes)
        self.starts, self.ends, self.lines = scan["starts"], scan["ends"], scan["lines"]

    def scan(self) -> dict[str, np.ndarray]:
        """What opening found (saved with the index, so training does not scan it again)."""
        return {"starts": self.starts, "ends": self.ends, "lines": self.lines}

    def __len__(self) -> int:
        return len(self.starts)

    def raw(self, k: int) -> tuple[object, int]:
        """(parsed JSON or a malformed marker, the 1-based line it starts on) of record k."""
        size, line = int(self.ends[k] - self.starts[k]), int(self.lines[k])
        if size > self.max_line + 1:  # (+1: the line's newline)
            return {"__malformed__": self._too_long()}, line
        cost = budget.JSON_FACTOR * size
        if self.max_memory and cost > self.max_memory:
            detail = budget.over(cost, self.max_memory, f"parsing its {size}-byte line")
            return {"__malformed__": detail, "__reason__": "over_memory_budget"}, line
        return parse_line(pread(self.path, int(self.starts[k]), size)), line

    def _too_long(self) -> str:
        return (
            f"the record is longer than data.max_media_bytes={self.max_line} bytes (not read); "
            "raise it for records with large inline media"
        )

    def where(self, k: int) -> str:
        return f"{self.path.name} line {int(self.lines[k])}"

    def fallback_id(self, k: int) -> str:
        return f"{self.path.name}:{int(self.lines[k])}"

    def close(self) -> None:
        """Nothing to close: lines are read through the process's bounded table of open files
        (`handles`)."""


def scan_lines(path: Path, max_line: int = MAX_MEDIA_BYTES) -> dict[str, np.ndarray]:
    """Byte ranges and 1-based line numbers of the non-blank lines of `path`; a line over
    `max_line` bytes is skipped through in blocks, never held whole (its range marks it)."""
    starts, ends, lines = [], [], []
    with open(path, "rb") as f:
        pos = n = 0
        while raw := f.readline(max_line + 1):
            n += 1
            size = len(raw)
            over = size > max_line and not raw.endswith(b"\n")
            while over and not raw.endswith(b"\n") and (raw := f.readline(SKIP)):
                size += len(raw)  # (the rest of it, never held whole)
            if over or raw.strip():
                starts.append(pos)
                ends.append(pos + size)
                lines.append(n)
            pos += size
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
