"""JSON files that hold one list of records (LLaVA's and ShareGPT's `llava_v1_5_mix665k.json`):
the byte ranges of the list's elements, found in one pass (`jsonl.JsonRecords` reads them).

    [
      {"id": "000123", "image": "coco/000123.jpg", "conversations": [...]},
      ...
    ]

Opening finds where each element starts and ends, and on which line, without parsing it: the
file is memory-mapped and walked by one regular expression that steps over whole strings and
counts brackets, so memory stays that of the offsets, whatever the file's size or its text
(parsed whole, 1 GB of ASCII took 2 GB and one emoji ~5x the file). Record k is then one read
and one parse of its own bytes; an element over the line cap (data.max_media_bytes) is never
read (`JsonRecords` rejects it), and an element that is not valid JSON is its record's reject.
A file that is not one JSON list, or breaks off inside one, stops with the file, line and
column: past a broken bracket no element boundary can be trusted.
"""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import numpy as np

from jaxmllm.config import ConfigError

BOM = b"\xef\xbb\xbf"
STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.DOTALL)  # escapes included
# From inside an element to its next bracket, over other text and whole strings (possessive:
# no backtracking, so an element that never closes costs one pass, not an exponential search).
BRACKET = re.compile(
    rb'(?>[^"\[\]{}]++|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+'  # (text and strings, never re-tried)
    rb"(?:([\[{])|([\]}]))",
    re.DOTALL,
)
SPACE = re.compile(rb"[ \t\r\n]*")
SCALAR = re.compile(rb"[^,\]\s]+")  # a number or literal element (a reject when read)
CHUNK = 1 << 24  # bytes counted at a time for line numbers


def scan_array(path: Path, limit: int | None = None) -> dict[str, np.ndarray]:
    """Byte offsets (start, end) and first lines of the elements of the JSON list in `path`
    (the first `limit` of them: all by default)."""
    with open(path, "rb") as f:
        if not f.seek(0, 2):
            raise ConfigError(f"{path}: empty; a JSON data file holds a list of records")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _scan(data, path, limit)


def _scan(data, path: Path, limit: int | None) -> dict[str, np.ndarray]:
    pos = _skip(data, 3 if data[:3] == BOM else 0)
    if data[pos : pos + 1] != b"[":
        raise ConfigError(
            f"{path}: not a JSON list of records (it starts with {bytes(data[pos : pos + 20])!r})"
        )
    pos = _skip(data, pos + 1)
    lines = Lines(data)
    starts, ends, firsts = [], [], []
    while data[pos : pos + 1] != b"]" and (limit is None or len(starts) < limit):
        end = _element_end(data, pos, path, lines)
        starts.append(pos)
        ends.append(end)
        firsts.append(lines.at(pos))
        pos = _skip(data, end)
        if data[pos : pos + 1] == b",":
            pos = _skip(data, pos + 1)
        elif data[pos : pos + 1] != b"]":
            raise ConfigError(f"{path}: expected ',' or ']' at {_place(data, pos, lines)}; fix it")
    if limit is None and _skip(data, pos + 1) != len(data):
        where = _place(data, pos + 1, lines)
        raise ConfigError(f"{path}: text after the list's closing ']' at {where}")
    return {
        "starts": np.asarray(starts, np.int64),
        "ends": np.asarray(ends, np.int64),
        "lines": np.asarray(firsts, np.int64),
    }


def _element_end(data, pos: int, path: Path, lines: Lines) -> int:
    """Where the element starting at `pos` ends: its brackets closed, strings stepped over."""
    head = data[pos : pos + 1]
    if head in (b"{", b"["):
        depth, at, step = 1, pos + 1, BRACKET.match
        while m := step(data, at):
            at = m.end()
            depth += 1 if m.lastindex == 1 else -1
            if depth == 0:
                return at
    else:
        m = (STRING if head == b'"' else SCALAR).match(data, pos)
        if m is not None:
            return m.end()
    raise ConfigError(
        f"{path}: not valid JSON at {_place(data, pos, lines)} (the element starting there never "
        "ends: the file breaks off, or a bracket or quote is missing); fix the file (or convert "
        "it to JSON lines, one record a line)"
    )


def _skip(data, pos: int) -> int:
    return SPACE.match(data, pos).end()


class Lines:
    """1-based line numbers of increasing byte offsets, newlines counted a chunk at a time."""

    def __init__(self, data):
        self.data, self.pos, self.line = data, 0, 1

    def at(self, pos: int) -> int:
        while self.pos < pos:
            step = min(pos, self.pos + CHUNK)
            self.line += self.data[self.pos : step].count(b"\n")
            self.pos = step
        return self.line


def _place(data, pos: int, lines: Lines) -> str:
    column = pos - (data.rfind(b"\n", 0, pos) + 1) + 1
    return f"line {lines.at(pos)} column {column}"
