"""WebDataset shards: .tar files whose members, grouped by key, are the samples; read at random.

    000123.jpg  000123.json        (the record: conversations, messages or text; its media)
    000124.png  000124.txt         (a caption)
    000125.0.jpg  000125.1.jpg  000125.wav  000125.json

As webdataset splits a member's name, the key is the path up to the first dot of the file name
and the rest its extension; consecutive members of one key are one sample, and a key that
comes back after other keys' members (a shard written by extension: `tar cf s.tar *.jpg *.txt`)
makes each of its runs a reject naming it, since neither is the whole sample. A `json` member
is the record (any of the schemas `jaxmllm.data.records.schemas` reads; its `id`, else its place:
the key, after the shard's path among several shards), a `txt` one a caption (a text record,
media first, where the json has no text); a sample with two of either (`k.json` and
`k.meta.json`) is refused, naming both, rather than one replacing the other; members whose
last extension is one of a kind's `files` (`jaxmllm.config.phases.KINDS`: jpg, png, ... for
images, wav, flac, ... for clips, mp4, webm, ... for videos) are that kind's items, in the
order they are stored, in place of any the json names. Other members are left out and counted
(`ignored`), so the index can say so. A member over data.max_media_bytes is never read: the
sample is rejected (`media_too_large`; a json or caption that large: `malformed_line`).

Opening reads the tar headers only (member offsets and sizes: Python's `tarfile`), which the
index saves; record k is then a `seek` and a read per member, nothing extracted (`handles`:
thousands of shards never hold more than a few dozen file handles). Compressed shards
(.tar.gz) cannot be read at random and are refused. Hostile headers are bounded: names are
held as their bytes (`columnar.Strings`), a pax or long-name header over MAX_HEADER_BYTES stops
the scan naming the shard, and a member claiming more bytes than the shard holds, or holding
none of its own (a link, a device, a sparse file), is its sample's reject. A shard cut short
inside a member's header, or ending in bytes that are no header (where tarfile stops without a
word), is one reject naming it and the byte where its whole members end.
"""

from __future__ import annotations

import json
import os
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np

from jaxmllm.config import ConfigError, printable
from jaxmllm.config.phases import KINDS
from jaxmllm.data import budget
from jaxmllm.data.columnar import Strings
from jaxmllm.data.records.handles import pread
from jaxmllm.data.rejects import MAX_MEDIA_BYTES

