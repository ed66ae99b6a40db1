"""Records as other tools write them, made into jaxmllm's own (`record.parse_record` checks it).

Schemas, by the fields a record has:
- `jaxmllm`: `{"id", "text" | "messages", "images", "audio"}` (`record.py`), read as it is;
- `conversations` (LLaVA, ShareGPT, LLaMA-Factory's sharegpt): `{"id", "image": "x.jpg" or a
  list, "conversations": [{"from": "human" | "gpt" | "system", "value": "<image>\\n..."}],
  "system"}` (LLaVA-Video's `{"video": "x.mp4"}` records mark it `<image>`: read as `<video>`);
- `messages` (OpenAI-style, Qwen's and LLaMA-Factory's data, HF datasets' chat columns):
  `{"messages": [{"role", "content": "text" or [{"type": "text", "text"}, {"type": "image",
  "image": "x.jpg"}, {"type": "image_url", "image_url": {"url": ...}}]}], "images": [...]}`, or
  `{"text", "image"}` (captions);
- prompts with answers (online RL, TRL's GRPO sets): `{"prompt" | "question": text or messages,
  "answer" | "solution": text, "images": [...]}`, read as a user turn and the assistant's
  answer.

For every kind of media (`jaxmllm.config.phases.KINDS`), a record's items are under its `items`
key, its `item` key or `item` + "s" (`images`, `image`; `audio`, `audios`; `videos`, `video`),
one entry or a list; an entry is a path (relative to data.media_root; `file://` stripped), a
`data:` URI, or a `{"bytes", "path"}` struct (HF datasets' Image and Audio). A content part of
type `item` (or `item_url`, `input_item`) places one item, its source in the part or, where no
part carries one, the record's list in order. A record with items but no placeholder for them
gets them first, before the first user turn's text (LLaVA's convention, and what content parts
do); an `id` missing is the record's place in its file. What cannot be read is a RecordError
naming the field.

Preference pairs (`train.objective: dpo`), in whichever schema, by their `chosen` / `rejected`
keys (`from_pair`), as TRL and LLaMA-Factory write them:
- standard: `{"prompt": "<image>What is it?", "chosen": "a cat", "rejected": "a dog",
  "images": [...]}`;
- conversational: `{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text",
  "text": ...}]}], "chosen": [{"role": "assistant", "content": ...}], "rejected": [...]}`;
- implicit prompt: `chosen` and `rejected` whole conversations, the prompt what they share;
- RLAIF-V's `{"image": {"bytes", "path"}, "question", "chosen", "rejected"}`, LLaMA-Factory's
  `{"conversations": [...], "chosen": {"from": "gpt", "value"}, "rejected": {...}}`.
A standard pair's strings are a one-turn conversation (the prompt the user's, each completion
the assistant's), so the chat template renders every form alike (LLaMA-Factory's reading; TRL
applies the template only to conversational pairs). Items without placeholders go first in the
prompt, as for other records (TRL and LLaMA-Factory do so for RLAIF-V's images).
"""

from __future__ import annotations

from typing import Any

from jaxmllm.config.phases import KINDS
from jaxmllm.data.records.record import PAIR_KEYS
from jaxmllm.data.rejects import RecordError

SCHEMAS = ("jaxmllm", "conversations", "messages", "any")
SPEAKERS = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}
PART_KIND = {}  # a content part's type -> its kind: image, image_url, input_image, video, ...
for _k in KINDS:
    PART_KIND.update({_k.item: _k, f"{_k.item}_url": _k, f"input_{_k.item}": _k})


def to_native(obj: Any, schema: str, fallback_id: str) -> Any:
    """`obj` in jaxmllm's record schema (`any`: conversations where it has them, else
    messages); a malformed marker or a non-object passes through (the parser names it)."""
    if schema == "jaxmllm" or not isinstance(obj, dict) or "__malformed__" in obj:
        return obj
    if is_pair(obj):
        return media_first(from_pair(obj, record_id(obj, fallback_id)))
    rid = record_id(obj, fallback_id)
    if obj.get("messages") is None and ("prompt" in obj or "question" in obj):
        obj, schema = prompt_answer(obj, rid), "messages"
    if schema == "any":
        schema = "conversations" if obj.get("conversations") is not None else "messages"
    out = from_conversations(obj, rid) if schema == "conversations" else from_messages(obj, rid)
    return media_first(out)


def prompt_answer(obj: dict, rid: str) -> dict:
    """A prompt with its answer (online RL's data, TRL's GRPO sets): `{"prompt" | "question":
    text or messages, "answer" | "solution": text}` as a conversation, the answer the
    assistant's (what `split_answer` cuts off and the rewards compare with; none: an empty
    turn, for rewards that need no answer)."""
    answer = obj.get("answer", obj.get("solution", ""))
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise RecordError(
            "malformed_line",
            f"'answer' / 'solution' must be text or a number, not {type(answer).__name__}",
            rid,
        )
    prompt = _prompt(obj, rid)
    return {**obj, "messages": [*prompt, {"role": "assistant", "content": str(answer)}]}


