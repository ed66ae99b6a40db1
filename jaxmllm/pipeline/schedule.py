"""Pipeline schedules as tables: at each tick, which microbatch each stage runs forward and which
it runs backward. Pure Python: the partitioner predicts a plan's time from the same table the
device runs, so the prediction is for the schedule actually run.

Lock-step ticks: every stage works on its entry of a tick, then activations (forward) and their
gradients (backward) move one stage over, so a tick lasts as long as its slowest stage.

- `gpipe`: every forward, then every backward (the backward is the forward loop differentiated:
  its ticks are the forward's in reverse). A tick costs the slowest forward, then the slowest
  backward: (M + S - 1) * (max f + max b) over M microbatches and S stages. Every microbatch's
  activations are held until its backward.
- `1f1b` (one forward, one backward): each stage runs a forward and a backward in the same tick
  once the pipeline is full, the last stage the backward of the microbatch it just ran forward.
  A full tick costs the slowest stage's forward + backward, max (f + b): a stage that has no
  backward (a frozen encoder with nothing trainable below it) costs only its forward, where the
  lock-step gpipe tick charges every stage the slowest backward too. A stage holds at most
  2 (S - 1 - s) + 1 microbatches in flight, not M.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

IDLE = -1  # no microbatch at this (tick, stage)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per tick and stage, the microbatch run forward and the one run backward (or IDLE)."""

    name: str
    microbatches: int
    stages: int
    forward: tuple[tuple[int, ...], ...]  # [tick][stage]
    backward: tuple[tuple[int, ...], ...]  # [tick][stage]

    @property
    def ticks(self) -> int:
        """The schedule's length in ticks (a tick: one forward and/or backward per stage)."""
        return len(self.forward)

    def tick_times(self, fwd: Sequence[float], bwd: Sequence[float]) -> list[float]:
        """Each tick's length: its slowest stage's work (forward and/or backward)."""
        return [
            max(
                (fwd[s] if f[s] != IDLE else 0.0) + (bwd[s] if b[s] != IDLE else 0.0)
                for s in range(self.stages)
            )
            for f, b in zip(self.forward, self.backward, strict=True)
        ]

    def time(self, fwd: Sequence[float], bwd: Sequence[float]) -> float:
        """The schedule's length with these per-stage forward / backward times per microbatch."""
        return sum(self.tick_times(fwd, bwd))

    def bubble(self, fwd: Sequence[float], bwd: Sequence[float]) -> float:
        """The share of stage-time spent idle: 1 - work / (stages * length)."""
        length = self.time(fwd, bwd)
        work = self.microbatches * (sum(fwd) + sum(bwd))
        return 1.0 - work / (self.stages * length) if length > 0 else 0.0

    def in_flight(self, stage: int) -> int:
        """The most microbatches `stage` has run forward and not yet backward at once."""
        held = most = 0
        for f, b in zip(self.forward, self.backward, strict=True):
            held += f[stage] != IDLE
            most = max(most, held)
            held -= b[stage] != IDLE
        return most


def _check(m: int, s: int) -> None:
    """Raises ValueError unless there is at least one microbatch and one stage."""
    if m < 1 or s < 1:
        raise ValueError(f"a schedule needs microbatches >= 1 and stages >= 1, got {m}, {s}")


def gpipe(microbatches: int, stages: int) -> Schedule:
    """All forwards (stage s runs microbatch t - s at tick t), then all backwards in reverse."""
    _check(microbatches, stages)
    m, s_n = microbatches, stages
    n = m + s_n - 1
    idle = (IDLE,) * s_n
    fwd = [tuple(_valid(t - s, m) for s in range(s_n)) for t in range(n)]
    # Backward tick u is forward tick n - 1 - u run in reverse.
    bwd = [tuple(_valid(n - 1 - u - s, m) for s in range(s_n)) for u in range(n)]
    return Schedule("gpipe", m, s_n, tuple(fwd) + (idle,) * n, (idle,) * n + tuple(bwd))


def one_f_one_b(microbatches: int, stages: int) -> Schedule:
    """Stage s runs microbatch t - s forward and t - 2(S - 1) + s backward at tick t."""
    _check(microbatches, stages)
    m, s_n = microbatches, stages
    n = m + 2 * (s_n - 1)
    fwd = tuple(tuple(_valid(t - s, m) for s in range(s_n)) for t in range(n))
    bwd = tuple(tuple(_valid(t - 2 * (s_n - 1) + s, m) for s in range(s_n)) for t in range(n))
    return Schedule("1f1b", m, s_n, fwd, bwd)


def _valid(i: int, m: int) -> int:
    """`i` if it is a microbatch (0 <= i < m), else IDLE: a stage waiting in the ramp up or down."""
    return i if 0 <= i < m else IDLE


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}
