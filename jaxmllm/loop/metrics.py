"""Step metrics: what a step did (real tokens, analytic FLOPs), the window between logged steps,
and where metrics are written.

The data pipeline counts each step's real tokens and FLOPs on its own thread (`StepCounter`);
the trainer adds them into a `MetricsWindow` and, at a logged step, turns the window into
throughput for the whole job. Metrics go to `<output_dir>/metrics.jsonl` (one JSON object per
logged step), TensorBoard event files under `<output_dir>/tb/`, and a tqdm progress bar.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxmllm.data.rejects import REASONS
from jaxmllm.feed.info import StepInfo
from jaxmllm.feed.times import STAGES

log = logging.getLogger("jaxmllm")


class MetricsWindow:
    """The steps since the last logged one: their real tokens, FLOPs and wall time, and the
    feed's time per stage with the loop's wait on it.

    `add` takes a step's `info` from the pipeline (`tokens`, `flops`, `host`) and the seconds
    the loop waited for it; `close` at a logged step returns the window's throughput, padding
    and host times (`host/*`, this process's), and the bad-input counts, for the whole job.
    When the loop waited on the data for more than `WAIT_WARNING` of a window (the first, with
    its start-up, aside), it warns once, naming what would help (`data`: the DataConfig).
    """

    def __init__(self, n_devices: int, data=None, peak_tflops: float | None = None):
        """`peak_tflops`: a device's dense bf16 peak (`device_peak`): MFU, None: no MFU."""
        self.n_devices, self.data, self.peak = n_devices, data, peak_tflops
        self.windows, self.warned = 0, False
        # The run's totals over every window but the first (its step compiles): the end summary
        self.run_tokens = self.run_flops = self.run_seconds = 0.0
        self.run_steps = 0
        self._reset()

    def _reset(self) -> None:
        """Starts a new window now: no tokens, FLOPs, steps or host time counted."""
        self.start, self.tokens, self.flops, self.steps = time.perf_counter(), 0.0, 0.0, 0
        self.predicted = 0.0
        self.host = dict.fromkeys(("wait", *STAGES), 0.0)

    def exclude(self, seconds: float) -> None:
        """Takes time the loop spent on other work (an evaluation) out of the window."""
        self.start += seconds

    def add(self, info: StepInfo, wait_s: float = 0.0) -> None:
        """Counts one step into the window: its real tokens, FLOPs, predicted time, the seconds
        the loop waited on the feed (`wait_s`) and each feed stage's host seconds."""
        self.tokens += info.tokens
        self.flops += info.flops
        self.predicted += info.predicted_s
        self.steps += 1
        self.host["wait"] += wait_s
        if info.host is not None:  # the feed's HostTimes
            for stage in STAGES:
                self.host[stage] += getattr(info.host, f"{stage}_s")

    def close(self, info: StepInfo) -> tuple[dict[str, float], dict[str, float]]:
        """(throughput, padding and host times, cumulative reject counts) at a logged step;
        starts anew.

        Every process calls this at the same steps: with several it is a collective.
        """
        elapsed = time.perf_counter() - self.start
        tokens, flops, fill, rejects = _global_stats(
            self.tokens, self.flops, info.fill, info.rejects
        )
        stats = throughput(tokens, flops, self.steps, elapsed, self.n_devices)
        if self.peak:  # model FLOPs of the real tokens and items over the devices' peak
            stats["mfu"] = stats["tflops_per_device"] / self.peak
        if self.windows:  # (the job's real tokens and FLOPs, evaluations left out)
            self.run_tokens += tokens
            self.run_flops += flops
            self.run_seconds += elapsed
            self.run_steps += self.steps
        if self.predicted:  # process 0's devices only: what the calibrated model expects
            stats["predicted_step_time_s"] = self.predicted / max(self.steps, 1)
        stats.update({f"padding/{k}": 1.0 - v for k, v in fill.items()})
        host = {f"host/{k}_s": v / max(self.steps, 1) for k, v in self.host.items()}
        stats.update(host)
        stats["host/wait_share"] = self.host["wait"] / max(elapsed, 1e-9)
        if self.windows and not self.warned and stats["host/wait_share"] > WAIT_WARNING:
            log.warning(_waiting(stats, self.data))
            self.warned = True
        self.windows += 1
        self._reset()
        return stats, rejects


WAIT_WARNING = 0.1  # the share of a window's time waiting on the data that warns


def _waiting(stats: dict, data) -> str:
    """Why the devices waited on the data, and the knob that helps: workers when loading is
    most of the feed's time, else the serial part (one thread, whatever the workers)."""
    per_step = {k: stats[f"host/{k}_s"] for k in STAGES}
    feed = sum(per_step.values())
    spent = ", ".join(f"{k} {v:.3f} s" for k, v in per_step.items())
    workers = getattr(data, "workers", 0)
    prefetch = getattr(data, "prefetch", 2)
    head = (
        f"the devices waited on the data for {stats['host/wait_share']:.0%} of the last "
        f"window ({stats['host/wait_s']:.3f} s a step against a {stats['step_time_s']:.3f} s "
        f"step); the feed's thread took {feed:.3f} s a step ({spent}). "
    )
    if per_step["load"] >= feed / 2:
        advice = (
            f"Loading is most of it: raise data.workers (now {workers}) to load samples in "
            "parallel processes"
        )
    else:
        advice = (
            "Most of it is serial (planning, bucketize, counting, the copy to the devices: one "
            "thread, whatever data.workers); more workers will not help it"
        )
    tail = f"; data.prefetch (now {prefetch}) evens out uneven steps, not a slower feed."
    return head + advice + tail


# Dense bf16 matrix peak per device, TFLOP/s (datasheets, without sparsity), by device kind:
# MFU's denominator. The first name found in a device's kind wins (so "H100 PCIe" before
# "H100", "A100" before "A10", "GH200" before "H200").
PEAK_TFLOPS = (
    ("GH200", 989.4),
    ("H200 NVL", 835.5),
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.5),
    ("H100", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("TPU v5 lite", 197.0),
    ("TPU v5p", 459.0),
    ("TPU v4", 275.0),
    ("TPU v6", 918.0),
)


def peak_tflops(device_kind: str) -> float | None:
    """The dense bf16 peak of a device kind (`jax.devices()[0].device_kind`), None: unknown."""
    return next((v for k, v in PEAK_TFLOPS if k in device_kind), None)


def device_peak(configured: float, device_kind: str) -> float | None:
    """MFU's denominator for a run: `train.peak_tflops` if set, else the kind's datasheet peak;
    None (logged once, with the key to set) where neither is known, a CPU's included."""
    peak = configured or peak_tflops(device_kind)
    if peak is None:
        log.info(
            "MFU not reported: no dense bf16 peak known for device kind %r (set "
            "train.peak_tflops to a device's peak TFLOP/s to report it)",
            device_kind,
        )
    return peak


def throughput(tokens: float, flops: float, steps: int, seconds: float, n_dev: int) -> dict:
    """A window's throughput: seconds a step, real tokens a second and TFLOP/s a device (analytic
    FLOPs of the real tokens), from `steps` steps over `seconds` on `n_dev` devices."""
    seconds = max(seconds, 1e-9)
    return {
        "step_time_s": seconds / max(steps, 1),
        "tokens_per_s": tokens / seconds,
        "tflops_per_device": flops / seconds / n_dev / 1e12,
    }


def logged_step(done: int, train) -> bool:
    """Whether the step `done` (1-based) is logged: every `train.log_every`, the first and the
    last. Every process logs the same steps: the collectives of a logged step run there."""
    return done % train.log_every == 0 or done in (1, train.steps)


def over_processes(mine: np.ndarray) -> np.ndarray:
    """Every process's vector `mine` (the same length on each), as rows [processes, n] in
    process order; with one process `mine` alone, and no collective.

    With several it is a collective (`multihost_utils.process_allgather`): every process calls
    it at the same step, with a vector of the same length.
    """
    mine = np.asarray(mine, np.float64)
    if jax.process_count() == 1:
        return mine[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, len(mine))


def summed_over_processes(mine: np.ndarray) -> np.ndarray:
    """The job's counts: `mine` summed over the processes (`over_processes`, a collective)."""
    return over_processes(mine).sum(0)


def _global_stats(tokens: float, flops: float, fill: dict, rejects: dict):
    """Sums this host's step statistics over all processes (a no-op with one process).

    Every process calls this at the same (logged) steps: it is a collective.
    """
    if jax.process_count() == 1:
        return tokens, flops, fill, rejects
    fills = sorted(fill)
    loads = [f"rejects/load_{r}" for r in sorted(REASONS)]
    mine = [tokens, flops] + [fill[k] for k in fills] + [rejects.get(k, 0.0) for k in loads]
    every = over_processes(np.asarray(mine, np.float64))
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
        """Opens <output_dir>/metrics.jsonl for appending and, when tensorboardX is installed, a
        TensorBoard writer in <output_dir>/tb; nothing when not `enabled` (processes other than
        0)."""
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(out / "metrics.jsonl", "a")
        writer = _tensorboard_writer()
        if writer is not None:
            self._tb = writer(str(out / "tb"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """One row of metrics for `step`: a JSON line (flushed, so a crash loses no logged step)
        and a TensorBoard scalar for each finite number."""
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
        """Closes the JSONL file and the TensorBoard writer."""
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def _tensorboard_writer():
    """tensorboardX's SummaryWriter, or None where it is not installed (TensorBoard is optional
    at run time; the JSONL always works). Imported with torch held out where torch is installed
    but not imported: tensorboardX's writer module imports torch at import, only to take torch
    tensors for numpy arrays, and that import was 1.3 of a tiny run's first 20 s (2-core box,
    2026-11-29). The scalars written here are Python numbers. (A None in `sys.modules` makes
    `import torch` raise ImportError, which tensorboardX catches.)"""
    held = "torch" not in sys.modules
    if held:
        sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    finally:
        if held and sys.modules.get("torch", False) is None:
            del sys.modules["torch"]
    return SummaryWriter


def _plain(v):
    """A numpy scalar as the Python number JSON writes; anything else as it is."""
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
