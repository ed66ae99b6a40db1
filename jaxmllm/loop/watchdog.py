"""A hung step, and a signal that cannot be handled, end the process saying where it was.

The trainer's signal handlers (`guards.Preemption`: finish the step, checkpoint, exit) are
Python's, which run in the main thread between bytecodes: a main thread blocked in a collective
that never completes (a peer hung, a deadlocked all-to-all) or in a long native call never
runs them, so a scheduler's SIGTERM changed nothing and the job sat until it was killed. Two
watchers run in a thread of their own instead, woken by the signal itself (`signal.
set_wakeup_fd`: CPython's C handler writes the signal's number to a pipe in whatever thread
the kernel interrupts):

- `StepWatchdog`, over the training loop: each step beats (`beat`); a step that has not beaten
  within its bound (train.max_step_seconds, or auto: 10x the median step; the first WARMUP
  steps, which compile, an hour at least) ends the process, exit 4, naming the step and what
  the main thread was doing (the trainer's line, the innermost jaxmllm frame), so the
  scheduler restarts it from the last checkpoint. A SIGTERM / SIGINT the loop's handler has
  not taken within a grace ends it the same way (exit 143 / 130): a hung step can write no
  checkpoint.
- `startup_signals`, over start-up (reading the index, sizing, compiling, restoring: minutes
  before the first step): SIGTERM ends the command saying what it interrupted, exit 143,
  where it printed nothing.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import select
import signal
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

EXIT_HUNG = 4
WARMUP = 5  # steps not timed (the first compile; each step variant's first)
FIRST_STEPS_S = 3600.0  # the auto bound before the warm-up is over (compiling)
AUTO_FACTOR = 10.0  # the auto bound: this many median steps ...
AUTO_FLOOR_S = 300.0  # ... and at least this (an evaluation, a save between two beats)
GRACE_S = 10.0  # after a signal, a step not done in this long (3 median steps if more) is hung
TIMED = 100  # recent steps the median is taken over

_PACKAGE = os.path.dirname(os.path.dirname(__file__))  # (jaxmllm/: its frames are ours)


class _Wakeup:
    """The signal wakeup pipe: `signals(timeout)` waits for signal numbers written to it."""

    def __init__(self):
        """Opens a non-blocking pipe and makes it the signal wakeup fd (Python writes each caught
        signal's number to it), keeping the previous one for `close`."""
        self.read, self.write = os.pipe()
        os.set_blocking(self.read, False)
        os.set_blocking(self.write, False)
        self.previous = signal.set_wakeup_fd(self.write, warn_on_full_buffer=False)

    def signals(self, timeout: float) -> list[int]:
        """The signal numbers written to the pipe within `timeout` seconds ([] if none came)."""
        ready, _, _ = select.select([self.read], [], [], max(timeout, 0.0))
        if not ready:
            return []
        try:
            return list(os.read(self.read, 512))
        except BlockingIOError:
            return []

    def close(self) -> None:
        """Gives the previous wakeup fd back and closes the pipe."""
        signal.set_wakeup_fd(self.previous)
        os.close(self.read)
        os.close(self.write)


def where_main_is() -> str:
    """What the main thread is running: the outermost jaxmllm line it is in (the command's:
    the trainer's stage or loop line) and, when another, the innermost jaxmllm frame."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    ours = []
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_PACKAGE) and name != __file__:  # (not a signal handler here)
            ours.append(frame)
        frame = frame.f_back
    if not ours:
        return "outside jaxmllm's code"

    def line(f) -> str:
        """A frame as '`source line` (file:line, in function)', the file relative to the
        package's parent."""
        text = linecache.getline(f.f_code.co_filename, f.f_lineno).strip()
        rel = os.path.relpath(f.f_code.co_filename, Path(_PACKAGE).parent)
        return f"`{text}` ({rel}:{f.f_lineno}, in {f.f_code.co_name})"

    command = ours[-1].f_code.co_filename  # (the command's module: its innermost frame)
    outer = line(next(f for f in ours if f.f_code.co_filename == command))
    inner = line(ours[0])
    return outer if outer == inner else f"{outer}, inside {inner}"


def _exit(message: str, code: int) -> None:
    """Prints the error and ends the process at once with `code` (os._exit: a hung main thread
    cannot run cleanup; the job is then restarted from its latest checkpoint)."""
    print(f"\nerror: {message}", file=sys.stderr, flush=True)
    os._exit(code)


class StepWatchdog:
    """Ends a process whose step has hung, or that holds a signal its loop cannot take (see
    the module docstring). `bound_s`: train.max_step_seconds (0: auto; inf: no bound);
    `peer_bound_s`: in a multi-process job, distributed.step_timeout_s, which also bounds
    every step after the first; `handled()`: whether the loop's handler took the signal;
    `steps`: the run's last step (its beat ends the watch: evaluation and the last save
    follow); `resume`: where the run resumes from, for the message."""

    def __init__(
        self,
        bound_s: float,
        start: int,
        steps: int,
        handled: Callable[[], bool],
        resume: str,
        peer_bound_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """A watch over steps from `start` to `steps`: `bound_s` train.max_step_seconds (0: auto,
        from the median step), `peer_bound_s` a multi-process job's distributed.step_timeout_s,
        `handled` whether the loop took a signal, `resume` the sentence saying how to resume;
        `clock` for tests."""
        self.bound_s, self.peer_bound_s, self.steps = bound_s, peer_bound_s, steps
        self.handled, self.resume, self.clock = handled, resume, clock
        self.step, self.start, self.beats = start, start, 0
        self.last = clock()
        self.times: deque[float] = deque(maxlen=TIMED)
        self._stop = threading.Event()
        self._wakeup = _Wakeup() if threading.current_thread() is threading.main_thread() else None
        self._thread = threading.Thread(target=self._run, name="jaxmllm-watchdog", daemon=True)
        self._thread.start()

    def beat(self, done: int) -> None:
        """Step `done` finished (what the loop waits on per step came back)."""
        now = self.clock()
        self.beats += 1
        if self.beats > WARMUP:
            self.times.append(now - self.last)
        self.step, self.last = done, now
        if done >= self.steps:
            self.stop()

    def bound(self) -> float:
        """The seconds the step in progress may take."""
        if self.beats < WARMUP:  # (compiling: the first step, a variant's first)
            bound = max(self.bound_s, FIRST_STEPS_S)
        elif self.bound_s:
            bound = self.bound_s
        elif not self.times:
            bound = FIRST_STEPS_S
        else:
            bound = max(AUTO_FLOOR_S, AUTO_FACTOR * statistics.median(self.times))
        if self.peer_bound_s and self.beats:
            bound = min(bound, self.peer_bound_s)
        return bound

    def hung(self, now: float) -> str | None:
        """The message for a step past its bound at `now`, else None."""
        bound, took = self.bound(), now - self.last
        if took <= bound:
            return None
        key = "train.max_step_seconds" if self.bound_s else "train.max_step_seconds: auto"
        if self.peer_bound_s and bound == self.peer_bound_s:
            key = "distributed.step_timeout_s"
        return (
            f"step {self.step + 1} has not finished in {took:.0f} s ({key}: {bound:.0f} s"
            f"{self._median()}); the main thread is in {where_main_is()}. A collective that "
            "never completes (a peer hung or dead) or a stuck device does this. Stopping so "
            f"the job can restart: {self.resume}"
        )

    def _median(self) -> str:
        """'; the median of the last N steps: 1.23 s' for the hung-step message, '' before any
        step was timed."""
        if not self.times:
            return ""
        median = statistics.median(self.times)
        return f"; the median of the last {len(self.times)} steps: {median:.2f} s"

    def stop(self) -> None:
        """Asks the watch thread to end (it checks once a second)."""
        self._stop.set()

    def close(self) -> None:
        """Stops the watch and gives the signal wakeup back."""
        self.stop()
        self._thread.join(timeout=5)
        if self._wakeup is not None:
            self._wakeup.close()
            self._wakeup = None

    def grace(self) -> float:
        """Seconds the step in progress has, after a signal, to finish (the loop then
        checkpoints): a few median steps, at least GRACE_S, at most its bound."""
        median = statistics.median(self.times) if self.times else 0.0
        return min(self.bound(), max(GRACE_S, 3 * median))

    def _run(self) -> None:
        """The watch thread: once a second, ends the process (EXIT_HUNG) when the step in
        progress is past its bound, or when a SIGTERM / SIGINT came and the step did not finish
        within `grace` (exit 128 + the signal)."""
        signalled: tuple[int, float] | None = None
        while not self._stop.is_set():
            got = self._wakeup.signals(1.0) if self._wakeup else []
            if self._wakeup is None:
                self._stop.wait(1.0)
            if self._stop.is_set():
                return
            now = self.clock()
            for signum in got:
                if signum in (signal.SIGTERM, signal.SIGINT) and signalled is None:
                    signalled = (signum, now)
            message = self.hung(now)
            if message is not None:
                _exit(message, EXIT_HUNG)
            if signalled is None:
                continue
            signum, at = signalled
            if self.last >= at:  # (a step finished since: the loop is checkpointing, stopping)
                return
            if now - at > self.grace():
                took = "the loop took it" if self.handled() else "the loop could not take it"
                _exit(
                    f"{signal.Signals(signum).name} arrived during step {self.step + 1}, which "
                    f"has not finished in {now - self.last:.0f} s ({took}, and the step did not "
                    f"finish in the {now - at:.0f} s since): the main thread is in "
                    f"{where_main_is()}. A hung step can write no checkpoint; {self.resume}",
                    128 + signum,
                )


def step_watchdog(cfg, start: int, preempt, checkpoints) -> StepWatchdog:
    """The training loop's watchdog for config `cfg` from step `start` (`preempt`: the loop's
    `guards.Preemption`; `checkpoints`: the folder it resumes from)."""
    import jax

    peers = cfg.distributed.step_timeout_s if jax.process_count() > 1 else None
    return StepWatchdog(
        cfg.train.max_step_seconds,
        start,
        cfg.train.steps,
        lambda: preempt.requested is not None,
        f"rerun the same command to resume from the latest checkpoint in {checkpoints}",
        peer_bound_s=peers,
    )


class StartupInterrupted(BaseException):
    """SIGTERM before training started; `exit_code` 143 (`jaxmllm.config.command.run`).

    A BaseException, as KeyboardInterrupt is: raised by the signal handler wherever the main
    thread is, it must not be taken for that code's own failure. As an Exception, JAX's read
    of a persistent compilation cache entry caught it, warned "Error reading persistent
    compilation cache entry" and compiled on: the run trained and exited 0."""

    exit_code = 128 + signal.SIGTERM


@contextlib.contextmanager
def startup_signals() -> Iterator[None]:
    """SIGTERM while the `with` block runs raises StartupInterrupted saying what it
    interrupted (the command prints it, exit 143); a main thread held in native code that
    cannot raise within GRACE_S is ended with the same message. Outside the main thread:
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    came: list[str] = []

    def handler(signum, frame):
        """Raises StartupInterrupted, saying where the main thread was, in place of SIGTERM's
        default exit."""
        came.append(_startup_message())
        raise StartupInterrupted(came[0])

    previous = signal.signal(signal.SIGTERM, handler)
    wakeup, stop = _Wakeup(), threading.Event()

    def watch() -> None:
        """Ends the process with the start-up message when SIGTERM came and the main thread did
        not raise within GRACE_S (held in native code, where handlers do not run)."""
        while not stop.is_set():
            if signal.SIGTERM in wakeup.signals(0.5) and not stop.wait(GRACE_S):
                if signal.getsignal(signal.SIGTERM) is handler:  # (the loop's has its own)
                    _exit(_startup_message(), 128 + signal.SIGTERM)

    thread = threading.Thread(target=watch, name="jaxmllm-startup-signals", daemon=True)
    thread.start()
    try:
        yield
        if came:  # (code that catches even a BaseException swallowed it: the signal stands)
            raise StartupInterrupted(came[0])
    finally:
        stop.set()
        thread.join(timeout=2)
        wakeup.close()
        signal.signal(signal.SIGTERM, previous)


def _startup_message() -> str:
    """The error for SIGTERM during start-up: where the main thread was, that nothing was trained
    or checkpointed, and that rerunning starts or resumes."""
    return (
        f"SIGTERM at start-up, in {where_main_is()}: nothing was trained and this run wrote "
        "no checkpoint. Rerun the same command to start (or resume from the latest checkpoint)"
    )
