"""Step metrics: what a step did (real tokens, analytic FLOPs), the window between logged steps,
and where metrics are written.

The data pipeline counts each step's real tokens and FLOPs on its own thread (`StepCounter`);
the trainer adds them into a `MetricsWindow` and, at a logged step, turns the window into
throughput for the whole job. Metrics go to `<output_dir>/metrics.jsonl` (one JSON object per
logged step), TensorBoard event files under `<output_dir>/tb/`, and a tqdm progress bar.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jax
import numpy as np

from jaxmllm.batch.info import StepInfo
from jaxmllm.data.rejects import REASONS


class MetricsWindow:
    """The steps since the last logged one: their real tokens, FLOPs and wall time.

    `add` takes a step's `info` from the pipeline (`tokens`, `flops`); `close` at a logged step
    returns the window's throughput and padding, and the bad-input counts, for the whole job.
    """

    def __init__(self, n_devices: int):
        self.n_devices = n_devices
        self._reset()

    def _reset(self) -> None:
        self.start, self.tokens, self.flops, self.steps = time.perf_counter(), 0.0, 0.0, 0
        self.predicted = 0.0

    def exclude(self, seconds: float) -> None:
        """Takes time the loop spent on other work (an evaluation) out of the window."""
        self.start += seconds

    def add(self, info: StepInfo) -> None:
        self.tokens += info.tokens
        self.flops += info.flops
        self.predicted += info.predicted_s
        self.steps += 1

    def close(self, info: StepInfo) -> tuple[dict[str, float], dict[str, float]]:
        """(throughput and padding, cumulative reject counts) at a logged step; starts anew.

        Every process calls this at the same steps: with several it is a collective.
        """
        elapsed = time.perf_counter() - self.start
        tokens, flops, fill, rejects = _global_stats(
            self.tokens, self.flops, info.fill, info.rejects
        )
        stats = throughput(tokens, flops, self.steps, elapsed, self.n_devices)
        if self.predicted:  # process 0's devices only: what the calibrated model expects
            stats["predicted_step_time_s"] = self.predicted / max(self.steps, 1)
        stats.update({f"padding/{k}": 1.0 - v for k, v in fill.items()})
        self._reset()
        return stats, rejects


def throughput(tokens: float, flops: float, steps: int, seconds: float, n_dev: int) -> dict:
    seconds = max(seconds, 1e-9)
    return {
        "step_time_s": seconds / max(steps, 1),
        "tokens_per_s": tokens / seconds,
        "tflops_per_device": flops / seconds / n_dev / 1e12,
    }


def _global_stats(tokens: float, flops: float, fill: dict, rejects: dict):
    """Sums this host's step statistics over all processes (a no-op with one process).

    Every process calls this at the same (logged) steps: it is a collective.
    """
    if jax.process_count() == 1:
        return tokens, flops, fill, rejects
    from jax.experimental import multihost_utils

    fills = sorted(fill)
    loads = [f"rejects/load_{r}" for r in sorted(REASONS)]
    mine = [tokens, flops] + [fill[k] for k in fills] + [rejects.get(k, 0.0) for k in loads]
    every = np.asarray(multihost_utils.process_allgather(np.asarray(mine, np.float64)))
    total = every.sum(0)
    fill = {k: float(every[:, 2 + i].mean()) for i, k in enumerate(fills)}  # equal-size hosts
    rejects = dict(rejects)
    for i, k in enumerate(loads):
        value = float(total[2 + len(fills) + i])
        if value or k in rejects:
            rejects[k] = value
    if "rejects/load_total" in rejects:
        rejects["rejects/load_total"] = sum(rejects.get(k, 0.0) for k in loads)
    return float(total[0]), float(total[1]), fill, rejects


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
    """All rows of a run's metrics.jsonl, one per step: the rows of a step are merged (its
    training row and its evaluation's), later values winning (a resumed run rewrites steps)."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows.setdefault(row["step"], {}).update(row)
    return [rows[k] for k in sorted(rows)]
