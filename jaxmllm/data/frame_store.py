"""The frame cache's files: videos' sampled, resized frames stored once, read back by offset.

A cache folder (`<index folder>/frames/`, so it lives under the same preprocessing key as the
lengths index: a change of sampling or resolution is another folder) holds

- `frames-NNNNN.bin` shards: raw uint8 temporal patches, video after video, laid out as the
  vision tower takes them (`video.patches_of`: each patch's frames side by side), so a read is
  a copy (lossless: the pixels decoding gives, so a batch from the cache is bit-identical);
- `frames-NNNNN.json` beside each: the shard's entries and rejects, written after the shard
  (a shard without one, or whose size or checksums disagree with it, is built again);
- `frames.json`: the merged manifest the loader reads: every entry (record id, video number,
  shard, byte offset, frames, height, width, the source's byte size, one XXH3 checksum per temporal
  patch), the shards' byte sizes, the rejects by reason.

Reading checks a shard's size when it is first opened (a truncated or grown shard is refused
whole) and each temporal patch's XXH3 checksum as it is read (a changed byte is refused), so damaged
bytes are never handed out as pixels: the video is decoded instead, counted by reason.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

log = logging.getLogger("jaxmllm")

MANIFEST = "frames.json"
VERSION = 1
# Why a video was not read from the cache (the loader's frames/ metrics count each):
MISSES = {
    "absent": "the cache has no entry for it (built before the record, or rejected there)",
    "other_size": "its entry was sampled to another frame count or size (other limits)",
    "stale": "its file's byte size changed since the cache was built",
    "damaged": "its shard is truncated or changed (size or XXH3 checksum check failed)",
}


def shard_name(k: int) -> str:
    """Frame cache shard k's file name, without its extension."""
    return f"frames-{k:05d}"


def checksum(data) -> int:
    """XXH3-64 of a buffer (bytes, a contiguous array)."""
    return xxhash.xxh3_64_intdigest(data)


def source_size(src) -> int:
    """The byte size of a video's source (a file, or inline bytes): an entry is stale when it
    changed."""
    return len(src) if isinstance(src, bytes) else os.path.getsize(src)


@dataclass(frozen=True)
class Entry:
    shard: str
    offset: int  # bytes into the shard
    shape: tuple[int, int, int]  # (frames, height, width); 3 channels
    source_bytes: int
    sums: tuple[int, ...]  # one per temporal patch

    def patch_bytes(self) -> int:
        """Bytes of one temporal patch's pixels in the shard (uint8 RGB)."""
        n, h, w = self.shape
        return n // len(self.sums) * h * w * 3


