"""Guards around the training loop: a diverging run, a preemption signal, a closed pipe.

(A hung step or a stuck peer, and a signal the loop cannot take: `jaxmllm.loop.watchdog`.)
- `NonFiniteGuard` counts steps whose update was skipped for a NaN/inf loss, gradient or updated
  parameter and says when `train.max_nonfinite_steps` came in a row (the trainer then
  checkpoints the last good state and stops); a step to be saved is read before its save, and
  the count in a row goes on from a resumed checkpoint's stamp.
- `Preemption` turns SIGTERM / SIGINT into "finish this step, checkpoint, exit 0".
- `outlive_closed_pipes` keeps a dead stdout / stderr (a `| tee` or `| head` that exited, as
  Ctrl-C ends `tee` with the trainer) from costing the checkpoint a signal asked for.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import jax

log = logging.getLogger("jaxmllm")


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss, gradient or update."""

    exit_code = 3  # (what the command exits with: `jaxmllm.config.command.run`)


class NonFiniteGuard:
    """Counts skipped (non-finite) steps; says when `limit` came in a row.

    It reads a step's flag only after the next step is dispatched, so the host never waits on
    the device; the step it stops at holds the last good parameters (updates were skipped).
    """

    def __init__(self, limit: int):
        """`limit`: train.max_nonfinite_steps (0: never stop); no step seen yet."""
        self.limit, self.run, self.total = limit, 0, 0
        self.stopped_at = 0
        self._pending: tuple[int, jax.Array] | None = None

    def check(self, step: int, flag: jax.Array) -> bool:
        """Hands in step `step`'s non-finite flag and reads the previous step's (done by now: the
        host never waits on the step just dispatched); logs a skipped update. True when `limit`
        came in a row: `stopped_at` is then that step."""
        previous, self._pending = self._pending, (step, flag)
        return previous is not None and self._read(*previous, latest=step)

    def settle(self) -> bool:
        """Reads the flag handed in last, waiting for its step: before a checkpoint, so that its
        count is exact and the limit holds at a run's last steps too. True as `check`."""
        previous, self._pending = self._pending, None
        return previous is not None and self._read(*previous, latest=previous[0])

    def resumed(self, in_a_row: int) -> None:
        """Resuming from a checkpoint saved after `in_a_row` non-finite steps in a row (its
        stamp's `nonfinite_in_a_row`): the count goes on, so a run stopped by the limit stops
        again at its first non-finite step, however few steps are left."""
        self.run = in_a_row

    def limit_reached(self) -> bool:
        """Whether the count in a row is at the limit (a resumed run stopped by it)."""
        return bool(self.limit) and self.run >= self.limit

    def _read(self, done: int, flag: jax.Array, latest: int) -> bool:
        """Counts step `done`'s flag; True (`stopped_at`: `latest`, the latest step dispatched,
        which kept the good state too) when the limit came in a row."""
        bad = bool(jax.device_get(flag))
        self.run = self.run + 1 if bad else 0
        self.total += bad
        if bad:
            log.warning(
                "step %d: non-finite loss, gradient or update; update skipped (%d in a row)",
                done,
                self.run,
            )
        if self.limit_reached():
            self.stopped_at = latest
            return True
        return False

    def message(self, directory) -> str:
        """The error when the run stops on non-finite steps: how many in a row, where the last
        good parameters are, and the settings that usually help."""
        return (
            f"{self.run} steps in a row had a non-finite loss, gradient or update (train."
            f"max_nonfinite_steps={self.limit}); stopped at step {self.stopped_at} with the "
            f"last good parameters checkpointed in {directory}. Lower optim.lr, raise "
            f"optim.warmup_steps or set model.compute_dtype: float32, then resume."
        )


class Preemption:
    """SIGTERM / SIGINT ask the loop to finish its step, checkpoint and exit cleanly.

    A second signal while stopping raises KeyboardInterrupt at once (the latest complete
    checkpoint stays usable). Outside the main thread signals cannot be caught: no-op.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        """Installs the handlers for SIGTERM and SIGINT (in the main thread only), keeping the
        previous ones for `restore`."""
        self.requested: str | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        """The first signal asks the loop to stop after this step (`requested`); a second raises
        KeyboardInterrupt at once."""
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        print(f"\n{self.requested}: finishing this step, then checkpointing", file=sys.stderr)

    def restore(self) -> None:
        """Puts back the signal handlers that were there before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class _Outliving:
    """A text stream that outlives its reader: once a write or flush fails (a closed pipe:
    EPIPE; a lost terminal: EIO), the file descriptor is pointed at /dev/null and every later
    write succeeds there, so the run goes on to its checkpoint."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        """Writes to the stream; once it fails (its reader gone), to /dev/null, saying the text
        was written."""
        try:
            return self._stream.write(text)
        except (OSError, ValueError):
            self._drop()
            return len(text)

    def flush(self) -> None:
        """Flushes the stream; once it fails, the stream is /dev/null from then on."""
        try:
            self._stream.flush()
        except (OSError, ValueError):
            self._drop()

    def _drop(self) -> None:
        """Points the stream's file descriptor (C-level writers included) and the stream itself
        at /dev/null."""
        try:  # C-level writers (XLA's logs) and the interpreter's last flush land there too
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        except (OSError, ValueError):
            pass
        self._stream = open(os.devnull, "w")  # noqa: SIM115  (lives as long as the process)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def outlive_closed_pipes() -> None:
    """Wraps sys.stdout and sys.stderr (`_Outliving`) for the rest of the process."""
    if not isinstance(sys.stdout, _Outliving):
        sys.stdout = _Outliving(sys.stdout)
    if not isinstance(sys.stderr, _Outliving):
        sys.stderr = _Outliving(sys.stderr)