RECORD, CAPTION = ("json",), ("txt", "text", "caption")
# Bytes of a pax or GNU long-name header (a member's long name, its extended attributes):
# tarfile reads one whole before the member it describes; a longer one stops the scan, naming
# the shard (real shards' names are file names: a few hundred bytes).
MAX_HEADER_BYTES = 1 << 16
LONG_HEADERS = (
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
)
KIND_OF_FILE = {ext: k for k in KINDS for ext in k.files}  # "jpg" -> images, "mp4" -> videos
# A member that holds no bytes of its own where it lies (a link, a device, a sparse file) is
# scanned with this size; reading it rejects its sample, naming it (else the sample would
# train without the item, or a sparse file would read the members after it).
NOT_A_FILE = -1


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
        max_memory: int = 0,
    ):
        self.path = Path(path)
        self.max_bytes = max_bytes  # data.max_media_bytes: a larger member is not read
        self.max_memory = max_memory  # data.worker_memory: a json member parses to ~8x
        self.ignored: dict[str, int] = {}  # members left out, by extension (when scanned)
        if scan is None:
            scan, self.ignored = scan_tar(self.path)
        self.ptr, self.offset, self.size = scan["ptr"], scan["offset"], scan["size"]
        self.keys, self.exts = scan["keys"], scan["exts"]  # `Strings`: names of any length
        self.end = int(scan["end"][0]) if "end" in scan else None  # the shard's bytes, scanned
        # samples whose key comes back later in the shard (each of its runs is one); where the
        # shard is cut ([] when it ends whole)
        self.split = set(np.asarray(scan.get("split", ()), np.int64).tolist())
        self.cut = np.asarray(scan.get("cut", ()), np.int64)

    def scan(self) -> dict:
        keys = ("ptr", "offset", "size", "keys", "exts", "cut")
        out = {k: getattr(self, k) for k in keys}
        out["split"] = np.asarray(sorted(self.split), np.int64)
        return out if self.end is None else {**out, "end": np.asarray([self.end], np.int64)}

    def __len__(self) -> int:
        return len(self.keys)

    def raw(self, k: int) -> tuple[object, int]:
        """(the sample as a record: its json's fields, its media members as {"bytes", "path"}
        entries, its caption as `text`; k)."""
        key = str(self.keys[k])
        if self.ptr[k] == self.ptr[k + 1]:  # (the shard's cut end: `scan_tar`)
            return {"__malformed__": self._cut_detail()}, int(k)
        if k in self.split:
            return {"__malformed__": _split_detail(key)}, int(k)
        record: dict = {}
        caption = None
        media: dict[str, list] = {kind.name: [] for kind in KINDS}
        names: set[str] = set()  # (one member named twice: which one is the sample's?)
        held: dict[str, str] = {}  # the member that is the record, the caption
        for m in range(int(self.ptr[k]), int(self.ptr[k + 1])):
            ext = self.exts[m]
            what = role(ext)
            if ext in names:
                twice = f"{key}.{ext}: two members of this name (extensions compared without "
                twice += "case) one after the other; keep one (the second would silently "
                twice += "replace the first)"
                return {"__malformed__": twice}, int(k)
            names.add(ext)
            if what in ("record", "caption") and held.setdefault(what, ext) != ext:
                return {"__malformed__": _two_of(key, what, held[what], ext)}, int(k)
            if int(self.size[m]) == NOT_A_FILE:
                kind = "malformed_line" if what in ("record", "caption") else "missing_media"
                detail = (
                    f"{key}.{ext} is a link, a device or a sparse file, not a member holding its "
                    "bytes; write the shard again with the files themselves (GNU tar: "
                    "--hard-dereference --dereference, without --sparse)"
                )
                if kind == "malformed_line":
                    return {"__malformed__": detail}, int(k)
                media[what].append({"missing": f"{key}.{ext}", "reason": kind, "detail": detail})
                continue
            if self.end is not None and int(self.offset[m]) + int(self.size[m]) > self.end:
                claim = f"{key}.{ext}: its header claims {int(self.size[m])} bytes, past the "
                claim += f"end of the shard ({self.end} bytes): a truncated or corrupt shard"
                return {"__malformed__": claim}, int(k)
            if int(self.size[m]) > self.max_bytes:  # (its size from the header: nothing read)
                too_large = f"{key}.{ext}: {int(self.size[m])} bytes > data.max_media_bytes"
                if what in ("record", "caption"):
                    return {"__malformed__": f"{too_large}={self.max_bytes}"}, int(k)
                media[what].append(
                    {"missing": f"{key}.{ext}", "reason": "media_too_large", "detail": too_large}
                )
                continue
            cost = budget.JSON_FACTOR * int(self.size[m])
            if what == "record" and self.max_memory and cost > self.max_memory:
                detail = budget.over(cost, self.max_memory, f"parsing {key}.{ext}")
                return {"__malformed__": detail, "__reason__": "over_memory_budget"}, int(k)
            data = pread(self.path, int(self.offset[m]), int(self.size[m]))
            if what == "record":
                record = _json(data, f"{key}.{ext}")
            elif what == "caption":
                caption = data.decode("utf-8", errors="replace")
            elif what is not None:
                media[what].append({"bytes": data, "path": f"{key}.{ext}"})
        if "__malformed__" in record:
            return record, int(k)
        for kind in KINDS:  # (its id: the json's, else its place: `Records.fallback_id`)
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
        return self.keys[k].rpartition("/")[2]

    def _cut_detail(self) -> str:
        at = int(self.cut[0]) if len(self.cut) else -1
        size = self.end if self.end is not None else os.path.getsize(self.path)
        return (
            f"the shard ends at byte {size} inside what follows its last whole member (from "
            f"byte {at}: a member header cut short, or bytes that are no tar header): the "
            "members from there on are lost (a copy or download cut short); write the shard "
            "again, or leave it out of data.path"
        )

    def close(self) -> None:
        """Nothing to close: members are read through the process's bounded table of open
        files (`handles`)."""


class HeaderTooLarge(Exception):
    """A pax or GNU long-name header over MAX_HEADER_BYTES (raised before it is read)."""


class BoundedTarInfo(tarfile.TarInfo):
    """tarfile's member header, refusing a pax or long-name header over MAX_HEADER_BYTES
    before reading it (tarfile reads such a header whole, whatever size it claims)."""

    def _proc_member(self, tarfile_):
        if self.type in LONG_HEADERS and self.size > MAX_HEADER_BYTES:
            raise HeaderTooLarge(f"{self.size} bytes at byte {self.offset}")
        return super()._proc_member(tarfile_)


def _json(data: bytes, name: str) -> dict:
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        return {"__malformed__": f"{name} is not valid JSON: {e}"[:300]}
    return obj if isinstance(obj, dict) else {"__malformed__": f"{name} is not a JSON object"}


