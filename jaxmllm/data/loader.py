"""Loads a step's planned samples, in-process or in a pool of worker processes, applying
data.on_error to records that fail at load time (a file changed or removed since the index).

Planning stays in the iterator's process, so its state is exact; workers only map a sample
index to a Sample, which is a pure function of the index. Under `skip` a failed sample is None:
bucketize leaves its slots as padding, and the sample still counts as consumed.

Workers are started by spawn (JAX's threads make fork unsafe) and send their samples' arrays
back through shared memory (`jaxmllm.data.shared`), not pickled. A worker that dies (killed,
out of memory, or a script without an `if __name__ == "__main__":` guard, whose top level every
spawned worker runs again) stops the load with an error that says so and names the record
each dead worker was loading, never a hang. Workers ignore Ctrl-C: the process that owns them
stops them (`close`); they start with SIGINT blocked, so a Ctrl-C while one is still importing
prints nothing either. A worker whose owner died (SIGKILL) exits within a second.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
import weakref
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from jaxmllm.config import Config
from jaxmllm.data import shared
from jaxmllm.data.media.container import set_decode_threads, share_of_cores
from jaxmllm.data.rejects import DataError, RecordError, RejectLog, fail_message, failed
from jaxmllm.data.samples import Sample

log = logging.getLogger("jaxmllm")

# Seconds a stopped worker has to exit after SIGTERM before it is killed (and said); and the
# most a killed one's reaping is waited for (it ends as soon as it is done)
STOP_GRACE_S = 5.0
REAP_S = 5.0

_worker: dict = {}


def _init_worker(source, owner: str, threads: int = 0) -> None:
    # Ctrl-C reaches the terminal's whole process group. The trainer stops the workers itself,
    # after the checkpoint the signal asks for; a worker interrupted in its queue would only
    # print a traceback (`Process SpawnProcess-1: ... KeyboardInterrupt`), so it ignores it.
    # (It started with SIGINT blocked, `_sigint_blocked`: a Ctrl-C meanwhile is dropped here.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _worker["source"], _worker["owner"] = source, owner
    set_decode_threads(threads)  # (the workers decode side by side: a share of the cores each)
    _worker["loading"] = shared.loading_slot(owner, os.getpid())
    parent = os.getppid()
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()


def _exit_with(parent: int) -> None:
    """Ends this worker once its owner is gone (a SIGKILLed trainer leaves no orphans: the pool's
    pipes alone do not wake a worker blocked in a long decode)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _load_one(job):
    _loading(int(job[0]))  # the record in hand, for the error if this process dies now
    out = shared.pack(_load(_worker["source"], *job), _worker["owner"])
    _loading(-1)
    return out


def _loading(i: int) -> None:
    if _worker["loading"] is not None:
        os.pwrite(_worker["loading"], i.to_bytes(8, "little", signed=True), 0)


def _load(source, i: int, keep):
    """source[i], or only the listed items of it where the source can (`load`)."""
    try:
        if keep is not None and hasattr(source, "load"):
            return source.load(i, keep)
        return source[i]
    except RecordError as e:  # sent back as a tuple: exceptions with extra fields do not pickle
        return ("error", e.reason, e.detail, e.record_id)
    except Exception as e:  # noqa: BLE001  (MemoryError included) one record never stops a run
        try:
            rid = source.record_id(i) if hasattr(source, "record_id") else f"index:{i}"
        except Exception:  # noqa: BLE001
            rid = f"index:{i}"
        err = failed(e, rid)
        return ("error", err.reason, err.detail, err.record_id)


