"""Columns of numbers and strings as .npy files, which every host maps without parsing them.

A column is one numpy array in numpy's own `.npy` format (a header naming its dtype and
shape, then the raw array): `np.load(path, mmap_mode="r")` maps it, so opening a column of 10^8
counts reads its header and nothing else, and the pages a host touches are the only memory it
uses (shared with the page cache, read-only). A column of strings (record ids, .tar member
names) is two arrays: UTF-8 bytes one after another and the offsets where each starts
(`Strings`), so one long name costs its own bytes, not a fixed width times every row.

(Why .npy rather than Arrow IPC: each column is one contiguous array of the dtype the planner
computes with, mapped as it is, whereas an Arrow table written in several record batches maps
as chunks that numpy must copy to join; the merge of an index's shards streams each column into
a preallocated .npy (`ColumnWriter`), never holding the whole of it; and a column's file says
its own dtype and shape, which loading checks against the index's summary.)

A folder of columns is written beside its final place and renamed into it once complete
(`staging`, `publish`): a reader finds the old folder whole, the new one whole, or none.
"""

from __future__ import annotations

import glob
import mmap
import os
import secrets
import shutil
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxmllm.config import ConfigError


class ColumnError(ConfigError):
    """A column file that is missing, not an .npy array, or not what the summary says."""


@dataclass(frozen=True)
class Strings:
    """A column of strings: string i is the UTF-8 bytes `data[offsets[i]:offsets[i + 1]]`
    (lone surrogates, as Python decodes undecodable file names, kept by `surrogateescape`)."""

    offsets: np.ndarray  # int64 [n + 1], non-decreasing
    data: np.ndarray  # uint8 [bytes]

    @classmethod
    def of(cls, strings: Iterable[str]) -> Strings:
        encoded = [s.encode("utf-8", "surrogateescape") for s in strings]
        offsets = np.zeros(len(encoded) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), out=offsets[1:])
        return cls(offsets, np.frombuffer(b"".join(encoded), np.uint8))

    @classmethod
    def concat(cls, parts: list[Strings]) -> Strings:
        parts = [p.rebased() for p in parts]
        starts = np.cumsum([0, *(len(p.data) for p in parts)])
        offsets = [p.offsets[:-1] + s for p, s in zip(parts, starts, strict=False)]
        offsets.append(np.asarray([starts[-1]], np.int64))
        data = np.concatenate([p.data for p in parts]) if parts else np.zeros(0, np.uint8)
        return cls(np.concatenate(offsets).astype(np.int64), data)

    def rebased(self) -> Strings:
        """The same strings with offsets starting at 0 (a slice's start past its data's)."""
        first, last = int(self.offsets[0]), int(self.offsets[-1])
        return Strings(np.asarray(self.offsets) - first, np.asarray(self.data[first:last]))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise IndexError("a Strings column slices with step 1 only")
            return Strings(self.offsets[start : max(start, stop) + 1], self.data)
        i = int(i)
        if not -len(self) <= i < len(self):
            raise IndexError(f"string {i} of {len(self)}")
        i %= len(self)
        raw = self.data[int(self.offsets[i]) : int(self.offsets[i + 1])].tobytes()
        return raw.decode("utf-8", "surrogateescape")

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(len(self)))

    def tolist(self) -> list[str]:
        return list(self)


# ----------------------------------------------------------------------------- files


def column_files(name: str, value: np.ndarray | Strings) -> dict[str, np.ndarray]:
    """The .npy files a column is stored in: `<name>.npy`, or `<name>.offsets.npy` and
    `<name>.bytes.npy` for strings."""
    if isinstance(value, Strings):
        value = value.rebased()
        return {f"{name}.offsets.npy": value.offsets, f"{name}.bytes.npy": value.data}
    return {f"{name}.npy": np.ascontiguousarray(value)}


def save(folder: Path, name: str, value: np.ndarray | Strings) -> dict[str, list]:
    """Writes column `name` into `folder`; returns its files' entries of a column table
    ({file: [dtype, shape]}, which `open_column` checks)."""
    table = {}
    for file, array in column_files(name, value).items():
        np.save(folder / file, array, allow_pickle=False)
        table[file] = describe(array)
    return table


