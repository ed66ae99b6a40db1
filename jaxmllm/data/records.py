"""Records: the raw records of a data file (JSONL manifest or ArrayRecord) and their parsing.

A JSONL manifest holds one record a line:

    {"id": "cap-1", "text": "<image> a cat on a mat", "images": ["img/cat.jpg"]}
    {"id": "chat-7", "messages": [{"role": "user", "content": "<audio> what is this?"},
                                  {"role": "assistant", "content": "a dog barking"}],
     "audio": ["data:audio/wav;base64,UklGR..."]}

Media paths are relative to the manifest; `data:...;base64,` URIs or {"base64": ...} are inline.
Record k is the k-th non-blank line. An ArrayRecord file (`python -m jaxmllm.data.arrayrecord`)
has the same records in the same order, each one `MAGIC | u32 header length | JSON header |
media blobs`: the header is the manifest object with each media entry replaced by
{"blob": [offset, length], "name": ...}. Lines that are not JSON and missing files are kept as
markers, so the index rejects them for the same reason as the JSONL path.

Both readers give `raw(k) -> (object, line)`; `read_record` parses that into a `Record` (or
raises RecordError), which is all the layers above see of the file format.
"""

from __future__ import annotations

import base64
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxmllm.data.rejects import RecordError, check_media_file

PLACEHOLDER = re.compile(r"(<image>|<audio>)")
ROLES = ("system", "user", "assistant")

# ----------------------------------------------------------------------------- JSONL


class JsonlRecords:
    """Random access to the lines of a JSONL manifest (byte offsets found in one scan)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.base_dir = self.path.parent
        offsets, lines = [], []
        with open(self.path, "rb") as f:
            pos = 0
            for n, raw in enumerate(f, start=1):
                if raw.strip():
                    offsets.append(pos)
                    lines.append(n)
                pos += len(raw)
        self.offsets = np.asarray(offsets, np.int64)
        self.lines = np.asarray(lines, np.int64)
        self._file = None

    def __len__(self) -> int:
        return len(self.offsets)

    def raw(self, k: int) -> tuple[object, int]:
        """(parsed JSON or a malformed marker, 1-based line number) of record k."""
        if self._file is None:
            self._file = open(self.path, "rb")  # noqa: SIM115  (one handle per process)
        self._file.seek(int(self.offsets[k]))
        text = self._file.readline()
        return parse_line(text), int(self.lines[k])

    def __getstate__(self):
        return {**self.__dict__, "_file": None}


def parse_line(text: bytes) -> object:
    """The JSON value of one manifest line, or a malformed marker the parser rejects."""
    try:
        return json.loads(text)
    # ValueError: JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits;
    # RecursionError: arrays or objects nested about a thousand deep.
    except (ValueError, RecursionError) as e:
        return {"__malformed__": f"not valid JSON: {type(e).__name__}: {e}"[:300]}


# ----------------------------------------------------------------------------- ArrayRecord

MAGIC = b"JMLR1"


def encode_record(obj: object, base_dir: Path, line: int) -> bytes:
    """One manifest object (media files read and embedded) as ArrayRecord bytes."""
    blobs: list[bytes] = []
    offset = 0

    def embed(entry):
        nonlocal offset
        if not isinstance(entry, str) or entry.startswith("data:"):
            return entry  # inline data and odd entries stay as they are
        path = base_dir / entry
        try:  # only regular files: reading a FIFO or a device would block or never end
            check_media_file(path)
            data = path.read_bytes()
        except (RecordError, OSError):  # the index reads the path again and names the reason
            return {"missing": str(path.absolute())}
        blobs.append(data)
        offset += len(data)
        return {"blob": [offset - len(data), len(data)], "name": entry}

    if isinstance(obj, dict) and "__malformed__" not in obj:
        obj = dict(obj)
        for key in ("images", "audio"):
            if isinstance(obj.get(key), list):
                obj[key] = [embed(e) for e in obj[key]]
    header = json.dumps({"record": obj, "line": line}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + b"".join(blobs)


def decode_record(data: bytes) -> tuple[object, int]:
    """(manifest object with media as {"bytes": ...}, line) of one ArrayRecord record; a marker
    the parser rejects as malformed_line when the bytes are not such a record (a corrupt file)."""
    if not data.startswith(MAGIC):
        return {"__malformed__": "not a jaxmllm ArrayRecord record"}, 0
    try:
        return _decode(data)
    except (struct.error, ValueError, ArithmeticError, RecursionError, LookupError, TypeError) as e:
        return {"__malformed__": f"corrupt ArrayRecord record: {type(e).__name__}: {e}"[:300]}, 0


def _decode(data: bytes) -> tuple[object, int]:
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    head = json.loads(data[start : start + n])
    body = memoryview(data)[start + n :]
    obj = head["record"]
    if isinstance(obj, dict):
        for key in ("images", "audio"):
            if isinstance(obj.get(key), list):
                obj[key] = [
                    {"bytes": bytes(body[e["blob"][0] : e["blob"][0] + e["blob"][1]])}
                    if isinstance(e, dict) and "blob" in e
                    else e
                    for e in obj[key]
                ]
    return obj, int(head["line"])


class ArrayRecordRecords:
    """Random access to the records of an .array_record file, through grain's data source."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.base_dir = self.path.parent
        self._source = None
        self._len = len(self._open())

    def _open(self):
        if self._source is None:
            from grain.sources import ArrayRecordDataSource

            self._source = ArrayRecordDataSource(str(self.path))
        return self._source

    def __len__(self) -> int:
        return self._len

    def raw(self, k: int) -> tuple[object, int]:
        return decode_record(self._open()[int(k)])

    def __getstate__(self):
        return {**self.__dict__, "_source": None}


