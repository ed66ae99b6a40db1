"""The data thread's time per step, by stage: what the trainer logs (`host/*`) and
`python -m jaxmllm.bench.host` reports against the device's step.

A step's host work is planning (every host plans the global step), loading its samples (decode,
resize, patchify, log-mel: the per-sample part that `data.workers` processes share), and the
serial rest: bucketize and counting what the batch holds for the metrics on the feed's thread,
and the copy to the devices on a thread of its own, which overlaps the next step's work.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

STAGES = ("plan", "load", "bucketize", "count", "transfer")  # in the order a step runs them


@dataclass
class HostTimes:
    """Seconds one step spent in each stage of the feed, and what it moved."""

    plan_s: float = 0.0  # the planner's step (global: every host plans every device)
    load_s: float = 0.0  # loading this host's samples (in worker processes with data.workers)
    bucketize_s: float = 0.0  # the fixed-shape arrays, the pipeline variant, fill statistics
    count_s: float = 0.0  # real tokens, analytic FLOPs and work for the metrics
    # The call that puts the batch on the devices; on an accelerator the copy may still be in
    # flight when it returns (the bench waits for it).
    transfer_s: float = 0.0
    samples: int = 0  # samples this host loaded
    bytes_to_device: int = 0  # bytes of this host's batch arrays

    @property
    def serial_s(self) -> float:
        """Everything but the per-sample loading: the part worker processes do not share."""
        return self.plan_s + self.bucketize_s + self.count_s + self.transfer_s

    @property
    def overlapped_s(self) -> float:
        """The serial part with the copy on its own thread (the feed's prefetching): the longer
        of the feed thread's share (planning, bucketize, counting) and the copy."""
        return max(self.plan_s + self.bucketize_s + self.count_s, self.transfer_s)

    @property
    def total_s(self) -> float:
        """The step's whole feed time in seconds, serial part and loading, as if nothing
        overlapped."""
        return self.serial_s + self.load_s

    def to_json(self) -> dict:
        """The times as a JSON row (bench.host, timings.jsonl), with the derived serial and
        overlapped seconds."""
        return {**asdict(self), "serial_s": self.serial_s, "overlapped_s": self.overlapped_s}


class Stopwatch:
    """Lap times on the monotonic clock: `lap()` returns the seconds since the last lap."""

    def __init__(self):
        """Starts the first lap now."""
        self._last = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the last lap (or the start), and a new lap from now."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        return seconds
