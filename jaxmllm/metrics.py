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


def _block_flops(
    tokens: float, sq_sum: float, width: int, mlp: int, kv_width: int, causal: bool
) -> float:
    """Forward FLOPs of one pre-norm transformer layer over `tokens` real tokens.

    Linear part: q, o projections (2 d^2), k, v (2 d kv), gated MLP (3 d f), 2 FLOPs per MAC.
    Attention part: QK^T and AV over each segment, sum of n^2 (halved when causal).
    """
    linear = 2.0 * tokens * (2 * width * width + 2 * width * kv_width + 3 * width * mlp)
    attn = 4.0 * sq_sum * width * (0.5 if causal else 1.0)
    return linear + attn


def _segment_stats(seg: np.ndarray) -> tuple[float, float]:
    """(real tokens, sum of squared segment lengths) over rows of segment ids [..., n]."""
    rows = seg.reshape(-1, seg.shape[-1]).astype(np.int64)
    real = rows > 0
    # One bin per (row, segment id): a segment's length is its bin count.
    keys = (np.arange(len(rows))[:, None] * (rows.max() + 1) + rows)[real]
    counts = np.bincount(keys).astype(np.float64)
    return float(real.sum()), float((counts**2).sum())


def step_flops(cfg: Config, batch: dict[str, np.ndarray]) -> float:
    """Model FLOPs of one step's real tokens (training = 3x forward for trained modules)."""
    m = cfg.model
    total = 0.0
    llm_mult = 1.0 if m.llm.freeze else 3.0
    below_trainable = not m.llm.freeze or not m.projector_freeze
    real, sq = _segment_stats(batch["llm_segment_ids"])
    kv = m.llm.width // m.llm.heads * m.llm.kv_heads
    total += llm_mult * m.llm.depth * _block_flops(real, sq, m.llm.width, m.llm.mlp_dim, kv, True)
    total += llm_mult * 2.0 * real * m.llm.width * m.llm.vocab_size  # LM head
    for name, sub in (("vision", m.vision), ("audio", m.audio)):
        key = f"{name}_segment_ids"
        if not sub.enabled or key not in batch:
            continue
        seg = batch[key]
        if name == "audio":
            seg = seg[..., :: sub.subsample]
        real_e, sq_e = _segment_stats(seg)
        mult = 3.0 if not sub.freeze else (2.0 if below_trainable else 1.0)
        total += (
            mult * sub.depth * _block_flops(real_e, sq_e, sub.width, sub.mlp_dim, sub.width, False)
        )
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
