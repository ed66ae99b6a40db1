"""train.output_dir held by the run that trains into it.

Two runs started on one output folder wrote each other's checkpoints: the second stopped
(exit 5, orbax tracebacks) after removing the first run's unfinished save. A run now takes an
exclusive lock on `<output_dir>/.jaxmllm.lock` at start-up, before it writes anything there,
and holds it until it ends; a second run on the folder stops at once (exit 2), naming the
process that holds it. The lock is the kernel's (`flock`): a run that dies, even by SIGKILL,
leaves it free. Only process 0 of a multi-process job takes it (they share the folder); on a
network file system `flock` works where the client forwards locks (NFS since Linux 2.6.12).
Reading a run's folder (generation, export, evaluation) needs no lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from jaxmllm.config import ConfigError, printable

LOCK = ".jaxmllm.lock"


@contextlib.contextmanager
def hold_output_dir(out: Path, take: bool = True) -> Iterator[None]:
    """Holds `out`'s lock for the `with` block (`take` False: a process other than the job's
    first, which shares it: nothing).

    Raises:
      ConfigError: another run holds it, named (its process, host, start and command).
    """
    if not take:
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"train.output_dir={out} is in use by another run ({_holder(fd)}): two runs "
                "in one folder overwrite each other's checkpoints. Wait for it to end (or stop "
                "it), or give this run another train.output_dir"
            ) from None
        mine = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(mine).encode(), 0)
        yield
    finally:
        os.close(fd)  # (closing the last descriptor of it releases the lock)


def _holder(fd: int) -> str:
    """The run that holds the lock, as it wrote itself into the file."""
    try:
        raw = json.loads(os.pread(fd, 1 << 16, 0))
        return printable(
            f"process {raw['pid']} on {raw['host']}, started {raw['started']}: {raw['command']}"
        )
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not said which yet"
