"""The memory one record may cost a process that reads it (data.worker_memory).

The caps on files (bytes, pixels, seconds) bound what a record holds, not what reading it
costs: a 249 KB PNG of 64 Mpx took 1.6 GB to decode, a JSONL line about 7 times its size to
parse. Every reader that turns a record into memory (image decoding, a JSON line, a Parquet row
group, an audio clip) estimates that cost from what it knows before reading (a header, a byte
range, a row group's metadata) and refuses a record over the budget as a counted reject
(`over_memory_budget`, naming the key), never an OOM that takes the worker or the run down.

The budget is per process that reads records side by side: data.worker_memory when set, else
half the machine's memory (its cgroup's limit when lower) shared by those processes
(data.workers, or an index build's --workers; the trainer's own process when there are none),
at least MIN_BUDGET.

The factors below are measured as the image decoding's estimate is (tests/test_memory_budget.py
holds each to bound its measurement): one record read through its reader in a process of its
own, the growth of the process's peak resident memory (/proc/self/status VmHWM, reset through
/proc/self/clear_refs just before the read; file pages mapped in count, as they do for an OOM
killer's RSS). Taken 2026-11-26 on a 2-core x86-64 CPU box, Python 3.11, numpy 2.4, pyarrow 26.

An audio clip's estimate (data/media/audio.py, `decode_bytes`) measured the same way on 300 s
clips: the peak follows the clip resampled to data.audio_sample_rate (16 kHz), about 59 bytes a
resampled sample (its float64 log-mel windows and their complex spectrum), whatever the source
rate: 120 bytes a source frame at 8 kHz, 59 at 16 kHz, 22 at 44.1 kHz stereo, 20 at 48 kHz. The
estimate is 64 bytes a resampled sample (it was 32 bytes a source frame: under at 16 kHz and
below, ~1.6x over at 48 kHz).
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxmllm.data.rejects import RecordError

MIN_BUDGET = 256 << 20  # the least an automatic budget is
# Bytes of memory a byte of a JSON line (a JSON list's element, a WebDataset json member)
# costs read and parsed (the bytes, their str, Python's objects). Measured on 30 MB lines: a long
# text 3.0x, floats 6.5x, small ints 7.0x, chat turns and token ids 9.4x (the commonest long
# lines; 8 before, under them); a list of empty lists 27x (hostile: bounded by
# data.max_media_bytes, as any line)
JSON_FACTOR = 10
# Bytes of memory a byte of a Parquet row group decompressed (its metadata's total_byte_size)
# costs read: the memory-mapped compressed pages, the decompressed ones, the arrays. Measured
# on 60 MB groups, snappy and zstd: token lists 3.3-3.5x, random text 4.0-4.5x, image bytes
# 4.9x (about 30 MB of it pyarrow's first read, whatever the size); 2 before, under them all
PARQUET_FACTOR = 5


def machine_memory() -> int:
    """This machine's memory in bytes, or its cgroup's limit when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def resolve(worker_memory: int, processes: int) -> int:
    """The budget in bytes: `worker_memory` when set (> 0), else half the machine's memory
    shared by `processes` reading side by side (at least MIN_BUDGET)."""
    if worker_memory > 0:
        return worker_memory
    return max(MIN_BUDGET, machine_memory() // 2 // max(1, processes))


def shown(n: float) -> str:
    """Bytes as a size: '1.5 GiB', '300 MiB'."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} bytes"


def over(cost: int, budget: int, what: str) -> str:
    """The reject's detail: `what` needs `cost` bytes, over the budget."""
    return (
        f"{what} needs about {shown(cost)} of memory > data.worker_memory={budget} "
        f"({shown(budget)} a process reading records; not read): raise data.worker_memory, "
        "or read with fewer processes side by side (data.workers, --workers)"
    )


def check(cost: int, budget: int, what: str, record_id: str) -> None:
    """Raises the `over_memory_budget` reject when `cost` bytes exceed `budget` (0: none)."""
    if budget and cost > budget:
        raise RecordError("over_memory_budget", over(cost, budget, what), record_id)