def scan_tar(path: Path) -> tuple[dict, dict[str, int]]:
    """(The members of a shard (their data's offset and size) grouped into samples by key,
    the names as `Strings`; the members left out, by extension).

    A pax or long-name header over MAX_HEADER_BYTES, or a header tarfile cannot read, stops
    with the shard and the place; a member whose claimed size runs past the end of the file
    ends the scan (its sample is then rejected when read: nothing after it is a member)."""
    end = os.path.getsize(path)
    try:
        tar = tarfile.open(path, "r:", tarinfo=BoundedTarInfo)  # (uncompressed only: random reads)
    except tarfile.ReadError as e:
        raise ConfigError(
            f"{path}: not an uncompressed tar file ({e}); WebDataset shards are read at random, "
            "which a compressed shard does not allow: decompress it (gunzip)"
        ) from None
    except HeaderTooLarge as e:
        raise ConfigError(_too_large(path, e)) from None
    ptr, offset, size, keys, exts = [0], [], [], [], []
    first: dict[str, int] = {}  # each key's first sample (a key that comes back: `split`)
    split: set[int] = set()
    ignored: Counter[str] = Counter()
    overrun = False
    with tar:
        while True:
            try:
                member = tar.next()
            except HeaderTooLarge as e:
                raise ConfigError(_too_large(path, e)) from None
            except tarfile.TarError as e:
                raise ConfigError(
                    f"{path}: unreadable tar header after byte {tar.offset} ({e}); the shard is "
                    "corrupt or truncated: write it again (or leave it out of data.path)"
                ) from None
            if member is None:
                break
            tar.members.clear()  # (tarfile keeps every header read; the arrays below suffice)
            base = member.name.rpartition("/")[2]
            if member.isdir() or base.startswith("."):
                continue
            key, ext = split_key(member.name)
            if role(ext) is None:
                ignored[printable(ext.rpartition(".")[2]) or "(none)"] += 1  # (reported)
                continue
            if not keys or keys[-1] != key:
                if key in first:  # (its members apart: neither run is the whole sample)
                    split.update((first[key], len(keys)))
                first.setdefault(key, len(keys))
                keys.append(key)
                ptr.append(ptr[-1])
            ptr[-1] += 1
            held = member.isfile() and not member.issparse()
            offset.append(member.offset_data)
            size.append(member.size if held else NOT_A_FILE)
            exts.append(ext)
            if held and member.offset_data + member.size > end:
                overrun = True
                break  # (the rest of the file is inside it; reading it rejects its sample)
        cut = [] if overrun or _ends_whole(path, tar.offset, end) else [tar.offset]
    if cut:  # (a sample of no members: its reject names the shard and the place)
        keys.append(f"(cut at byte {cut[0]})")
        ptr.append(ptr[-1])
    found = {
        "ptr": np.asarray(ptr, np.int64),
        "offset": np.asarray(offset, np.int64),
        "size": np.asarray(size, np.int64),
        "keys": Strings.of(keys),
        "exts": Strings.of(exts),
        "end": np.asarray([end], np.int64),
        "split": np.asarray(sorted(split), np.int64),
        "cut": np.asarray(cut, np.int64),
    }
    return found, dict(ignored)


def _ends_whole(path: Path, at: int, end: int) -> bool:
    """Whether the shard's bytes after its last member (from `at`) are the end-of-archive
    zero blocks (or nothing): whole 512-byte blocks of zeros. A header cut short (a copy cut
    200 bytes into it) or bytes that are no header end tarfile's reading without a word."""
    if (end - at) % 512:
        return False
    with open(path, "rb") as f:
        f.seek(at)
        while chunk := f.read(1 << 20):
            if chunk.count(0) != len(chunk):
                return False
    return True


def _split_detail(key: str) -> str:
    return (
        f"{key}: its members are not one after another in the shard (the key comes back "
        "after other keys' members: a shard written by extension, `tar cf s.tar *.jpg "
        "*.txt`). WebDataset makes a sample of a key's consecutive members, so neither run "
        "is the whole sample; write the shard with each sample's members together (`tar "
        "--sort=name`, or webdataset's ShardWriter)"
    )


def _two_of(key: str, what: str, first: str, second: str) -> str:
    kind = "JSON members (the record)" if what == "record" else "captions"
    return (
        f"{key}: two {kind}, {key}.{first} and {key}.{second}: which one is the sample's "
        f"cannot be told, and one would replace the other; keep one (name other metadata "
        f"with an extension jaxmllm leaves out, e.g. {key}.meta)"
    )


def _too_large(path: Path, e: HeaderTooLarge) -> str:
    return (
        f"{path}: a pax or GNU long-name tar header of {e} (a member's name or attributes) is "
        f"over {MAX_HEADER_BYTES} bytes, the most a WebDataset member name may take; rename "
        "the members (a key is a file name) and write the shard again"
    )