def describe(array: np.ndarray) -> list:
    """An array's entry in a column table: [dtype string, shape]."""
    return [array.dtype.str, list(array.shape)]


def open_column(folder: Path, file: str, table: dict[str, list]) -> np.ndarray:
    """Column file `file` of `folder`, mapped read-only, checked to be the dtype and shape its
    table says (a file cut short, replaced or rewritten by hand is refused, naming it)."""
    path = folder / file
    if file not in table:
        raise ColumnError(f"{path}: not in the index's summary (written by another version?)")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise ColumnError(f"{path} is missing") from None
    except (ValueError, OSError, EOFError) as e:
        raise ColumnError(f"{path} is not a readable .npy array ({e})") from None
    if describe(array) != [table[file][0], list(table[file][1])]:
        raise ColumnError(
            f"{path} holds {array.dtype.str} {list(array.shape)}, the summary says "
            f"{table[file][0]} {table[file][1]}"
        )
    return array.view(Column) if isinstance(array, np.memmap) else array


def open_strings(folder: Path, name: str, table: dict[str, list]) -> Strings:
    """String column `name` of `folder`, mapped (offsets checked to stay inside the bytes)."""
    offsets = open_column(folder, f"{name}.offsets.npy", table)
    data = open_column(folder, f"{name}.bytes.npy", table)
    if offsets.dtype != np.int64 or data.dtype != np.uint8 or not len(offsets):
        raise ColumnError(f"{folder / name}.offsets.npy / .bytes.npy: not a string column")
    for start, part in chunks(offsets):
        first = int(part[0]) if start else 0
        if (start == 0 and first != 0) or (np.diff(part) < 0).any() or int(part[-1]) > len(data):
            raise ColumnError(f"{folder / name}.offsets.npy: offsets out of order or past the data")
    return Strings(offsets, data)


CHUNK = 1 << 20  # rows a chunked pass reads at a time (8 MB of int64)


def chunks(array: np.ndarray, size: int = CHUNK) -> Iterator[tuple[int, np.ndarray]]:
    """(start, rows start..start+size) of `array`, each a `window`: a pass over a mapped
    column of 10^8 rows holds one window at a time."""
    for start in range(0, len(array), size):
        yield start, window(array, start, min(len(array), start + size))


def window(array: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Rows start..stop-1 of `array`; of a mapped column, read from its file into an array
    of their own, freed when dropped: the mapping's pages are not touched, so they do not
    stay in this process's resident memory (nor cost a page fault each)."""
    if not _whole_file(array):  # (a slice of a mapping keeps its parent's offset: not usable)
        return np.asarray(array[start:stop])
    row = array.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))
    count = (stop - start) * row // array.itemsize
    out = np.fromfile(array.filename, array.dtype, count, offset=array.offset + start * row)
    return out.reshape(stop - start, *array.shape[1:])


GATHER_BLOCK = 1 << 26  # bytes of a column a gather maps at once (`Column`)


class Column(np.memmap):
    """A mapped column whose gathers (`column[rows]`, rows an array of row numbers) leave no
    page of it resident: the rows are read through the mapping in ascending order, a block
    of GATHER_BLOCK bytes of the file at a time, and each block's pages are released
    (madvise DONTNEED: the page cache keeps them, this process's memory does not) before the
    next. Read through a plain mapping, a few thousand rows scattered over a 10^8-row column
    bring the kernel's neighbourhood of each (fault-around, 64 KB) into the process's
    resident memory: the whole column, gigabytes, after a step's plan. A column of at most
    GATHER_BLOCK bytes is read as a plain mapping (it may stay resident whole). Everything
    else is a numpy memmap's."""

    def __getitem__(self, key):
        if (
            isinstance(key, np.ndarray | list)
            and self._mmap is not None
            and len(self._mmap) > GATHER_BLOCK  # (a smaller column may stay resident whole)
            and self.ndim
        ):
            rows = np.asarray(key)
            if rows.dtype.kind in "iu" and rows.size and self.strides[0] > 0:
                return _gather(self, rows)
        return super().__getitem__(key)


