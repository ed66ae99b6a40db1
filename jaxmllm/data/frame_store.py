"""The frame cache's files: videos' sampled, resized frames stored once, read back by offset.

A cache folder (`<index folder>/frames/`, so it lives under the same preprocessing key as the
lengths index: a change of sampling or resolution is another folder) holds

- `frames-NNNNN.bin` shards: raw uint8 frames [frames, height, width, 3], video after video
  (lossless: the pixels decoding gives, so a batch from the cache is bit-identical);
- `frames-NNNNN.json` beside each: the shard's entries and rejects, written after the shard
  (a shard without one, or whose size or checksums disagree with it, is built again);
- `frames.json`: the merged manifest the loader reads: every entry (record id, video number,
  shard, byte offset, frames, height, width, the source's byte size, one CRC-32 per temporal
  patch), the shards' byte sizes, the rejects by reason.

Reading checks a shard's size when it is first opened (a truncated or grown shard is refused
whole) and each temporal patch's CRC-32 as it is read (a changed byte is refused), so damaged
bytes are never handed out as pixels: the video is decoded instead, counted by reason.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("jaxmllm")

MANIFEST = "frames.json"
VERSION = 1
# Why a video was not read from the cache (the loader's frames/ metrics count each):
MISSES = {
    "absent": "the cache has no entry for it (built before the record, or rejected there)",
    "other_size": "its entry was sampled to another frame count or size (other limits)",
    "stale": "its file's byte size changed since the cache was built",
    "damaged": "its shard is truncated or changed (size or CRC-32 check failed)",
}


def shard_name(k: int) -> str:
    return f"frames-{k:05d}"


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
    crcs: tuple[int, ...]  # one per temporal patch

    def patch_bytes(self) -> int:
        n, h, w = self.shape
        return n // len(self.crcs) * h * w * 3


class ShardWriter:
    """Appends videos' frames to one shard (written as `.tmp`, renamed when closed)."""

    def __init__(self, folder: Path, k: int):
        self.path = folder / f"{shard_name(k)}.bin"
        self.tmp = self.path.with_suffix(".bin.tmp")
        self.file = open(self.tmp, "wb")
        self.offset = 0

    def add(self, frames: np.ndarray, temporal_patch: int) -> tuple[int, list[int]]:
        """Writes frames [n, H, W, 3] uint8; returns (offset, CRC-32 per temporal patch)."""
        data = np.ascontiguousarray(frames, np.uint8)
        per = len(data) // temporal_patch
        crcs = [zlib.crc32(data[k * temporal_patch : (k + 1) * temporal_patch]) for k in range(per)]
        at = self.offset
        self.file.write(memoryview(data).cast("B"))
        self.offset += data.nbytes
        return at, crcs

    def close(self) -> int:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        return self.offset


def verify_shard(folder: Path, side: dict) -> bool:
    """Whether a built shard still holds what its side file says: its size, every CRC-32."""
    path = folder / f"{side['name']}.bin"
    if not path.is_file() or path.stat().st_size != side["bytes"]:
        return False
    with open(path, "rb") as f:
        for e in side["entries"]:
            entry = as_entry(e)
            f.seek(entry.offset)
            for crc in entry.crcs:
                if zlib.crc32(f.read(entry.patch_bytes())) != crc:
                    return False
    return True


def as_entry(e: list) -> Entry:
    """An entry of a side file or the manifest: [record id, video, shard, offset, frames,
    height, width, source bytes, [crc, ...]]."""
    return Entry(e[2], int(e[3]), (int(e[4]), int(e[5]), int(e[6])), int(e[7]), tuple(e[8]))


class FrameCache:
    """The loader's reader of a built cache (`frames.json`): `groups` hands out a video's
    temporal patches' frames, or None with the reason it did not (`MISSES`)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        manifest = json.loads((self.folder / MANIFEST).read_text())
        self.shard_bytes = {s["name"]: int(s["bytes"]) for s in manifest["shards"]}
        self.entries = {(e[0], int(e[1])): as_entry(e) for e in manifest["entries"]}
        self.params = manifest.get("params", {})
        self._files: dict[str, int | None] = {}  # shard -> fd (None: refused)

    def __getstate__(self):  # (sent to worker processes: they open the shards themselves)
        return {**self.__dict__, "_files": {}}

    def __len__(self) -> int:
        return len(self.entries)

    def groups(
        self, record_id: str, j: int, src, want: list[int], shape: tuple, temporal_patch: int
    ) -> tuple[list[np.ndarray] | None, str]:
        """(frames [temporal_patch, H, W, 3] uint8 of each temporal patch in `want`, "hit"),
        or (None, why not) for video j of `record_id` sampled to `shape` = (frames, H, W)."""
        entry = self.entries.get((record_id, j))
        if entry is None:
            return None, "absent"
        if entry.shape != tuple(shape) or len(entry.crcs) * temporal_patch != shape[0]:
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
            if len(data) != size or zlib.crc32(data) != entry.crcs[k]:
                log.warning("frame cache %s: %s (video %d of %s) fails its CRC-32 check: decoding "
                            "it instead; rebuild the cache", self.folder, entry.shard, j,
                            record_id)  # fmt: skip
                return None, "damaged"
            out.append(np.frombuffer(data, np.uint8).reshape(temporal_patch, h, w, 3))
        return out, "hit"

    def _open(self, shard: str) -> int | None:
        if shard in self._files:
            return self._files[shard]
        path = self.folder / f"{shard}.bin"
        fd = None
        try:
            fd = os.open(path, os.O_RDONLY)
            if os.fstat(fd).st_size != self.shard_bytes.get(shard, -1):
                os.close(fd)
                fd = None
                log.warning("frame cache %s: %s is not the size it was built at (truncated or "
                            "changed): its videos are decoded instead; rebuild the cache",
                            self.folder, path.name)  # fmt: skip
        except OSError as e:
            log.warning("frame cache %s: %s cannot be opened (%s): its videos are decoded",
                        self.folder, path.name, e)  # fmt: skip
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
