"""Manifest sources: random access to raw records, and the grain source of preprocessed Samples.

A JSONL manifest holds one record a line:

    {"id": "cap-1", "text": "<image> a cat on a mat", "images": ["img/cat.jpg"]}
    {"id": "chat-7", "messages": [{"role": "user", "content": "<audio> what is this?"},
                                  {"role": "assistant", "content": "a dog barking"}],
     "audio": ["data:audio/wav;base64,UklGR..."]}

Media paths are relative to the manifest; `data:...;base64,` URIs or {"base64": ...} are inline.
Record k is the k-th non-blank line; an ArrayRecord file made by `jaxmllm.data.arrayrecord` has
the same records in the same order, with the media bytes embedded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxmllm.data import tokenizer as tok
from jaxmllm.data.preprocess import Limits, Preprocessor, Sizes, parse_record
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.samples import LengthsIndex, Sample


class JsonlRecords:
    """Random access to the lines of a JSONL manifest (byte offsets found in one scan)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.base_dir = self.path.parent
        offsets, lines = [], []
        with open(self.path, "rb") as f:
            pos = 0
            for n, raw in enumerate(f, start=1):
                if raw.strip():
                    offsets.append(pos)
                    lines.append(n)
                pos += len(raw)
        self.offsets = np.asarray(offsets, np.int64)
        self.lines = np.asarray(lines, np.int64)
        self._file = None

    def __len__(self) -> int:
        return len(self.offsets)

    def raw(self, k: int) -> tuple[object, int]:
        """(parsed JSON or a malformed marker, 1-based line number) of record k."""
        if self._file is None:
            self._file = open(self.path, "rb")  # noqa: SIM115  (one handle per process)
        self._file.seek(int(self.offsets[k]))
        text = self._file.readline()
        return parse_line(text), int(self.lines[k])

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


def open_records(path: str | Path):
    """The raw records of a JSONL manifest or an .array_record file (by suffix)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such data file: {path}")
    if path.suffix == ".array_record":
        from jaxmllm.data.arrayrecord import ArrayRecordRecords

        return ArrayRecordRecords(path)
    return JsonlRecords(path)


def read_record(records, k: int):
    """Parses record k (raises RecordError for a bad one)."""
    obj, line = records.raw(k)
    return parse_record(obj, records.base_dir, line)


class ManifestSource:
    """grain random-access source over the index's accepted records: `source[i]` -> Sample.

    Row i of the lengths index is record `rows[i]["row"]` of the file; `limits[i]` holds the
    oversize policy's repair of row i, if any.
    """

    def __init__(self, records, pre: Preprocessor, rows: list[dict], limits: dict[int, Limits]):
        self.records, self.pre, self.rows, self.limits = records, pre, rows, limits
        self.index = LengthsIndex.from_records(rows)
        self.startup_rejects: list[dict] = []  # oversize repairs and skips made at start-up
        self.index_rejects: dict[str, int] = {}  # rejects counted by the index, by reason

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Sample:
        return self.load(i)

    def load(self, i: int, images=None, audio=None) -> Sample:
        """Sample i, decoding only the listed images / clip chunks (None = all); the others are
        None in the Sample (on several hosts, another host encodes them)."""
        row = self.rows[int(i)]
        record = read_record(self.records, int(row["row"]))
        if record.id != row["id"]:
            raise RecordError(
                "changed_since_index", f"record {row['row']} is now {record.id!r}", row["id"]
            )
        limits = self.limits.get(int(i), Limits())
        sample = self.pre.sample(int(i), record, sizes_of(row), limits, images, audio)
        # The plan reserved exactly the index's counts; a record edited since (same byte size,
        # other tokens) would overflow its slot into a neighbour's, so refuse it instead.
        want = self.index.record(int(i))
        got = {
            "text": int(np.isin(sample.tokens, (tok.IMAGE, tok.AUDIO), invert=True).sum()),
            "images": [
                _indexed(want["images"], j) if m is None else len(m[0])
                for j, m in enumerate(sample.images)
            ],
            "audio": [
                _indexed(want["audio"], j) if m is None else len(m)
                for j, m in enumerate(sample.audio)
            ],
        }
        if got != want:
            raise RecordError("changed_since_index", f"now {got}, the index says {want}", row["id"])
        return sample

    def record_id(self, i: int) -> str:
        return self.rows[int(i)]["id"]


def _indexed(counts: list, j: int) -> int:
    return counts[j] if j < len(counts) else -1  # -1: not in the index, a mismatch


def sizes_of(row: dict) -> Sizes:
    """The media sizes an index row recorded."""
    return Sizes(
        images=[tuple(s) for s in row.get("image_sizes", [])],
        audio=[tuple(s) for s in row.get("audio_samples", [])],
    )
