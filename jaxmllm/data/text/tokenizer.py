"""Tokenizers: the three kinds `data.tokenizer` names, and the sequences they make of a record.

- `byte`: UTF-8 bytes are ids 0..255, jaxmllm's reserved specials 256..263 follow (pad, BOS,
  EOS, image, audio, user, assistant, video); needs no files.
- the path of a `tokenizer.json` file (training from scratch): its ids below 256 as they are,
  256..263 the reserved specials, its ids k >= 256 shifted to k + 8, so any tokenizer.json works
  without added tokens; model.llm.vocab_size must be at least its size + 8.
- the path of a HuggingFace tokenizer directory (fine-tuning a checkpoint): the checkpoint's own
  ids, special tokens and chat template (`jaxmllm.data.text.pretrained`).

The first two lay a record out in jaxmllm's own format: BOS, then per turn a USER / ASSISTANT
marker and its text, EOS after each assistant turn; the assistant turns and their EOS are
learned (the last one alone where the record says `learn_last`: a preference pair's
document). Every tokenizer has `specials` (the ids the batch contract needs), `vocab_size`,
`encode` / `decode` and `pieces(record)`: the record's token runs ("text", ids, loss) and
media markers (kind of media, item number) in order, which `Preprocessor.layout` turns into
the sample's exact sequence.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from jaxmllm.config import ConfigError
from jaxmllm.config.phases import KINDS, enabled
from jaxmllm.data.records.record import KIND_OF_PLACEHOLDER, PLACEHOLDER, Record
from jaxmllm.data.text.pretrained import (
    DEFAULT_DATE,
    MAX_TOKENIZER_BYTES,
    PretrainedTokenizer,
    directory_sha256,
    frame_time,
    is_tokenizer_dir,
)
from jaxmllm.data.text.specials import (  # noqa: F401  (re-exported: the reserved ids by name)
    ASSISTANT,
    BOS,
    EOS,
    NUM_SPECIAL,
    PAD,
    RESERVED,
    USER,
    Specials,
)


def config_tokenizer(cfg):
    """The tokenizer a config names (`data.tokenizer`, its template date and
    data.max_tokenizer_bytes), for the encoder phases its model has."""
    d = cfg.data
    have = [p.name for p in enabled(cfg.model)]
    return make_tokenizer(d.tokenizer, d.template_date, d.max_tokenizer_bytes, have)


def make_tokenizer(
    spec: str,
    template_date: str = DEFAULT_DATE,
    max_bytes: int = MAX_TOKENIZER_BYTES,
    phases: Iterable[str] | None = None,
):
    """`byte`, the path of a tokenizer.json, or the path of a HuggingFace tokenizer directory
    (`template_date`: the date its chat template's strftime_now renders; `max_bytes`:
    data.max_tokenizer_bytes, the largest tokenizer.json a directory may hold; `phases`: the
    encoder phases the model has, None for every one: a directory appends a placeholder token
    only for those)."""
    if spec == "byte":
        return ByteTokenizer()
    if is_tokenizer_dir(spec):
        return PretrainedTokenizer(spec, template_date, max_bytes, phases)
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(
            f"data.tokenizer: nothing at {spec!r}; give 'byte', the path of a tokenizer.json "
            "(from scratch) or of a HuggingFace tokenizer directory (a checkpoint's own ids and "
            "chat template); nothing is downloaded"
        )
    try:
        return HFTokenizer(path)
    except Exception as e:
        raise ConfigError(f"data.tokenizer: {spec} is not a tokenizer.json: {e}") from None


def tokenizer_sha256(spec: str, template_date: str = DEFAULT_DATE) -> str:
    """What identifies a tokenizer's ids (the lengths index records it): "" for byte, the
    file's hash, or a directory's files' and its template date's ("" when missing:
    make_tokenizer reports it)."""
    if spec == "byte":
        return ""
    if is_tokenizer_dir(spec):
        return directory_sha256(spec, template_date)
    try:
        return hashlib.sha256(Path(spec).read_bytes()).hexdigest()
    except OSError:
        return ""


class _MarkerFormat:
    """jaxmllm's own sequence format over the reserved specials (byte and bare tokenizers,
    which give `encode`)."""

    specials: Specials = RESERVED
    added_tokens: dict[str, int] = {}  # nothing appended: the reserved ids are in vocab_size

    def frame_text(self, kind: str, seconds: float) -> tuple[np.ndarray, np.ndarray]:
        """The ids before and after a video's temporal patch that starts `seconds` in, where
        its time is written (`data.video_timestamps`): `<1.5 seconds>`, nothing after."""
        return self.encode(frame_time(seconds)), np.zeros(0, np.int32)

    def pieces(self, record: Record, generation: bool = False) -> list[tuple]:
        """Token runs (ids, loss) and media markers of `record`, in order, before any limit;
        `generation`: a prompt ending in the ASSISTANT marker, nothing learned."""
        out: list[tuple] = [_special(BOS, False)]
        count = dict.fromkeys(KIND_OF_PLACEHOLDER.values(), 0)
        last = learned_turn(record)
        for t, (role, text) in enumerate(record.turns):
            if role != "text":
                out.append(_special(ASSISTANT if role == "assistant" else USER, False))
            ends = role in ("text", "assistant") and not generation  # (EOS after the turn)
            learn = ends and last in (None, t)
            for part in PLACEHOLDER.split(text):
                if part in KIND_OF_PLACEHOLDER:  # (kind, its item number)
                    kind = KIND_OF_PLACEHOLDER[part]
                    out.append((kind, count[kind]))
                    count[kind] += 1
                elif part:
                    ids = self.encode(part)
                    out.append(("text", ids, np.full(len(ids), learn)))
            if ends:
                out.append(_special(EOS, learn))
        if generation and record.turns[0][0] != "text":
            out.append(_special(ASSISTANT, False))
        return out


def learned_turn(record: Record) -> int | None:
    """The one turn a record learns where it learns only its last assistant turn (a preference
    pair's document: its completion, not the assistant turns of a multi-turn prompt); None
    where it learns every assistant turn."""
    if not record.learn_last:
        return None
    roles = [role for role, _ in record.turns]
    return len(roles) - 1 - roles[::-1].index("assistant") if "assistant" in roles else -1


def _special(token: int, learn: bool) -> tuple:
    return ("text", np.array([token], np.int32), np.array([learn]))


class ByteTokenizer(_MarkerFormat):
    """UTF-8 bytes are ids 0..255; specials follow. Needs no files, so tiny runs need nothing."""

    vocab_size = 256 + NUM_SPECIAL

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` (no BOS/EOS)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: np.ndarray) -> str:
        """Text of byte ids; specials are shown as <name>."""
        names = {PAD: "<pad>", BOS: "<s>", EOS: "</s>", USER: "<user>", ASSISTANT: "<assistant>"}
        names.update({k.reserved_id: k.placeholder for k in KINDS})
        out, run = [], []
        for i in np.asarray(ids).tolist():
            if i < 256:
                run.append(i)
                continue
            out.append(bytes(run).decode("utf-8", errors="replace"))
            run = []
            out.append(names.get(i, f"<{i}>"))
        out.append(bytes(run).decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer(_MarkerFormat):
    """A HuggingFace `tokenizers` tokenizer.json, ids shifted past the reserved specials."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        self.path = str(path)
        self._tk = Tokenizer.from_file(self.path)
        largest = max(self._tk.get_vocab(with_added_tokens=True).values(), default=0)
        self.vocab_size = max(ByteTokenizer.vocab_size, largest + 1 + NUM_SPECIAL)

    def encode(self, text: str) -> np.ndarray:
        ids = np.asarray(self._tk.encode(text, add_special_tokens=False).ids, np.int64)
        return np.where(ids >= 256, ids + NUM_SPECIAL, ids).astype(np.int32)

    def decode(self, ids: np.ndarray) -> str:
        ids = np.asarray(ids)
        text = ids[(ids < 256) | (ids >= 256 + NUM_SPECIAL)]
        return self._tk.decode(np.where(text >= 256, text - NUM_SPECIAL, text).tolist())

    def __getstate__(self):  # workers reload the file instead of pickling the Rust object
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])
