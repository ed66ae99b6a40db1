"""Where an index build's shards run: in this process, in local worker processes, or as Ray
tasks on a cluster; each the same `submit(key, fn, job)` / `wait()` to the build.

`wait()` returns the outcomes of finished jobs: a value, an error (an exception the job
raised: its type and message), or `died` (the process running it died: killed for memory, an
abort in native code). A dead local worker is replaced by a fresh one and its job reported,
never waited on forever; Ray retries a task whose worker or node died (`RETRIES` times) before
reporting it. Workers run `init(context)` once (a Ray worker: once per context it sees), then
jobs.
"""

from __future__ import annotations

import multiprocessing
import signal
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any

from jaxmllm.config import ConfigError

RETRIES = 2  # Ray's retries of a task whose worker process or node died


@dataclass
class Outcome:
    """A finished job: `value` it returned, else `error` (it raised) or `died` (its process
    ended without an answer: how)."""

    key: object
    value: object = None
    error: str | None = None
    config_error: bool = False  # the error is a ConfigError (a file that cannot be read)
    died: str | None = None


def _answer(key, fn: Callable, job) -> tuple:
    """(key, the value of `fn(job)`, None, False), or its error as the build reports it: a
    ConfigError's message (flagged: a file the build cannot read), any other exception's type,
    message and traceback. Never raises, so a job's failure is its outcome, not the worker's."""
    try:
        return (key, fn(job), None, False)
    except ConfigError as e:
        return (key, None, str(e), True)
    except Exception as e:  # noqa: BLE001  (reported to the build, which stops naming it)
        return (key, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}", False)


class InProcess:
    """Runs each job at once in this process (no protection from a crash: it is the build's)."""

    def __init__(self, init: Callable, context):
        """Runs the build's `init(context)` here, once."""
        init(context)
        self.done: list[Outcome] = []

    def submit(self, key, fn: Callable, job) -> None:
        """Runs the job now; its outcome waits for the next `wait`."""
        self.done.append(Outcome(*_answer(key, fn, job)))

    def wait(self) -> list[Outcome]:
        """The outcomes of the jobs run since the last call."""
        done, self.done = self.done, []
        return done

    def close(self) -> None:
        """Nothing to stop: the jobs ran in this process."""
        pass


