"""A parsed record: its turns of (role, text) and its media sources, checked.

A record is `{"id", "text"}` (plain text) or `{"id", "messages": [{"role", "content"}]}` (a
chat), with a list of items per encoder phase under its `items` key (`images`, `audio`: paths
relative to the data file, `data:...;base64,` URIs or {"base64": ...}); the text places each
item with its phase's placeholder (`<image>`, `<audio>`).
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxmllm.config.phases import ENCODERS
from jaxmllm.data.rejects import RecordError

PHASE_OF_PLACEHOLDER = {p.placeholder: p.name for p in ENCODERS}  # "<image>" -> its phase
PLACEHOLDER = re.compile("(" + "|".join(re.escape(t) for t in PHASE_OF_PLACEHOLDER) + ")")
PART_PHASE = {p.item: p.name for p in ENCODERS}  # a content part's type ("image") -> its phase
ROLES = ("system", "user", "assistant")


@dataclass
class Record:
    """A parsed manifest record: turns of (role, text) and its media sources."""

    id: str
    turns: list[tuple[str, str]]  # role "text" for plain text records
    media: dict[str, list[Any]]  # per encoder phase, its items' sources: Path | bytes


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
    for p in ENCODERS:
        entries = obj.get(p.items, [])
        if not isinstance(entries, list):
            raise RecordError("malformed_line", f"'{p.items}' must be a list", rid)
        media[p.name] = [_media_source(e, base_dir, rid) for e in entries]
    record = Record(rid, turns, media)
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
    if kind in PART_PHASE:
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
    for p in ENCODERS:
        n, media = text.count(p.placeholder), r.media[p.name]
        if n != len(media):
            raise RecordError(
                "placeholder_mismatch",
                f"{n} {p.placeholder} placeholder(s), {len(media)} {p.item} item(s)",
                r.id,
            )
    words = PLACEHOLDER.sub("", text).strip()
    if not words and not any(r.media.values()):
        raise RecordError("empty_sample", "no text and no media", r.id)
    roles = [role for role, _ in r.turns]
    if "text" not in roles and not any(
        role == "assistant" and PLACEHOLDER.sub("", t).strip() for role, t in r.turns
    ):
        raise RecordError("empty_sample", "no assistant turn with text (nothing to learn)", r.id)
