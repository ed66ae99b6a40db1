"""Loaded samples from worker processes to the loader without pickling their arrays.

A worker process writes the large arrays of the sample it loaded (patches, log-mel frames) into
one file in shared memory (/dev/shm) and sends back the sample with each of them replaced by its
place in that file; the loader maps the file, deletes its name at once and reads the arrays in
place (they live as long as they are referenced). Pickled, the arrays were copied four times
(into the pickle, through the pipe twice, out of the pickle), the last on the loader's one
thread; here the worker copies once and the loader not at all, until bucketize does.

Where /dev/shm is missing or full, a sample travels pickled, as before.
"""

from __future__ import annotations

import dataclasses
import itertools
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SHM = Path("/dev/shm")
MIN_BYTES = 1 << 16  # smaller arrays travel pickled: a file costs more than copying them
ALIGN = 64
_counter = itertools.count()


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


def prefix(owner: int) -> str:
    """The start of the shared files' names written for the loader in process `owner`."""
    return f"jaxmllm-{owner}-"


def pack(sample: Any, owner: int) -> Any:
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


def remove_left(owner: int) -> None:
    """Deletes the shared files workers wrote for `owner` that it never read (a step cut short)."""
    if SHM.is_dir():
        for path in SHM.glob(f"{prefix(owner)}*"):
            path.unlink(missing_ok=True)


def remove_stale() -> None:
    """Deletes the shared files of loaders whose process is gone (killed before it could)."""
    if not SHM.is_dir():
        return
    for path in SHM.glob("jaxmllm-*-*"):
        owner = path.name.split("-")[1]
        if owner.isdigit() and not _alive(int(owner)):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


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