def _serve(conn, init: Callable, context) -> None:
    """A local worker: init, then jobs from `conn` until None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C is the build's to handle)
    init(context)
    while (msg := conn.recv()) is not None:
        conn.send(_answer(*msg))


class LocalProcesses:
    """`workers` processes started by spawn (JAX's threads make fork unsafe), a job at a time
    each; one that dies is reported (`died`, with its exit code or signal) and replaced."""

    def __init__(self, workers: int, init: Callable, context):
        """Starts `workers` spawned processes, each running `init(context)` before its first job."""
        self.ctx = multiprocessing.get_context("spawn")
        self.init, self.context = init, context
        self.queue: deque = deque()
        self.running: dict[int, tuple] = {}  # worker slot -> its job's (key, fn, job)
        self.slots = [self._start() for _ in range(workers)]

    def _start(self):
        """A fresh worker process and this side's end of its pipe."""
        parent, child = self.ctx.Pipe()
        process = self.ctx.Process(target=_serve, args=(child, self.init, self.context))
        process.daemon = True
        process.start()
        child.close()
        return process, parent

    def submit(self, key, fn: Callable, job) -> None:
        """Queues the job; it runs as soon as a worker is free."""
        self.queue.append((key, fn, job))
        self._dispatch()

    def _dispatch(self) -> None:
        """Gives each idle worker the next queued job; a worker found dead while idle is replaced
        and its job sent to the new one."""
        for slot in range(len(self.slots)):
            if slot not in self.running and self.queue:
                self.running[slot] = self.queue.popleft()
                try:
                    self.slots[slot][1].send(self.running[slot])
                except (BrokenPipeError, OSError):  # (it died idle: its job goes to a new one)
                    self.slots[slot][0].join()
                    self.slots[slot] = self._start()
                    self.slots[slot][1].send(self.running[slot])

    def wait(self) -> list[Outcome]:
        """Blocks until a running job ends, then returns every finished one's outcome; a worker that
        died mid-job reports it as `died` (how, from its exit code) and is replaced."""
        if not self.running:
            return []
        busy = {slot: self.slots[slot] for slot in self.running}
        ready = wait_any([p.sentinel for p, _ in busy.values()] + [c for _, c in busy.values()])
        done = []
        for slot, (process, conn) in busy.items():
            if conn in ready:
                try:
                    done.append(Outcome(*conn.recv()))
                    del self.running[slot]
                    continue
                except (EOFError, ConnectionResetError):
                    pass  # (it died while answering)
            if process.sentinel in ready or not process.is_alive():
                process.join()
                key = self.running.pop(slot)[0]
                done.append(Outcome(key, died=exit_reason(process.exitcode)))
                conn.close()
                self.slots[slot] = self._start()
        self._dispatch()
        return done

    def close(self) -> None:
        """Asks idle workers to stop, then terminates any still running after a few seconds (at
        once when jobs are still out: the build is stopping)."""
        for process, conn in self.slots:
            if process.is_alive() and not self.running:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for process, conn in self.slots:
            process.join(timeout=5 if not self.running else 0)
            if process.is_alive():
                process.terminate()
                process.join()
            conn.close()


def exit_reason(code: int | None) -> str:
    """How a process ended, in words."""
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        what = {
            "SIGKILL": "killed, e.g. for memory",
            "SIGABRT": "aborted in native code",
            "SIGSEGV": "a crash in native code",
        }.get(name, "a signal")
        return f"{name}: {what}"
    return f"exit code {code}"


# ----------------------------------------------------------------------------- Ray


_ray_context: dict = {}


def _ray_job(init: Callable, context, key, fn: Callable, job) -> tuple:
    """A Ray task: runs the build's `init(context)` once per build in the worker process (a
    worker runs tasks of one build after another's), then the job (`_answer`)."""
    token = context.token  # (a worker process runs jobs of one build after another's)
    if _ray_context.get("token") != token:
        init(context)
        _ray_context["token"] = token
    return _answer(key, fn, job)


class RayTasks:
    """Jobs as Ray tasks on the cluster at `address` (`auto`: the one `ray start` started on
    this machine or RAY_ADDRESS names, else a local one for this build)."""

    def __init__(self, address: str, init: Callable, context):
        """Joins the cluster at `address` (unless this process already has) and wraps the job as a
        task Ray retries `RETRIES` times when its worker or node dies; refuses without Ray."""
        try:
            import ray
        except ImportError:
            raise ConfigError(
                "the index build on Ray (--ray, data.index_ray) needs Ray: pip install -e '.[ray]'"
            ) from None
        self.ray = ray
        if not ray.is_initialized():
            _connect(ray, address)
        self.remote = ray.remote(max_retries=RETRIES, retry_exceptions=False)(_ray_job)
        self.init, self.context = init, ray.put(context)
        self.pending: dict = {}  # ObjectRef -> key

    def cores(self) -> int:
        """The cluster's CPUs, as Ray counts them (what sizes the build's shards)."""
        return int(self.ray.cluster_resources().get("CPU", 1))

    def submit(self, key, fn: Callable, job) -> None:
        """Starts the job as a Ray task."""
        ref = self.remote.remote(self.init, self.context, key, fn, job)
        self.pending[ref] = key

    def wait(self) -> list[Outcome]:
        """Blocks until a task ends, then returns the outcomes of those done: a task whose own code
        raised is its error; one that died past its retries is `died`."""
        if not self.pending:
            return []
        ready, _ = self.ray.wait(list(self.pending), num_returns=1)
        done = []
        for ref in ready:
            key = self.pending.pop(ref)
            try:
                done.append(Outcome(*self.ray.get(ref)))
            except self.ray.exceptions.RayTaskError as e:  # (our own code failed in the task)
                done.append(Outcome(key, error=str(e)))
            except self.ray.exceptions.RayError as e:  # its worker or node died, retries spent
                done.append(Outcome(key, died=f"{type(e).__name__}: {str(e)[:300]}"))
        return done

    def close(self) -> None:
        """Cancels the tasks still out (force: their workers are killed)."""
        for ref in self.pending:
            self.ray.cancel(ref, force=True)


def _connect(ray, address: str) -> None:
    """Joins the cluster at `address`; `auto`: a running one (RAY_ADDRESS, or `ray start` on
    this machine), else starts a local one for this build."""
    quiet = {"log_to_driver": False, "include_dashboard": False}
    if address != "auto":
        ray.init(address=address, **quiet)
        return
    try:
        ray.init(address="auto", **quiet)
    except ConnectionError:  # (none running)
        ray.init(**quiet)
