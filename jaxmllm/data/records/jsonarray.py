"""JSON files that hold one list of records (LLaVA's and ShareGPT's `llava_v1_5_mix665k.json`):
the byte ranges of the list's elements, found in one pass (`jsonl.JsonRecords` reads them).

    [
      {"id": "000123", "image": "coco/000123.jpg", "conversations": [...]},
      ...
    ]

Opening parses the whole file once (Python's own JSON decoder, element by element) to find
where each element starts and ends and on which line; record k is then one `seek` and one parse
of its own bytes. A file that is not one JSON list, or breaks off inside one, stops with the
file, line and column: past a syntax error no element boundary can be trusted.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxmllm.config import ConfigError

WHITESPACE = " \t\n\r"


def scan_array(path: Path) -> dict[str, np.ndarray]:
    """Byte offsets (start, end) and first lines of the elements of the JSON list in `path`."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e}); a JSON data file must be") from None
    skew = len(data) - len(text.encode()) if data.startswith(b"\xef\xbb\xbf") else 0  # a BOM
    ascii_only = len(text) == len(data) - skew  # then a character offset is a byte offset
    decoder = json.JSONDecoder()
    pos = _skip(text, 0)
    if not text.startswith("[", pos):
        raise ConfigError(
            f"{path}: not a JSON list of records (it starts with {text[pos : pos + 20]!r})"
        )
    pos = _skip(text, pos + 1)
    starts, ends, lines = [], [], []
    byte, char, line = skew, 0, 1  # where the last element ended, in bytes, characters, lines
    while not text.startswith("]", pos):
        try:
            _, end = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError) as e:
            raise ConfigError(
                f"{path}: not valid JSON at {_place(text, pos, e)}; fix the file "
                "(or convert it to JSON lines, one record a line)"
            ) from None
        line += text.count("\n", char, pos)
        if ascii_only:
            start_b, end_b = pos + skew, end + skew
        else:
            start_b = byte + len(text[char:pos].encode())
            end_b = start_b + len(text[pos:end].encode())
        starts.append(start_b)
        ends.append(end_b)
        lines.append(line)
        line += text.count("\n", pos, end)
        byte, char = end_b, end
        pos = _skip(text, end)
        if text.startswith(",", pos):
            pos = _skip(text, pos + 1)
        elif not text.startswith("]", pos):
            raise ConfigError(f"{path}: expected ',' or ']' at {_place(text, pos)}; fix the file")
    if _skip(text, pos + 1) != len(text):
        raise ConfigError(f"{path}: text after the list's closing ']' at {_place(text, pos + 1)}")
    return {
        "starts": np.asarray(starts, np.int64),
        "ends": np.asarray(ends, np.int64),
        "lines": np.asarray(lines, np.int64),
    }


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def _place(text: str, pos: int, error: Exception | None = None) -> str:
    if isinstance(error, json.JSONDecodeError):
        return f"line {error.lineno} column {error.colno} ({error.msg})"
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return f"line {line} column {column}" + (f" ({error})" if error else "")