def _gather(column: Column, rows: np.ndarray) -> np.ndarray:
    plain = column.view(np.ndarray)
    flat = rows.ravel().astype(np.int64, copy=False)
    flat = np.where(flat < 0, flat + len(column), flat)  # (numpy's negative rows)
    order = np.argsort(flat, kind="stable")
    wanted = flat[order]
    out = np.empty((len(flat), *column.shape[1:]), column.dtype)
    stride = column.strides[0]
    per = max(1, GATHER_BLOCK // stride)
    cuts = np.flatnonzero(np.diff(wanted // per)) + 1
    base = np.frombuffer(column._mmap, np.uint8).ctypes.data  # (the mapping's first byte)
    start = column.ctypes.data - base
    page = mmap.PAGESIZE
    for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(flat)], strict=True):
        out[order[a:b]] = plain[wanted[a:b]]
        lo = (start + int(wanted[a]) * stride) // page * page
        hi = min(len(column._mmap), start + (int(wanted[b - 1]) + 1) * stride)
        column._mmap.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    return out.reshape(*rows.shape, *column.shape[1:])


def _whole_file(array: np.ndarray) -> bool:
    """Whether `array` is a mapped .npy file's whole array (not a slice of one)."""
    if not isinstance(array, np.memmap) or not array.filename or not array.flags.c_contiguous:
        return False
    try:
        return array.offset + array.nbytes == os.path.getsize(array.filename)
    except OSError:
        return False


# ----------------------------------------------------------------------------- streaming


class ColumnWriter:
    """Writes one .npy column of a known length part by part (a merge of shards), never
    holding it whole."""

    def __init__(self, path: Path, dtype, shape: tuple[int, ...]):
        self.path, self.shape, self.done = Path(path), tuple(shape), 0
        if not shape[0]:  # (an empty array cannot be mapped for writing)
            np.save(self.path, np.zeros(shape, dtype), allow_pickle=False)
            self.out = None
        else:
            self.out = np.lib.format.open_memmap(self.path, "w+", np.dtype(dtype), self.shape)

    def write(self, part: np.ndarray) -> None:
        """Appends `part` (rows of the column's dtype and row shape)."""
        if len(part):
            self.out[self.done : self.done + len(part)] = part
        self.done += len(part)

    def close(self) -> list:
        """Finishes the file; its entry of a column table."""
        if self.done != self.shape[0]:
            raise RuntimeError(f"{self.path}: {self.done} rows written of {self.shape[0]}")
        if self.out is not None:
            self.out.flush()
            dtype = self.out.dtype
            del self.out
            return [dtype.str, list(self.shape)]
        return describe(np.load(self.path, mmap_mode="r"))


# ----------------------------------------------------------------------------- folders


def staging(out: Path) -> Path:
    """A new, empty folder beside `out` to write its next version in (a name of its own per
    build, so two builds never mix their files)."""
    mark = f"{os.getpid()}-{secrets.token_hex(4)}-{socket.gethostname()}"
    path = out.parent / f".{out.name}.building-{mark}"
    path.mkdir(parents=True)
    return path


def publish(staged: Path, out: Path) -> None:
    """Puts the finished folder `staged` in the place of `out`: the old folder is renamed
    aside, the new one renamed in, the old one deleted. A process killed in between leaves no
    `out` (the index must be built again), never a mix of two builds or half of one."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(out, old)
    os.rename(staged, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_stale(out: Path) -> None:
    """Deletes what builds of `out` on this machine, killed before they finished, left beside
    it (a staging folder whose process is gone; an old version not yet deleted)."""
    prefix = f".{out.name}.building-"
    for leftover in out.parent.glob(f"{glob.escape(prefix)}*"):
        parts = leftover.name[len(prefix) :].split("-", 2)  # pid, token, host
        if len(parts) == 3 and parts[2] == socket.gethostname() and not _running(parts[0]):
            shutil.rmtree(leftover, ignore_errors=True)
    for leftover in out.parent.glob(f"{glob.escape(f'.{out.name}.old-')}*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _running(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # (another user's process)
        return True
    return True
