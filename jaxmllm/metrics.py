"""Step metrics: analytic FLOPs of the real (non-padding) work, and where metrics are written.

Metrics go to `<output_dir>/metrics.jsonl` (one JSON object per logged step), TensorBoard event
files under `<output_dir>/tb/`, and a tqdm progress bar on the terminal.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from jaxmllm.config import Config
from jaxmllm.data.cost import CostModel


def _segment_stats(seg: np.ndarray) -> tuple[float, float]:
    """(real tokens, sum of squared segment lengths) over rows of segment ids [..., n]."""
    rows = seg.reshape(-1, seg.shape[-1]).astype(np.int64)
    real = rows > 0
    # One bin per (row, segment id): a segment's length is its bin count.
    keys = (np.arange(len(rows))[:, None] * (rows.max() + 1) + rows)[real]
    counts = np.bincount(keys).astype(np.float64)
    return float(real.sum()), float((counts**2).sum())


def step_flops(cfg: Config, batch: dict[str, np.ndarray], cost: CostModel | None = None) -> float:
    """Model FLOPs of one step's real (non-padding) items, from the planner's cost model.

    Per phase: linear * (real units) + quadratic * (sum of squared segment lengths), with the
    training multipliers for trained and frozen modules (see jaxmllm/data/cost.py).
    """
    cost = cost or CostModel.from_model(cfg.model)
    total = 0.0
    for phase in ("llm", "vision", "audio"):
        key = f"{phase}_segment_ids"
        if key in batch:
            real, sq = _segment_stats(batch[key])
            total += cost.phase(phase).linear * real + cost.phase(phase).quadratic * sq
    return total


class MetricsWriter:
    """Writes metric dicts to JSONL and TensorBoard (process 0 only)."""

    def __init__(self, output_dir: str | Path, enabled: bool = True):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(out / "metrics.jsonl", "a")
        try:
            from tensorboardX import SummaryWriter
        except ImportError:  # TensorBoard is optional at run time; JSONL always works
            SummaryWriter = None
        if SummaryWriter is not None:
            self._tb = SummaryWriter(str(out / "tb"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def _plain(v):
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    return v


def read_metrics(output_dir: str | Path) -> list[dict]:
    """All rows of a run's metrics.jsonl (later rows win for a step written twice)."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["step"]] = row
    return [rows[k] for k in sorted(rows)]
