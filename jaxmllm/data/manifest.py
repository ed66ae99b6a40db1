"""The grain source of preprocessed Samples over a data file's indexed records.

The file formats and the record parser are in `jaxmllm.data.records`.
"""

from __future__ import annotations

import numpy as np

from jaxmllm.data import tokenizer as tok
from jaxmllm.data.preprocess import Limits, Preprocessor, Sizes
from jaxmllm.data.records import read_record
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.samples import LengthsIndex, Sample


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
