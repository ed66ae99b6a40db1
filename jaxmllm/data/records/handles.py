"""The data files a process holds open, bounded: at most MAX_OPEN, least recently used closed.

A data set may be thousands of files (3,000 one-line JSONL files, WebDataset shards, Parquet
files); a handle kept per file per process ran into `ulimit -n` (1,024 by default), and every
read after it failed "Too many open files" as that record's reject. The readers take their
files from one `OpenFiles` a process: a file read again soon is not reopened, a file not read
for a while is closed. Bytes are read with `os.pread` (no shared file position: a forked worker
or a second thread reading the same file cannot move another's). A forked child starts with an
empty table and a fresh lock (the parent's handles are the parent's to close; its lock may
have been held by a thread that does not exist in the child).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

MAX_OPEN = 64  # files one process holds open for reading records (ulimit -n is 1,024 at least)


class OpenFiles:
    """Open objects by key (a file descriptor, a Parquet file, an ArrayRecord source), at most
    `limit`; `use` hands one out under a lock, so none is closed while in use."""

    def __init__(self, limit: int = MAX_OPEN):
        self.limit = limit
        self._open: OrderedDict[object, tuple[object, Callable]] = OrderedDict()
        self._lock = threading.RLock()
        self._pid = os.getpid()

    @contextmanager
    def use(self, key: object, opener: Callable[[], object], closer: Callable) -> Iterator:
        with self._lock:
            if self._pid != os.getpid():  # a forked child
                self._open, self._pid = OrderedDict(), os.getpid()
            if key in self._open:
                self._open.move_to_end(key)
            else:
                self._open[key] = (opener(), closer)
                while len(self._open) > self.limit:
                    _, (old, close) = self._open.popitem(last=False)
                    close(old)
            yield self._open[key][0]

    def forked(self) -> None:
        """In a forked child: a fresh lock (the parent's may have been held by another thread
        at the fork, which would hang the child's first read) and an empty table."""
        self._lock, self._open, self._pid = threading.RLock(), OrderedDict(), os.getpid()

    def __len__(self) -> int:
        return len(self._open) if self._pid == os.getpid() else 0

    def close_all(self) -> None:
        with self._lock:
            while self._open:
                _, (old, close) = self._open.popitem()
                close(old)


FILES = OpenFiles()
os.register_at_fork(after_in_child=FILES.forked)


def pread(path: str | Path, offset: int, size: int) -> bytes:
    """`size` bytes of the file at `path` from `offset` (fewer at its end)."""
    opener = lambda: os.open(path, os.O_RDONLY)  # noqa: E731
    with FILES.use(("fd", str(path)), opener, os.close) as fd:
        return os.pread(fd, size, offset)
