"""The lengths index: per-sample counts in model units (text tokens, patches per image, frames
per clip), what the planner plans from without touching the media."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class LengthsIndex:
    """Per-sample counts in model units, as ragged numpy arrays (vectorised planning needs them).

    text[i] = text tokens of sample i (placeholders excluded); images[images_ptr[i]:images_ptr[i+1]]
    = patches per image; audio[audio_ptr[i]:audio_ptr[i+1]] = log-mel frames per clip.
    """

    text: np.ndarray
    images_ptr: np.ndarray
    images: np.ndarray
    audio_ptr: np.ndarray
    audio: np.ndarray

    def __len__(self) -> int:
        return len(self.text)

    @classmethod
    def from_records(cls, records: list[dict]) -> LengthsIndex:
        """Builds the index from dicts like {"text": 312, "images": [1024], "audio": [850]}."""
        imgs = [list(r.get("images", [])) for r in records]
        auds = [list(r.get("audio", [])) for r in records]
        return cls(
            text=np.array([r.get("text", 0) for r in records], np.int64),
            images_ptr=np.cumsum([0] + [len(x) for x in imgs]).astype(np.int64),
            images=np.array([v for x in imgs for v in x], np.int64),
            audio_ptr=np.cumsum([0] + [len(x) for x in auds]).astype(np.int64),
            audio=np.array([v for x in auds for v in x], np.int64),
        )

    def record(self, i: int) -> dict:
        """Sample i in the lengths-file format."""
        return {
            "text": int(self.text[i]),
            "images": self.images[self.images_ptr[i] : self.images_ptr[i + 1]].tolist(),
            "audio": self.audio[self.audio_ptr[i] : self.audio_ptr[i + 1]].tolist(),
        }

    def write_jsonl(self, path: str | Path) -> None:
        """Writes the lengths file (one JSON object a line)."""
        with open(path, "w") as f:
            for i in range(len(self)):
                f.write(json.dumps(self.record(i)) + "\n")

    def per_sample_sum(self, values: np.ndarray, ptr: np.ndarray) -> np.ndarray:
        """Sum of a ragged per-item array within each sample."""
        sums = np.zeros(len(self), np.int64)
        if len(values):
            owner = np.repeat(np.arange(len(self)), np.diff(ptr))
            np.add.at(sums, owner, values)
        return sums

    def work(self, merge_area: int, subsample: int) -> np.ndarray:
        """Each sample's work per phase [sample, (LLM tokens, vision patches, audio frames)]."""
        return np.stack(
            [
                self.llm_tokens(merge_area, subsample),
                self.per_sample_sum(self.images, self.images_ptr),
                self.per_sample_sum(self.audio, self.audio_ptr),
            ],
            1,
        )

    def llm_tokens(self, merge_area: int, subsample: int) -> np.ndarray:
        """LLM sequence length of each sample: text + one token per encoder output row."""
        return (
            self.text
            + self.per_sample_sum(self.images // merge_area, self.images_ptr)
            + self.per_sample_sum(self.audio // subsample, self.audio_ptr)
        )
