"""Step timings for calibrating the cost model: each step's measured time and per-phase work.

The feed's thread counts a host batch's work per bucket (`jaxmllm.batch.counts.step_work`,
called by `StepCounter`): per phase, real units (LLM tokens, vision patches, audio frames), the sum
of squared segment lengths and, with block-sparse attention, the real tiles of the bucket's tile
list; with a decoder's sliding-window layers, the LLM's summed `window_sq` (`llm_wsq`) and,
where those layers have a tile list of their own, its real tiles (`llm_window_tiles`). A
step's microbatches each end in collectives (the encoder-row all-to-all, fsdp's gathers), so
every device waits for the slowest one of each microbatch: the step's work is, per
microbatch, that of the device the cost model finds slowest, summed over microbatches.

The trainer times each step between successive completions (`TimingsRecorder`): once step k+1
is dispatched it waits for step k's loss, so the devices always have a step queued and the
interval is step k's time on them (input stalls included: it is the loop's wall time). Rows go
to `<output_dir>/timings.jsonl`, which `python -m jaxmllm.cost.calibrate` reads.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax


class TimingsRecorder:
    """Times each step between successive completions and writes it with its work.

    A resumed run redoes the steps after its checkpoint: their rows from the run before are
    dropped when the recorder opens, so every step has one row. The first step of a process
    (compilation), a step that was saved (the save's wait and copy) and one that was evaluated
    are marked `compile` / `checkpoint` / `eval`: their time holds more than their work.
    """

    def __init__(self, output_dir: str | Path, start: int):
        """Opens <output_dir>/timings.jsonl for appending after dropping the rows of steps past
        `start` (a resumed run redoes them)."""
        self.path = Path(output_dir) / "timings.jsonl"
        _drop_after(self.path, start)
        self._file = open(self.path, "a")
        self._pending: tuple[dict, jax.Array, dict] | None = None
        self._last, self._last_step = time.perf_counter(), None
        self._variants: set[str] = set()

    def dispatched(self, step: int, signal: jax.Array, work: dict, variant: str = "") -> None:
        """Step `step` is queued on the devices: the step before it is timed when it is done
        (waiting on its `signal`, a small output such as its loss). A step of a `variant` this
        process has not run yet (`StepInfo.variant`: another program) compiles it."""
        first = variant not in self._variants  # (each program compiles on its first call)
        self._variants.add(variant)
        self._finish()
        row = {"step": step, "compile": first, "checkpoint": False}
        self._pending, self._last_step = (row, signal, work), step

    def saved(self) -> None:
        """The latest dispatched step is being saved: that waits for it and copies the state
        to the host before the next step is dispatched, which the step's time then holds."""
        if self._pending is not None:
            self._pending[0]["checkpoint"] = True

    def evaluated(self) -> None:
        """The latest dispatched step was evaluated before the next was dispatched (its time
        holds the evaluation's): marked `eval`."""
        if self._pending is not None:
            self._pending[0]["eval"] = True

    def _finish(self) -> None:
        """Waits for the pending step's signal and writes its row: the seconds since the previous
        step was done, with its work."""
        if self._pending is None:
            return
        row, signal, work = self._pending
        jax.block_until_ready(signal)
        now = time.perf_counter()
        row = {"step": row["step"], "time_s": now - self._last, **row, **work}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self._last, self._pending = now, None

    def close(self) -> None:
        """Writes the last pending step's row and closes the file."""
        self._finish()
        self._file.close()


def _drop_after(path: Path, start: int) -> None:
    """Keeps only the rows of steps <= start (and no line torn by a crash)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    keep = [line for line in lines if _step_of(line) is not None and _step_of(line) <= start]
    if len(keep) != len(lines):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)


def _step_of(line: str) -> int | None:
    """The step of one timings.jsonl line, or None for a line torn by a crash (not JSON, no
    integer step)."""
    try:
        step = json.loads(line).get("step")
    except (json.JSONDecodeError, AttributeError):
        return None
    return step if isinstance(step, int) else None