# ----------------------------------------------------------------------------- opening


def open_records(path: str | Path):
    """The raw records of a JSONL manifest or an .array_record file (by suffix)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such data file: {path}")
    if path.suffix == ".array_record":
        return ArrayRecordRecords(path)
    return JsonlRecords(path)


def read_record(records, k: int) -> Record:
    """Parses record k (raises RecordError for a bad one)."""
    obj, line = records.raw(k)
    return parse_record(obj, records.base_dir, line)


# ----------------------------------------------------------------------------- parsing


@dataclass
class Record:
    """A parsed manifest record: turns of (role, text) and its media sources."""

    id: str
    turns: list[tuple[str, str]]  # role "text" for plain text records
    images: list[Any]  # Path | bytes (inline / embedded)
    audio: list[Any]


def parse_record(obj: Any, base_dir: Path, line: int) -> Record:
    """Checks one manifest object and resolves its media; raises RecordError."""
    fallback = f"line:{line}"
    if not isinstance(obj, dict):
        raise RecordError("malformed_line", "not a JSON object", fallback)
    if "__malformed__" in obj:  # a line the ArrayRecord converter could not parse
        raise RecordError("malformed_line", obj["__malformed__"], fallback)
    rid = obj.get("id")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool) or rid == "":
        raise RecordError("malformed_line", "missing or invalid 'id'", fallback)
    rid = str(rid)
    if not _valid_unicode(rid):
        raise RecordError(
            "malformed_line", "'id' is not valid Unicode (a lone surrogate)", fallback
        )
    if ("text" in obj) == ("messages" in obj):
        raise RecordError("malformed_line", "needs exactly one of 'text' or 'messages'", rid)
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise RecordError("malformed_line", "'text' must be a string", rid)
        turns = [("text", obj["text"])]
    else:
        turns = _parse_messages(obj["messages"], rid)
    if not all(_valid_unicode(t) for _, t in turns):  # JSON's "\ud800" escapes decode to these
        raise RecordError("malformed_line", "text is not valid Unicode (a lone surrogate)", rid)
    media = {}
    for key in ("images", "audio"):
        entries = obj.get(key, [])
        if not isinstance(entries, list):
            raise RecordError("malformed_line", f"'{key}' must be a list", rid)
        media[key] = [_media_source(e, base_dir, rid) for e in entries]
    record = Record(rid, turns, media["images"], media["audio"])
    _check_placeholders(record)
    return record


def _parse_messages(messages: Any, rid: str) -> list[tuple[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise RecordError("malformed_line", "'messages' must be a non-empty list", rid)
    turns = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RecordError("malformed_line", f"each message needs a role in {ROLES}", rid)
        content = m.get("content", "")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, {"type": "image"}]
            content = "".join(_content_part(p, rid) for p in content)
        if not isinstance(content, str):
            raise RecordError("malformed_line", "message content must be a string or parts", rid)
        turns.append((m["role"], content))
    return turns


def _content_part(part: Any, rid: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if kind in ("image", "audio"):
        return f"<{kind}>"
    raise RecordError("malformed_line", f"unknown content part {part!r:.60}", rid)


def _media_source(entry: Any, base_dir: Path, rid: str) -> Any:
    try:
        if isinstance(entry, str) and entry.startswith("data:"):
            return base64.b64decode(entry.partition(",")[2], validate=True)
        if isinstance(entry, str) and entry and _valid_unicode(entry):
            return base_dir / entry
        if isinstance(entry, dict) and "base64" in entry:
            return base64.b64decode(entry["base64"], validate=True)
        if isinstance(entry, dict) and isinstance(entry.get("bytes"), bytes):
            return entry["bytes"]
        if isinstance(entry, dict) and "missing" in entry:
            return Path(entry["missing"])
    except (ValueError, TypeError) as e:
        raise RecordError("undecodable_media", f"bad base64: {e}", rid) from None
    raise RecordError("malformed_line", f"media entry {entry!r:.60} is not a path or base64", rid)


def _valid_unicode(text: str) -> bool:
    """False for a string the tokenizer cannot encode (lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_placeholders(r: Record) -> None:
    text = "".join(t for _, t in r.turns)
    for key, media in (("image", r.images), ("audio", r.audio)):
        n = text.count(f"<{key}>")
        if n != len(media):
            raise RecordError(
                "placeholder_mismatch",
                f"{n} <{key}> placeholder(s), {len(media)} {key} item(s)",
                r.id,
            )
    words = PLACEHOLDER.sub("", text).strip()
    if not words and not r.images and not r.audio:
        raise RecordError("empty_sample", "no text and no media", r.id)
    roles = [role for role, _ in r.turns]
    if "text" not in roles and not any(
        role == "assistant" and PLACEHOLDER.sub("", t).strip() for role, t in r.turns
    ):
        raise RecordError("empty_sample", "no assistant turn with text (nothing to learn)", r.id)