def is_pair(obj: Any) -> bool:
    """Whether a record (as a file holds it) is a preference pair: it has `chosen` or
    `rejected` (one of them missing is the pair's reject)."""
    return isinstance(obj, dict) and any(k in obj for k in PAIR_KEYS)


def record_id(obj: dict, fallback: str) -> str:
    rid = obj.get("id")
    if isinstance(rid, (str, int)) and not isinstance(rid, bool) and rid != "":
        return str(rid)
    return fallback


def from_conversations(obj: dict, rid: str) -> dict:
    """A LLaVA / ShareGPT record as jaxmllm's."""
    turns = obj.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise RecordError(
            "malformed_line",
            "needs a non-empty 'conversations' list of {'from', 'value'} turns",
            rid,
        )
    messages = []
    if isinstance(obj.get("system"), str) and obj["system"]:
        messages.append({"role": "system", "content": obj["system"]})
    for t in turns:
        who = t.get("from", t.get("role")) if isinstance(t, dict) else None
        value = t.get("value", t.get("content")) if isinstance(t, dict) else None
        if not isinstance(who, str) or who not in SPEAKERS:
            raise RecordError(
                "malformed_line",
                f"a turn from {who!r}: each turn needs 'from' "
                "human, gpt or system (or user, assistant)",
                rid,
            )
        if not isinstance(value, str):
            raise RecordError(
                "malformed_line",
                f"a turn's 'value' must be a string, not {type(value).__name__}",
                rid,
            )
        messages.append({"role": SPEAKERS[who], "content": value})
    lists = media_lists(obj, rid)
    if lists["videos"] and not lists["images"]:  # LLaVA-Video marks its videos with <image>
        text = "".join(m["content"] for m in messages)
        if "<video>" not in text and text.count("<image>") == len(lists["videos"]):
            for m in messages:
                m["content"] = m["content"].replace("<image>", "<video>")
    return {"id": rid, "messages": messages, **lists}


def _speaker(role: Any) -> str | None:
    return SPEAKERS.get(role) if isinstance(role, str) else None


def from_messages(obj: dict, rid: str) -> dict:
    """An OpenAI-style record (or a caption: `text` and its media) as jaxmllm's."""
    lists = media_lists(obj, rid)
    if obj.get("messages") is None and isinstance(obj.get("text"), str):
        return {"id": rid, "text": obj["text"], **lists}
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RecordError(
            "malformed_line",
            "needs a non-empty 'messages' list of {'role', 'content'} (or a 'text')",
            rid,
        )
    in_parts: dict[str, list] = {p.items: [] for p in KINDS}
    out = [_message(m, in_parts, rid) for m in messages]
    for p in KINDS:
        if in_parts[p.items] and lists[p.items]:
            raise RecordError(
                "malformed_line",
                f"{p.items} both in content parts and in the "
                f"record's '{p.items}'; give them in one place",
                rid,
            )
        lists[p.items] = in_parts[p.items] or lists[p.items]
    return {"id": rid, "messages": out, **lists}


def _message(m: Any, in_parts: dict[str, list], rid: str) -> dict:
    """An OpenAI-style message as jaxmllm's: its role, its content's text with a placeholder
    per media part (their sources noted in `in_parts`)."""
    role = _speaker(m.get("role")) if isinstance(m, dict) else None
    if role is None:
        got = m.get("role") if isinstance(m, dict) else m
        raise RecordError(
            "malformed_line",
            f"a message with role {got!r:.40}: each needs a role system, user or assistant",
            rid,
        )
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(_part(part, in_parts, rid) for part in content)
    elif content is None:
        content = ""
    if not isinstance(content, str):
        raise RecordError(
            "malformed_line", "a message's content must be a string or a list of parts", rid
        )
    return {"role": role, "content": content}


def from_pair(obj: dict, rid: str) -> dict:
    """A preference record (see the module docstring) as jaxmllm's pair: its prompt as
    `messages`, each side a list of messages (None where it is missing: the parser names it)."""
    sides = [obj.get(key) for key in PAIR_KEYS]
    prompt = _prompt(obj, rid)
    if prompt is None:  # (implicit: the messages both sides start with)
        prompt, sides = _shared_start(sides, rid)
    if not prompt:
        raise RecordError(
            "malformed_line",
            "a preference pair's prompt is empty (an empty list, or 'chosen' and 'rejected' "
            "that start with no message alike)",
            rid,
        )
    out = from_messages({**obj, "messages": prompt}, rid)
    in_parts: dict[str, list] = {p.items: [] for p in KINDS}  # (a side's media: refused)
    for key, side in zip(PAIR_KEYS, sides, strict=True):
        out[key] = _side(side, in_parts, rid)
    return {**out, "id": rid}


