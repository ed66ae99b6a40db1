"""WebDataset shards: .tar files whose members, grouped by key, are the samples; read at random.

    000123.jpg  000123.json        (the record: conversations, messages or text; its media)
    000124.png  000124.txt         (a caption)
    000125.0.jpg  000125.1.jpg  000125.wav  000125.json

As webdataset splits a member's name, the key is the path up to the first dot of the file name
and the rest its extension; consecutive members of one key are one sample. A `json` member is
the record (any of the schemas `jaxmllm.data.records.schemas` reads; its `id`, else the key),
a `txt` one a caption (a text record, media first, where the json has no text); members whose
last extension is one of a kind's `files` (`jaxmllm.config.phases.KINDS`: jpg, png, ... for
images, wav, flac, ... for clips, mp4, webm, ... for videos) are that kind's items, in the
order they are stored, in place of any the json names. Other members are left out and counted
(`ignored`), so the index can say so. A member over data.max_media_bytes is never read: the
sample is rejected (`media_too_large`; a json or caption that large: `malformed_line`).

Opening reads the tar headers only (member offsets and sizes: Python's `tarfile`), which the
index saves; record k is then a `seek` and a read per member, nothing extracted. Compressed
shards (.tar.gz) cannot be read at random and are refused.
"""

from __future__ import annotations

import json
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np

from jaxmllm.config import ConfigError, printable
from jaxmllm.config.phases import KINDS
from jaxmllm.data.rejects import MAX_MEDIA_BYTES

RECORD, CAPTION = ("json",), ("txt", "text", "caption")
KIND_OF_FILE = {ext: k for k in KINDS for ext in k.files}  # "jpg" -> images, "mp4" -> videos


def split_key(name: str) -> tuple[str, str]:
    """(key, extension) of a member name, as webdataset splits it: `a/b.0.jpg` -> (`a/b`,
    `0.jpg`)."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def role(ext: str) -> str | None:
    """What a member with this extension is: `record`, `caption`, a kind's name, or None."""
    last = ext.rpartition(".")[2]
    if last in RECORD:
        return "record"
    if last in CAPTION:
        return "caption"
    kind = KIND_OF_FILE.get(last)
    return kind.name if kind else None


class TarRecords:
    """Random access to the samples of one WebDataset shard (member offsets from its headers)."""

    def __init__(
        self,
        path: str | Path,
        scan: dict[str, np.ndarray] | None = None,
        max_bytes: int = MAX_MEDIA_BYTES,
    ):
        self.path = Path(path)
        self.max_bytes = max_bytes  # data.max_media_bytes: a larger member is not read
        scan = scan if scan is not None else scan_tar(self.path)
        self.ptr, self.offset, self.size = scan["ptr"], scan["offset"], scan["size"]
        self.keys, self.exts = scan["keys"], scan["exts"]
        self.ignored = dict(
            zip(scan["ignored"].tolist(), scan["ignored_count"].tolist(), strict=True)
        )
        self._file = None

    def scan(self) -> dict[str, np.ndarray]:
        names, counts = zip(*self.ignored.items(), strict=True) if self.ignored else ((), ())
        return {
            "ptr": self.ptr,
            "offset": self.offset,
            "size": self.size,
            "keys": self.keys,
            "exts": self.exts,
            "ignored": np.asarray(names, str),
            "ignored_count": np.asarray(counts, np.int64),
        }

    def __len__(self) -> int:
        return len(self.keys)

    def raw(self, k: int) -> tuple[object, int]:
        """(the sample as a record: its json's fields, its media members as {"bytes", "path"}
        entries, its caption as `text`; k)."""
        if self._file is None:
            self._file = open(self.path, "rb")  # noqa: SIM115  (one handle per process)
        key = str(self.keys[k])
        record: dict = {}
        caption = None
        media: dict[str, list] = {kind.name: [] for kind in KINDS}
        for m in range(int(self.ptr[k]), int(self.ptr[k + 1])):
            ext = str(self.exts[m])
            what = role(ext)
            if int(self.size[m]) > self.max_bytes:  # (its size from the header: nothing read)
                too_large = f"{key}.{ext}: {int(self.size[m])} bytes > data.max_media_bytes"
                if what in ("record", "caption"):
                    return {"__malformed__": f"{too_large}={self.max_bytes}"}, int(k)
                media[what].append(
                    {"missing": f"{key}.{ext}", "reason": "media_too_large", "detail": too_large}
                )
                continue
            self._file.seek(int(self.offset[m]))
            data = self._file.read(int(self.size[m]))
            if what == "record":
                record = _json(data, f"{key}.{ext}")
            elif what == "caption":
                caption = data.decode("utf-8", errors="replace")
            elif what is not None:
                media[what].append({"bytes": data, "path": f"{key}.{ext}"})
        if "__malformed__" in record:
            return record, int(k)
        record.setdefault("id", key.rpartition("/")[2])
        for kind in KINDS:
            if media[kind.name]:  # the members, in place of what the json names
                for alias in {kind.item, kind.items, f"{kind.item}s"}:
                    record.pop(alias, None)
                record[kind.items] = media[kind.name]
        if not any(f in record for f in ("text", "messages", "conversations")):
            text = caption if caption is not None else record.get("caption")
            if isinstance(text, str):
                record["text"] = text
        return record, int(k)

    def where(self, k: int) -> str:
        return f"{self.path.name} sample {self.keys[k]}"

    def fallback_id(self, k: int) -> str:
        return str(self.keys[k]).rpartition("/")[2]

    def __getstate__(self):
        return {**self.__dict__, "_file": None}


def _json(data: bytes, name: str) -> dict:
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        return {"__malformed__": f"{name} is not valid JSON: {e}"[:300]}
    return obj if isinstance(obj, dict) else {"__malformed__": f"{name} is not a JSON object"}


def scan_tar(path: Path) -> dict[str, np.ndarray]:
    """The members of a shard (their data's offset and size) grouped into samples by key."""
    try:
        tar = tarfile.open(path, "r:")  # (uncompressed only: members are read at random)
    except tarfile.ReadError as e:
        raise ConfigError(
            f"{path}: not an uncompressed tar file ({e}); WebDataset shards are read at random, "
            "which a compressed shard does not allow: decompress it (gunzip)"
        ) from None
    ptr, offset, size, keys, exts = [0], [], [], [], []
    ignored: Counter[str] = Counter()
    with tar:
        for member in tar:
            base = member.name.rpartition("/")[2]
            if not member.isfile() or base.startswith("."):
                continue
            key, ext = split_key(member.name)
            if role(ext) is None:
                ignored[printable(ext.rpartition(".")[2]) or "(none)"] += 1  # (reported)
                continue
            if not keys or keys[-1] != key:
                keys.append(key)
                ptr.append(ptr[-1])
            ptr[-1] += 1
            offset.append(member.offset_data)
            size.append(member.size)
            exts.append(ext)
    return {
        "ptr": np.asarray(ptr, np.int64),
        "offset": np.asarray(offset, np.int64),
        "size": np.asarray(size, np.int64),
        "keys": np.asarray(keys, str),
        "exts": np.asarray(exts, str),
        "ignored": np.asarray(list(ignored), str),
        "ignored_count": np.asarray(list(ignored.values()), np.int64),
    }
