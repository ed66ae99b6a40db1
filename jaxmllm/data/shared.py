"""Loaded samples from worker processes to the loader without pickling their arrays.

A worker process writes the large arrays of the sample it loaded (patches, log-mel frames) into
one file in shared memory (/dev/shm) and sends back the sample with each of them replaced by its
place in that file; the loader maps the file, deletes its name at once and reads the arrays in
place (they live as long as they are referenced). Pickled, the arrays were copied four times
(into the pickle, through the pipe twice, out of the pickle), the last on the loader's one
thread; here the worker copies once and the loader not at all, until bucketize does.

Where /dev/shm is missing or full, a sample travels pickled, as before.

Names carry the loader's random token (`Owner`), never a process id alone: /dev/shm may be
shared by trainers in other pid namespaces (containers with --ipc=host), where a pid says
nothing about whether its owner lives. A loader holds an flock on its own lock file,
`jaxmllm-<token>.lock`, for its life; the kernel drops the lock when the process dies, however it
dies (SIGKILL included), and only then does `remove_stale` delete that token's files.
"""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import mmap
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SHM = Path("/dev/shm")
MIN_BYTES = 1 << 16  # smaller arrays travel pickled: a file costs more than copying them
ALIGN = 64
_counter = itertools.count()
_TOKEN = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class Packed:
    """A sample whose large arrays are `Ref`s into the shared file at `path`."""

    sample: Any
    path: str


@dataclass(frozen=True)
class Ref:
    """An array's place in a shared file."""

    offset: int
    shape: tuple[int, ...]
    dtype: str


class Owner:
    """A loader's token in shared-memory names, and the lock that says it is alive.

    The lock file is made under a temporary name, locked, then renamed into place, so no other
    process's `remove_stale` ever sees it unlocked while its owner lives."""

    def __init__(self):
        self.token = secrets.token_hex(8)
        self.fd: int | None = None
        if not SHM.is_dir():
            return
        lock = SHM / f"jaxmllm-{self.token}.lock"
        temp = lock.with_name(lock.name + ".new")
        try:
            fd = os.open(temp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError:  # not writable: workers will send their samples pickled
            return
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(temp, lock)
        self.fd = fd

    def close(self) -> None:
        """Deletes the files written for this owner and then its lock (the loader's end)."""
        remove_left(self.token)
        if self.fd is not None:
            (SHM / f"jaxmllm-{self.token}.lock").unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


def prefix(owner: str) -> str:
    """The start of the shared files' names written for the loader whose token is `owner`."""
    return f"jaxmllm-{owner}-"


def pack(sample: Any, owner: str) -> Any:
    """`sample` with its large arrays moved to a shared file (a `Packed`), or as it is when it
    has none or shared memory is unavailable."""
    arrays: list[np.ndarray] = []
    light = _map(sample, lambda a: _take(a, arrays))
    if not arrays or not SHM.is_dir():
        return sample
    path = SHM / f"{prefix(owner)}{os.getpid()}-{next(_counter)}"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            offset = 0
            for a in arrays:
                _write_all(fd, np.ascontiguousarray(a), offset)
                offset += -(-a.nbytes // ALIGN) * ALIGN
        finally:
            os.close(fd)
    except OSError:  # /dev/shm full (ENOSPC) or not writable: pickle this one
        path.unlink(missing_ok=True)
        return sample
    return Packed(light, str(path))


def unpack(got: Any) -> Any:
    """What `pack` sent, with its arrays read in place from the shared file (deleted here)."""
    if not isinstance(got, Packed):
        return got
    with open(got.path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # (writable, private)
    os.unlink(got.path)  # the mapping stays until its arrays are gone
    view = memoryview(mapped)

    def read(ref: Ref) -> np.ndarray:
        count = int(np.prod(ref.shape))
        a = np.frombuffer(view, ref.dtype, count, ref.offset)
        return a.reshape(ref.shape)

    return _map(got.sample, read, Ref)


def remove_left(owner: str) -> None:
    """Deletes the shared files workers wrote for `owner` that it never read (a step cut short)."""
    if SHM.is_dir():
        for path in SHM.glob(f"{prefix(owner)}*"):
            path.unlink(missing_ok=True)


def remove_stale() -> None:
    """Deletes the shared files of loaders that died before they could: those whose lock file
    no process holds. Files of other names (another program's, or a live loader's in another
    pid namespace) are never touched."""
    if not SHM.is_dir():
        return
    for lock in SHM.glob("jaxmllm-*.lock"):
        token = lock.name[len("jaxmllm-") : -len(".lock")]
        if not _TOKEN.fullmatch(token):
            continue
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:  # removed meanwhile, or another user's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its loader lives
            os.close(fd)
            continue
        try:
            remove_left(token)
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)


def loading_slot(owner: str, pid: int) -> int | None:
    """A worker's 8-byte file naming the record it is loading (`read_loading`), or None where
    shared memory is unavailable. Deleted with the owner's other files."""
    if not SHM.is_dir():
        return None
    try:
        fd = os.open(SHM / f"{prefix(owner)}loading-{pid}", os.O_CREAT | os.O_RDWR, 0o600)
    except OSError:
        return None
    os.pwrite(fd, (-1).to_bytes(8, "little", signed=True), 0)
    return fd


def read_loading(owner: str, pid: int) -> int | None:
    """The index the worker `pid` of `owner` was loading last, or None if not known."""
    try:
        data = (SHM / f"{prefix(owner)}loading-{pid}").read_bytes()
    except OSError:
        return None
    i = int.from_bytes(data[:8], "little", signed=True) if len(data) >= 8 else -1
    return i if i >= 0 else None


def _take(a: np.ndarray, arrays: list[np.ndarray]) -> Any:
    if a.nbytes < MIN_BYTES or a.dtype.hasobject:
        return a
    offset = sum(-(-x.nbytes // ALIGN) * ALIGN for x in arrays)
    arrays.append(a)
    return Ref(offset, tuple(a.shape), a.dtype.str)


def _map(x: Any, fn, kind: type = np.ndarray) -> Any:
    """`x` with every `kind` inside it (dataclass fields, lists, tuples, dicts) replaced by
    fn(it)."""
    if isinstance(x, kind):
        return fn(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = {f.name: _map(getattr(x, f.name), fn, kind) for f in dataclasses.fields(x)}
        return dataclasses.replace(x, **fields)
    if isinstance(x, list | tuple):
        return type(x)(_map(v, fn, kind) for v in x)
    if isinstance(x, dict):
        return {k: _map(v, fn, kind) for k, v in x.items()}
    return x


def _write_all(fd: int, a: np.ndarray, offset: int) -> None:
    view = memoryview(a).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