def _prompt(obj: dict, rid: str) -> list | None:
    """A pair's prompt as messages: its `prompt` (text: the user's), RLAIF-V's `question`,
    LLaMA-Factory's `conversations` or `messages`; None where it has none."""
    prompt = obj.get("prompt", obj.get("question"))
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list):
        return prompt
    if prompt is not None:
        raise RecordError(
            "malformed_line",
            f"'prompt' must be text or a list of messages, not {type(prompt).__name__}",
            rid,
        )
    if isinstance(obj.get("conversations"), list):
        return from_conversations(obj, rid)["messages"]
    return obj["messages"] if isinstance(obj.get("messages"), list) else None


def _shared_start(sides: list, rid: str) -> tuple[list, list]:
    """An implicit prompt (TRL's): the messages both conversations start with, and what each
    side goes on with."""
    if not all(isinstance(s, list) for s in sides):
        raise RecordError(
            "malformed_line",
            "a preference pair needs a 'prompt' (or 'question'), or 'chosen' and 'rejected' "
            "as whole conversations that start alike",
            rid,
        )
    chosen, rejected = sides
    n = 0
    while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
        n += 1
    return chosen[:n], [chosen[n:], rejected[n:]]


def _side(side: Any, in_parts: dict[str, list], rid: str) -> Any:
    """A pair's side as a list of messages: text is the assistant's, a message (LLaMA-Factory's
    {"from", "value"}) a list of one; missing (None) and empty stay as they are."""
    if side is None or side == "" or side == []:
        return side
    if isinstance(side, str):
        return [{"role": "assistant", "content": side}]
    if isinstance(side, dict) and "from" in side:
        side = {"role": side.get("from"), "content": side.get("value")}
    messages = side if isinstance(side, list) else [side]
    return [_message(m, in_parts, rid) for m in messages]


def _part(part: Any, in_parts: dict[str, list], rid: str) -> str:
    """A content part's text: its text, or its item's placeholder (its source noted)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        text = part.get("text")
        return text if isinstance(text, str) else ""
    k = PART_KIND.get(kind) if isinstance(kind, str) else None
    if k is None:
        raise RecordError("malformed_line", f"unknown content part {part!r:.60}", rid)
    found = [part.get(k) for k in (kind, "url", "path", "bytes")]
    source = next((s for s in found if s is not None), None)
    if source is not None:
        in_parts[k.items].append(_entry(source, rid))
    return k.placeholder


def media_lists(obj: dict, rid: str) -> dict[str, list]:
    """Each kind's items of a record, from whichever of its keys it uses."""
    out = {}
    for p in KINDS:
        keys = [k for k in dict.fromkeys((p.items, p.item, f"{p.item}s")) if obj.get(k) is not None]
        if len(keys) > 1:
            raise RecordError(
                "malformed_line",
                f"both {keys[0]!r} and {keys[1]!r}: give the {p.items} under one key",
                rid,
            )
        value = obj[keys[0]] if keys else []
        entries = value if isinstance(value, list) else [value]
        out[p.items] = [_entry(e, rid) for e in entries if e is not None]
    return out


def _entry(entry: Any, rid: str) -> Any:
    """A media entry as jaxmllm's record takes it (a path, a data: URI, {"bytes": ...})."""
    if isinstance(entry, dict) and ("base64" in entry or "missing" in entry):
        return entry  # (jaxmllm's own inline form; a member a reader left unread, and why)
    if isinstance(entry, dict) and not isinstance(entry.get("bytes"), bytes):
        url = entry.get("url", entry.get("path"))
        if "data" in entry and isinstance(entry["data"], str):  # OpenAI's input_audio
            url = f"data:;base64,{entry['data']}"
        entry = url
    if isinstance(entry, str):
        if entry.startswith(("http://", "https://")):
            raise RecordError(
                "missing_media",
                f"{entry[:80]} is a URL: media are read from "
                "local files only; download them and give their paths",
                rid,
            )
        return entry.removeprefix("file://")
    if isinstance(entry, dict):
        return {"bytes": entry["bytes"]}
    raise RecordError(
        "malformed_line",
        f"media entry {entry!r:.60} is not a path, a data: URI or a {{'bytes', 'path'}} struct",
        rid,
    )


def media_first(record: dict) -> dict:
    """A record whose items have no placeholders at all gets them, in the table's order, at
    the start of its first user turn (of its text)."""
    texts = [record["text"]] if "text" in record else [m["content"] for m in record["messages"]]
    lead = "".join(
        p.placeholder * len(record[p.items])
        for p in KINDS
        if record[p.items] and not any(p.placeholder in t for t in texts)
    )
    if not lead:
        return record
    if "text" in record:
        return {**record, "text": lead + record["text"]}
    messages = [dict(m) for m in record["messages"]]
    first = next((m for m in messages if m["role"] == "user"), messages[0])
    first["content"] = lead + first["content"]
    return {**record, "messages": messages}
