"""A parsed record: its turns of (role, text) and its media sources, checked.

A record is `{"id", "text"}` (plain text) or `{"id", "messages": [{"role", "content"}]}` (a
chat), with a list of items per kind of media under its `items` key (`images`, `audio`,
`videos`: paths relative to the data file or to data.media_root, `data:...;base64,` URIs or
{"base64": ...}); the text places each item with its kind's placeholder (`<image>`, `<audio>`,
`<video>`; `jaxmllm.config.phases.KINDS`). A path must lead, once `..` and symlinks are
resolved, inside that folder (`MediaPaths`): a manifest from a stranger cannot make training
read, or the ArrayRecord converter embed, `/etc/shadow`.

A preference pair (`train.objective: dpo`) is `{"id", "messages": [its prompt], "chosen",
"rejected"}`, each side one assistant message (or its text): the prompt's turns and media are
shared, the sides are its two completions (`Record.completions`). Another tool's pair (TRL's
prompt / chosen / rejected, RLAIF-V's) becomes this one in `schemas.from_pair`. A side missing,
empty or equal to the other is a reject (`pair_missing_side`, `pair_empty_side`,
`pair_identical`), as is a placeholder in a side (a pair's media belong to its prompt).
"""

from __future__ import annotations

import base64
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxmllm.config.phases import KINDS
from jaxmllm.data.rejects import RecordError

KIND_OF_PLACEHOLDER = {k.placeholder: k.name for k in KINDS}  # "<video>" -> its kind
PLACEHOLDER = re.compile("(" + "|".join(re.escape(t) for t in KIND_OF_PLACEHOLDER) + ")")
PART_KIND = {k.item: k.name for k in KINDS}  # a content part's type ("video") -> its kind
ROLES = ("system", "user", "assistant")
PAIR_KEYS = ("chosen", "rejected")  # a preference pair's completions, in a Sample's order

Turns = list[tuple[str, str]]


@dataclass
class Record:
    """A parsed manifest record: turns of (role, text) and its media sources."""

    id: str
    turns: Turns  # role "text" for plain text records; a pair's prompt
    media: dict[str, list[Any]]  # per kind of media (KINDS), its items' sources: Path | bytes
    # A preference pair's completions (chosen, rejected): the turns that follow `turns` in
    # each of its two documents; None: not a pair
    completions: tuple[Turns, Turns] | None = None
    # Learn only the last assistant turn (a pair's document learns its completion, not the
    # assistant turns of a multi-turn prompt); False: every assistant turn
    learn_last: bool = False

    @property
    def is_pair(self) -> bool:
        return self.completions is not None

    def document(self, side: int) -> Record:
        """A pair's document `side` (0: chosen, 1: rejected): its prompt, then that
        completion, which alone is learned."""
        assert self.completions is not None, "not a preference pair"
        turns = [*self.turns, *self.completions[side]]
        return Record(self.id, turns, self.media, learn_last=True)


@dataclass(frozen=True)
class MediaPaths:
    """Where a record's media paths lead: relative to `base`, and (unless `anywhere`) only to
    files inside `inside` (default `base`) once `..` and symlinks are resolved."""

    base: Path  # where relative paths start (data.media_root, else the data file's folder)
    anywhere: bool = False  # data.allow_outside_paths (generation's own --image / --audio)
    inside: Path | None = None  # data.confine_media_to: a folder holding `base`; None = base
    root: Path = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "root", Path(os.path.realpath(self.inside or self.base)))

    def resolve(self, entry: str, where: str, rid: str) -> Path:
        """The path of a media entry; raises RecordError("path_outside_root") for one that
        leads out of `base`, naming the entry's place in the record, never where it leads."""
        path = self.base / entry
        if self.anywhere:
            return path
        try:
            real = Path(os.path.realpath(path))
        except ValueError:  # a NUL byte: no file can have that name
            return path  # (check_media_file rejects it as missing, opening nothing)
        if not real.is_relative_to(self.root):
            raise RecordError("path_outside_root", self._outside(where), rid)
        return real

    def _outside(self, where: str) -> str:
        """What a path leading out says: the folder it left and the setting that lets it in
        while relative paths keep their start (never where it led)."""
        left = (
            f"data.confine_media_to={self.inside}"
            if self.inside
            else f"the media folder {self.base} (data.confine_media_to is empty: media must "
            "stay inside the folder relative paths start from)"
        )
        return (
            f"{where} leads outside {left} by '..', an absolute path or a symlink. If the "
            "file is yours, set data.confine_media_to to a folder that holds it (relative "
            f"paths still start from {self.base}, data.media_root), or move it inside; "
            "data.allow_outside_paths: true reads paths anywhere"
        )