class Loader:
    """Loads samples by index; counts and logs load-time rejects to <output_dir>/rejects.jsonl."""

    def __init__(
        self, cfg: Config, source, reject_log: str | Path | None = None, write: bool = True
    ):
        """`reject_log`: the file load-time rejects are appended to (default
        <output_dir>/rejects.jsonl); `write` False: none, the caller writes the entries
        (`RejectLog.take_entries`)."""
        self.cfg, self.source = cfg, source
        path = reject_log or Path(cfg.train.output_dir) / "rejects.jsonl"
        self.log = RejectLog(path if write else None)
        self.startup_written = False
        self.frames: Counter = Counter()  # videos read from the frame cache or decoded
        self.pool = None
        if cfg.data.workers > 0:
            shared.remove_stale()  # (of loaders killed before they could)
            self.owner = shared.Owner()  # this loader's token in shared-memory names
            self.pool = ProcessPoolExecutor(
                cfg.data.workers,
                multiprocessing.get_context("spawn"),  # JAX's threads make fork unsafe
                initializer=_init_worker,
                initargs=(self.source, self.owner.token, share_of_cores(cfg.data.workers)),
            )
            weakref.finalize(self, _stop, self.pool, self.owner)

    def load(
        self, indices: np.ndarray, step: int, media: dict[int, dict] | None = None
    ) -> dict[int, Sample | None]:
        """{index: Sample, or None for a sample skipped under data.on_error=skip}.

        `media[i] = {phase: item numbers}`: decode only those items of sample i (numbers within
        the sample; the others are None in the Sample) — on several hosts, another host encodes
        them.
        """
        if step == 0 and not self.startup_written:  # a fresh run logs start-up repairs once
            for entry in getattr(self.source, "startup_rejects", []):
                self.log.add("_startup", {**entry, "stage": "startup"})
            self.startup_written = True
        idx = [int(i) for i in indices]
        jobs = [(i, None if media is None else media.get(i, {})) for i in idx]
        if self.pool is not None:
            chunk = max(1, len(idx) // (4 * self.cfg.data.workers))
            with _sigint_blocked():  # (workers start here: see _init_worker)
                results = self.pool.map(_load_one, jobs, chunksize=chunk)
            workers = list((getattr(self.pool, "_processes", None) or {}).values())
            try:
                got = [shared.unpack(g) for g in results]
            except BrokenProcessPool:
                dead = self._dead(workers)
                raise DataError(_died(self.cfg.data.workers, step, dead)) from None
        else:
            got = [_load(self.source, *job) for job in jobs]
        out = {}
        for i, g in zip(idx, got, strict=True):
            if isinstance(g, tuple):
                err = RecordError(g[1], g[2], g[3])
                if self.cfg.data.on_error == "fail":
                    raise DataError(fail_message(err, "data.on_error", f"step {step}"))
                self.log.add(f"load_{err.reason}", err.to_json(stage="load", step=step, index=i))
                g = None
            elif g is not None:
                self.frames.update(getattr(g, "frames", {}))
            out[i] = g
        return out

    def _dead(self, workers: list) -> list[str]:
        """'<record> (index i) (<how it ended>)' for each worker that died on its own."""
        _reaped(self.pool, timeout=10)  # (the pool stopped the others: it collects them all)
        out = []
        for process in workers:
            code = process.exitcode
            if code is None or code == -signal.SIGTERM:  # (the pool stops the others so)
                continue
            i = shared.read_loading(self.owner.token, process.pid)
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            if i is None:
                out.append(f"a record not known ({how})")
                continue
            out.append(f"{self._record(i)} ({how})")
        return out

    def _record(self, i: int) -> str:
        """'<record id> (index i)', or 'index i' for a source without record ids."""
        try:
            return f"{self.source.record_id(i)} (index {i})"
        except Exception:  # noqa: BLE001  (none, or one that fails: the index still says)
            return f"index {i}"

    def close(self) -> None:
        """Stops the worker processes (also done when the loader is garbage-collected)."""
        if self.pool is not None:
            _stop(self.pool, self.owner)

    def counts(self) -> dict[str, float]:
        """Cumulative reject counts for the step metrics ({} for the synthetic source)."""
        if not hasattr(self.source, "index_rejects"):
            return {}
        out = {"rejects/index_total": float(sum(self.source.index_rejects.values()))}
        out.update({f"rejects/index_{k}": float(v) for k, v in self.source.index_rejects.items()})
        for entry in self.source.startup_rejects:
            key = f"rejects/oversize_{entry['action']}"
            out[key] = out.get(key, 0.0) + 1.0
        loads = {k: v for k, v in self.log.counts.items() if k.startswith("load_")}
        out["rejects/load_total"] = float(sum(loads.values()))
        out.update({f"rejects/{k}": float(v) for k, v in loads.items()})
        out.update({f"frames/{k}": float(v) for k, v in sorted(self.frames.items())})
        return out


@contextlib.contextmanager
def _sigint_blocked():
    """SIGINT blocked in this thread: a process spawned meanwhile starts with it blocked."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _stop(pool: ProcessPoolExecutor, owner: shared.Owner) -> None:
    """Stops the workers now, not after their current samples (the executor's own list of
    them: `terminate_workers` is Python 3.14's), and deletes the shared files they left."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)  # (shutdown forgets it)
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    if not _reaped(pool, timeout=STOP_GRACE_S, manager=manager):
        for process in processes:
            if _state(process.pid) not in (None, "Z"):  # (a zombie is dead, not yet collected)
                state = _signal_state(process.pid)
                log.warning(
                    "a data worker (pid %d) outlived SIGTERM by %g s: %s",
                    process.pid,
                    STOP_GRACE_S,
                    state,
                )
                process.kill()
        _reaped(pool, timeout=REAP_S, manager=manager)
    owner.close()


def _reaped(pool: ProcessPoolExecutor, timeout: float, manager=None) -> bool:
    """Waits for the pool's manager thread to end, which collects the workers' exit status
    (`Process.exitcode` is then set). It is their only reaper: a join in this thread races
    its `waitpid`, and Python reads the lost race (ECHILD) as a process still running, with
    no exit code. False if it is still at work after `timeout` seconds."""
    manager = manager or getattr(pool, "_executor_manager_thread", None)
    if manager is None or manager is threading.current_thread():
        return True
    manager.join(timeout)
    return not manager.is_alive()


def running(pid: int) -> bool:
    """Whether process `pid` exists (a zombie too), as the OS says (/proc; True without it)."""
    return _state(pid) is not None


def _state(pid: int) -> str | None:
    """A process's state letter from /proc ('R', 'S', 'Z' ...), None if it is gone ('?'
    without /proc)."""
    if not Path("/proc").is_dir():
        return "?"
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def _signal_state(pid: int) -> str:
    """A process's state and signal masks, from /proc (why a SIGTERM did not end it)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            keys = ("State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
            return ", ".join(" ".join(line.split()) for line in f if line.split(":")[0] in keys)
    except OSError as e:
        return f"no /proc status ({e.strerror})"


def _died(workers: int, step: int, dead: list[str]) -> str:
    records = f", loading {'; '.join(dead)}" if dead else ""
    return (
        f"data.workers={workers}: a worker process died while loading step {step}{records} (its "
        "error, if any, is above). A script that runs the data pipeline with workers must keep its "
        'top-level code under `if __name__ == "__main__":` (workers start by spawn, which '
        "runs the main script again in each); a worker killed for memory needs fewer workers "
        "or more memory. data.workers: 0 loads in this process."
    )