class ShardWriter:
    """Appends videos' frames to one shard (written as `.tmp`, renamed when closed)."""

    def __init__(self, folder: Path, k: int):
        """Shard k of `folder`, written under a temporary name until `close`."""
        self.path = folder / f"{shard_name(k)}.bin"
        self.tmp = self.path.with_suffix(".bin.tmp")
        self.file = open(self.tmp, "wb")
        self.offset = 0

    def add(self, blocks: list[np.ndarray]) -> tuple[int, list[int]]:
        """Writes a video's temporal patches (uint8, `video.patches_of`); returns (its offset,
        the XXH3 checksum of each temporal patch)."""
        at, sums = self.offset, []
        for block in blocks:
            data = np.ascontiguousarray(block, np.uint8)
            sums.append(checksum(data))
            self.file.write(memoryview(data).cast("B"))
            self.offset += data.nbytes
        return at, sums

    def close(self) -> int:
        """Flushes the shard to disk and gives it its name (a crash leaves only the temporary);
        returns its size in bytes."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        return self.offset


def verify_shard(folder: Path, side: dict) -> bool:
    """Whether a built shard still holds what its side file says: its size, every XXH3 checksum."""
    path = folder / f"{side['name']}.bin"
    if not path.is_file() or path.stat().st_size != side["bytes"]:
        return False
    with open(path, "rb") as f:
        for e in side["entries"]:
            entry = as_entry(e)
            f.seek(entry.offset)
            for want in entry.sums:
                if checksum(f.read(entry.patch_bytes())) != want:
                    return False
    return True


def as_entry(e: list) -> Entry:
    """An entry of a side file or the manifest: [record id, video, shard, offset, frames,
    height, width, source bytes, [sum, ...]]."""
    return Entry(e[2], int(e[3]), (int(e[4]), int(e[5]), int(e[6])), int(e[7]), tuple(e[8]))


class FrameCache:
    """The loader's reader of a built cache (`frames.json`): `groups` hands out a video's
    temporal patches' frames, or None with the reason it did not (`MISSES`)."""

    def __init__(self, folder: str | Path):
        """The cache in `folder`, from its manifest: its shards' sizes, an entry per video (record,
        item) and the parameters its frames were sampled with. Shards open when first read."""
        self.folder = Path(folder)
        manifest = json.loads((self.folder / MANIFEST).read_text())
        self.shard_bytes = {s["name"]: int(s["bytes"]) for s in manifest["shards"]}
        self.entries = {(e[0], int(e[1])): as_entry(e) for e in manifest["entries"]}
        self.params = manifest.get("params", {})
        self._files: dict[str, int | None] = {}  # shard -> fd (None: refused)

    def __getstate__(self):  # (sent to worker processes: they open the shards themselves)
        return {**self.__dict__, "_files": {}}

    def __len__(self) -> int:
        """The videos the cache holds."""
        return len(self.entries)

    def groups(
        self, record_id: str, j: int, src, want: list[int], shape: tuple, rule
    ) -> tuple[list[np.ndarray] | None, str]:
        """(the pixels of each temporal patch in `want`, as `video.patches_of` makes them,
        "hit"), or (None, why not) for video j of `record_id` sampled to `shape` = (frames, H, W)
        by the video rule `rule`."""
        entry = self.entries.get((record_id, j))
        if entry is None:
            return None, "absent"
        t, p = rule.temporal_patch, rule.patch
        if entry.shape != tuple(shape) or len(entry.sums) * t != shape[0]:
            return None, "other_size"
        try:
            if source_size(src) != entry.source_bytes:
                return None, "stale"
        except OSError:
            return None, "stale"  # (the decoder names the missing file)
        fd = self._open(entry.shard)
        if fd is None:
            return None, "damaged"
        _, h, w = entry.shape
        size = entry.patch_bytes()
        out = []
        for k in want:
            data = os.pread(fd, size, entry.offset + k * size)
            if len(data) != size or checksum(data) != entry.sums[k]:
                log.warning(
                    "frame cache %s: %s (video %d of %s) fails its checksum: decoding it instead; "
                    "rebuild the cache",
                    self.folder,
                    entry.shard,
                    j,
                    record_id,
                )
                return None, "damaged"
            out.append(np.frombuffer(data, np.uint8).reshape(h // p * (w // p), t * p * p * 3))
        return out, "hit"

    def _open(self, shard: str) -> int | None:
        """Shard `shard`'s file descriptor, opened once; None (remembered) where the file is missing
        or not the size the manifest says."""
        if shard in self._files:
            return self._files[shard]
        path = self.folder / f"{shard}.bin"
        fd = None
        try:
            fd = os.open(path, os.O_RDONLY)
            if os.fstat(fd).st_size != self.shard_bytes.get(shard, -1):
                os.close(fd)
                fd = None
                log.warning(
                    "frame cache %s: %s is not the size it was built at (truncated or "
                    "changed): its videos are decoded instead; rebuild the cache",
                    self.folder,
                    path.name,
                )
        except OSError as e:
            log.warning(
                "frame cache %s: %s cannot be opened (%s): its videos are decoded",
                self.folder,
                path.name,
                e,
            )
        self._files[shard] = fd
        return fd


def merge(folder: Path, sides: list[dict], params: dict) -> dict:
    """Writes the manifest from the shards' side files (atomically); returns it."""
    rejects = Counter(r["reason"] for s in sides for r in s["rejects"])
    examples = {}
    for s in sides:
        for r in s["rejects"]:
            examples.setdefault(r["reason"], r)
    manifest = {
        "version": VERSION,
        "params": params,
        "shards": [{"name": s["name"], "bytes": s["bytes"]} for s in sides],
        "entries": [e for s in sides for e in s["entries"]],
        "videos": sum(len(s["entries"]) for s in sides),
        "frames": sum(int(e[4]) for s in sides for e in s["entries"]),
        "bytes": sum(s["bytes"] for s in sides),
        "rejects": dict(rejects),
        "examples": examples,
    }
    tmp = folder / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, folder / MANIFEST)
    return manifest
