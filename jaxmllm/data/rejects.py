"""Bad input, counted and logged: the error a record raises and the log every reject goes to.

Every skip or repair has a reason (one of REASONS) and the record's id; `RejectLog` counts them
for the step metrics and appends one JSON line per reject to a `rejects.jsonl`.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from jaxmllm.config import ConfigError

REASONS = {
    "malformed_line": "the line is not a JSON object with an id and text or messages",
    "duplicate_id": "another record already has this id",
    "missing_media": "a media file does not exist",
    "undecodable_media": "a media file (or inline data) cannot be decoded",
    "placeholder_mismatch": "<image>/<audio> placeholders differ in number from the media",
    "empty_sample": "nothing to train on: no text, no media, or no assistant turn",
    "audio_too_short": "a clip is shorter than one encoder step (subsample x 10 ms)",
    "changed_since_index": "the media differs from what the index measured; rebuild the index",
    "oversize": "larger than a bucket can hold (see data.on_oversize)",
}


class RecordError(ValueError):
    """A record that cannot become a sample; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str, record_id: str = "?"):
        assert reason in REASONS, reason
        super().__init__(f"record {record_id}: {reason}: {detail}")
        self.reason, self.detail, self.record_id = reason, detail, record_id

    def to_json(self, **extra) -> dict:
        return {"id": self.record_id, "reason": self.reason, "detail": self.detail, **extra}


class DataError(ConfigError):
    """Stops the run on bad input under a `fail` policy; the message names record and option.

    A ConfigError, so the trainer's command line prints it as a one-line error, not a traceback.
    """


def fail_message(err: RecordError, option: str, where: str) -> str:
    """The message a `fail` policy stops with: the record, the problem, the option to change."""
    alternative = "skip" if option == "data.on_error" else "shrink, truncate or skip"
    return (
        f"{where}: record {err.record_id!r}: {err.reason} ({err.detail}). "
        f"Fix the record, or set {option} to {alternative}."
    )


class RejectLog:
    """Counts rejects by key and appends them to a JSONL file (when a path is given)."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else None
        self.counts: Counter[str] = Counter()

    def add(self, key: str, entry: dict) -> None:
        """Counts `key` (e.g. "load_missing_media") and writes `entry` as one line."""
        self.counts[key] += 1
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")


def read_rejects(path: str | Path) -> list[dict]:
    """The entries of a rejects.jsonl ([] when there is none)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