def parse_record(
    obj: Any, paths: MediaPaths | Path, line: int, fallback: str | None = None
) -> Record:
    """Checks one manifest object and resolves its media paths (a bare Path: confined to that
    folder); raises RecordError. `fallback`: what names a record that names itself no id (its
    place in the data set; default `line:<line>`)."""
    if not isinstance(paths, MediaPaths):
        paths = MediaPaths(Path(paths))
    fallback = fallback or f"line:{line}"
    if not isinstance(obj, dict):
        raise RecordError("malformed_line", "not a JSON object", fallback)
    if "__malformed__" in obj:
        # A line the ArrayRecord converter could not parse (no id), or a WebDataset sample
        # that cannot be read (its key as its id).
        named = obj.get("id")
        rid = named if isinstance(named, str) and named else fallback
        raise RecordError(obj.get("__reason__", "malformed_line"), obj["__malformed__"], rid)
    rid = obj.get("id")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool) or rid == "":
        raise RecordError("malformed_line", "missing or invalid 'id'", fallback)
    rid = str(rid)
    if not valid_unicode(rid):
        raise RecordError(
            "malformed_line", "'id' is not valid Unicode (a lone surrogate)", fallback
        )
    completions = None
    if any(k in obj for k in PAIR_KEYS):
        turns, completions = _parse_pair(obj, rid)
    elif ("text" in obj) == ("messages" in obj):
        raise RecordError("malformed_line", "needs exactly one of 'text' or 'messages'", rid)
    elif "text" in obj:
        if not isinstance(obj["text"], str):
            raise RecordError("malformed_line", "'text' must be a string", rid)
        turns = [("text", obj["text"])]
    else:
        turns = _parse_messages(obj["messages"], rid)
    every = [*turns, *(t for side in completions or () for t in side)]
    if not all(valid_unicode(t) for _, t in every):  # JSON's "\ud800" escapes decode to these
        raise RecordError("malformed_line", "text is not valid Unicode (a lone surrogate)", rid)
    media = {}
    for k in KINDS:
        entries = obj.get(k.items, [])
        if not isinstance(entries, list):
            raise RecordError("malformed_line", f"'{k.items}' must be a list", rid)
        media[k.name] = [
            _media_source(e, paths, f"{k.items}[{j}]", rid) for j, e in enumerate(entries)
        ]
    record = Record(rid, turns, media, completions)
    _check_placeholders(record)
    return record


def _parse_pair(obj: dict, rid: str) -> tuple[Turns, tuple[Turns, Turns]]:
    """A preference pair's prompt turns and its (chosen, rejected) completions."""
    if "text" in obj or not isinstance(obj.get("messages"), list):
        raise RecordError(
            "malformed_line",
            "a preference pair needs 'messages' (its prompt), 'chosen' and 'rejected' "
            "(TRL's prompt/chosen/rejected records: data.format: messages, or auto)",
            rid,
        )
    prompt = _parse_messages(obj["messages"], rid)  # (a non-empty list)
    sides = tuple(_completion(obj.get(key), key, rid) for key in PAIR_KEYS)
    if sides[0] == sides[1]:
        raise RecordError("pair_identical", "'chosen' and 'rejected' are identical", rid)
    return prompt, sides


