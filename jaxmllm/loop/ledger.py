"""The sample ledger (`train.ledger: true`): which samples every step trained, for audits.

Each process appends one JSON line per step to `<output_dir>/ledger/process_<i>.jsonl`:

  {"step": 7, "text": [ids whose text this process trained], "read": [ids this process loaded],
   and per encoder phase the (id, item) pairs it encoded: "vision": [[id, image], ...], ...}

A run resumed from a checkpoint redoes the steps after it and appends them again; `read_ledger`
keeps the last line of each step (and `check_replays` verifies a redone step trained the same
samples). `audit` proves what an epoch promises: every sample's text trained exactly once, by
one process, and each of its images and clips encoded exactly once.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from jaxmllm.config.phases import NAMES


class Ledger:
    """Appends this process's per-step record; lines are flushed as they are written."""

    def __init__(self, output_dir: str | Path, process: int = 0):
        """Opens this process's ledger file, <output_dir>/ledger/process_N.jsonl, appending (a
        resumed run goes on in it), line-buffered."""
        self.dir = Path(output_dir) / "ledger"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._f = open(self.dir / f"process_{process}.jsonl", "a", buffering=1)

    def write(self, step: int, parts: dict[str, np.ndarray]) -> None:
        """One line for step `step`: the sample ids of each of this host's parts (text, each
        encoder phase, read), so a run's data can be audited sample by sample."""
        row = {"step": int(step)}
        for key in ("text", *NAMES, "read"):
            row[key] = np.asarray(parts.get(key, []), np.int64).tolist()
        self._f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        """Closes the ledger file."""
        self._f.close()


def read_lines(output_dir: str | Path) -> dict[int, list[dict]]:
    """process -> every line it wrote, in order (redone steps included)."""
    out = {}
    for path in sorted((Path(output_dir) / "ledger").glob("process_*.jsonl")):
        lines = []
        for raw in path.read_text().splitlines():
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError:
                continue  # a line cut short by a kill; its step is redone after the restart
        out[int(path.stem.split("_")[1])] = lines
    return out


def read_ledger(output_dir: str | Path) -> dict[int, dict[int, dict]]:
    """step -> process -> that step's last record (the one the final parameters saw)."""
    steps: dict[int, dict[int, dict]] = {}
    for process, lines in read_lines(output_dir).items():
        for row in lines:
            steps.setdefault(row["step"], {})[process] = row
    return steps


def check_replays(output_dir: str | Path) -> list[str]:
    """Redone steps whose record differs from the first time (must be none: plans are exact)."""
    problems = []
    for process, lines in read_lines(output_dir).items():
        first: dict[int, dict] = {}
        for row in lines:
            seen = first.setdefault(row["step"], row)
            if seen != row:
                problems.append(f"process {process} step {row['step']} trained other samples")
    return problems


def audit(output_dir: str | Path, steps: range) -> dict:
    """Counts over `steps`: how often each sample's text, image and clip was trained.

    Returns {"text": Counter, and per encoder phase (vision, audio) a Counter of (id, item),
    "read": Counter, "missing_steps": [...]}; exactly-once means every count is 1 for the
    epoch's samples.
    """
    ledger = read_ledger(output_dir)
    out = {k: Counter() for k in ("text", *NAMES, "read")}
    missing = []
    for step in steps:
        if step not in ledger:
            missing.append(step)
            continue
        for row in ledger[step].values():
            out["text"].update(row["text"])
            out["read"].update(row["read"])
            for phase in NAMES:
                out[phase].update(tuple(x) for x in row.get(phase, []))
    out["missing_steps"] = missing
    return out