def _completion(value: Any, key: str, rid: str) -> Turns:
    """One side of a pair: one assistant message (or its text), with text and no media."""
    if value is None:
        raise RecordError("pair_missing_side", f"missing '{key}'", rid)
    if value == "" or value == []:
        raise RecordError("pair_empty_side", f"'{key}' is empty", rid)
    if not isinstance(value, (str, list)):
        raise RecordError(
            "malformed_line", f"'{key}' must be a string or a list of one assistant message", rid
        )
    turns = [("assistant", value)] if isinstance(value, str) else _parse_messages(value, rid)
    if len(turns) != 1 or turns[0][0] != "assistant":
        roles = ", ".join(role for role, _ in turns)
        raise RecordError(
            "malformed_line", f"'{key}' must be one assistant message, not {roles}", rid
        )
    text = turns[0][1]
    found = PLACEHOLDER.search(text)
    if found:
        raise RecordError(
            "placeholder_mismatch",
            f"'{key}' holds a {found.group(0)} placeholder: a pair's media belong to its prompt",
            rid,
        )
    if not text.strip():
        raise RecordError("pair_empty_side", f"'{key}' is empty (no text)", rid)
    return turns


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
    if kind in PART_KIND:
        return f"<{kind}>"
    raise RecordError("malformed_line", f"unknown content part {part!r:.60}", rid)


def _media_source(entry: Any, paths: MediaPaths, where: str, rid: str) -> Any:
    if isinstance(entry, str) and entry and not entry.startswith("data:") and valid_unicode(entry):
        return paths.resolve(entry, where, rid)
    try:
        if isinstance(entry, str) and entry.startswith("data:"):
            return base64.b64decode(entry.partition(",")[2], validate=True)
        if isinstance(entry, dict) and "base64" in entry:
            return base64.b64decode(entry["base64"], validate=True)
        if isinstance(entry, dict) and isinstance(entry.get("bytes"), bytes):
            return entry["bytes"]
    except (ValueError, TypeError) as e:
        raise RecordError("undecodable_media", f"bad base64: {e}", rid) from None
    if isinstance(entry, dict) and "missing" in entry:
        # What the ArrayRecord converter could not embed (or a reader did not read: a .tar
        # member over the size cap): rejected for the reason found, never taken as a path (a
        # manifest could name any file so).
        reason = entry.get("reason")
        reason = (
            reason
            if reason
            in ("missing_media", "undecodable_media", "media_too_large", "path_outside_root")
            else "missing_media"
        )
        detail = entry.get("detail")
        detail = (
            detail if isinstance(detail, str) else "the ArrayRecord converter could not embed it"
        )
        raise RecordError(reason, f"{where}: {detail}", rid)
    raise RecordError("malformed_line", f"media entry {entry!r:.60} is not a path or base64", rid)


def valid_unicode(text: str) -> bool:
    """False for a string the tokenizer cannot encode (lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_placeholders(r: Record) -> None:
    text = "".join(t for _, t in r.turns)
    for k in KINDS:
        n, media = text.count(k.placeholder), r.media[k.name]
        if n != len(media):
            raise RecordError(
                "placeholder_mismatch",
                f"{n} {k.placeholder} placeholder(s), {len(media)} {k.item} item(s)",
                r.id,
            )
    words = PLACEHOLDER.sub("", text).strip()
    if r.is_pair:  # (its sides' text is checked: each has some)
        return
    if not words and not any(r.media.values()):
        raise RecordError("empty_sample", "no text and no media", r.id)
    roles = [role for role, _ in r.turns]
    if "text" not in roles and not any(
        role == "assistant" and PLACEHOLDER.sub("", t).strip() for role, t in r.turns
    ):
        raise RecordError("empty_sample", "no assistant turn with text (nothing to learn)", r.id)
