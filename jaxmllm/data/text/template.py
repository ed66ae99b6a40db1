"""Prompt templates: the seam between generation and a model's tokenizer and chat format.

A `Template` turns a request (text with `<image>` / `<video>` / `<audio>` placeholders, or token
ids, and media files) into a prompt `Sample` laid out like training samples, says which ids end
an answer and reads generated ids as text. Generation (`jaxmllm.generate`) and the eval answers see
nothing else of the tokenizer.

`RecordTemplate` renders a request as a record of the run's data, through the training
preprocessor and the run's tokenizer (`data.tokenizer`), which lays out the prompt that
generation continues (`pieces(record, generation=True)`): so the prompt has exactly the token
layout, special ids and media preprocessing training saw, for every kind of tokenizer:

- chat: a `messages` record's user turn and the assistant's turn opening: jaxmllm's own format
  `BOS USER text ASSISTANT` (byte, tokenizer.json), or a checkpoint's chat template with its
  generation prompt (a HuggingFace tokenizer directory: `apply_chat_template(...,
  add_generation_prompt=True)`);
- plain: a `text` record without its closing end-of-sequence id, `BOS text`: the model continues
  the text (the built-in synthetic data lays out its questions so: `BOS <image> what is this? `
  + the answer, EOS).

An answer ends at the tokenizer's stop ids (`specials.stop`: EOS, and a checkpoint's
end-of-turn ids).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from jaxmllm.config import Config, ConfigError
from jaxmllm.config.phases import ENCODERS, KINDS
from jaxmllm.data.datasets import data_sets
from jaxmllm.data.preprocess import Limits, Params, Preprocessor
from jaxmllm.data.records import open_records, read_record
from jaxmllm.data.records.record import PLACEHOLDER, MediaPaths, parse_record
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.samples import Sample
from jaxmllm.data.text.specials import Specials
from jaxmllm.data.text.tokenizer import ByteTokenizer

TEMPLATES = ("auto", "chat", "plain")
# A prompt's media are the user's own files (`generate --image / --audio`): read where they are.
OWN_FILES = MediaPaths(Path("."), anywhere=True)


class Template(Protocol):
    """How requests become prompts and generated ids become text (see the module docstring)."""

    specials: Specials  # the tokenizer's ids: `stop` ends an answer (kept in its ids)

    def prompt(self, text: str, media: Mapping[str, Sequence[Any]]) -> Sample:
        """The prompt of a user message with media files (paths, per kind of media), ready to
        generate from.

        Raises:
          RecordError: a media file that is missing, undecodable or over the data caps, or
            placeholders that do not match the media.
        """
        ...

    def prompt_ids(self, ids: Sequence[int], media: Mapping[str, Sequence[Any]]) -> Sample:
        """A prompt of exactly these token ids; each item (an image, a video, a clip) fills the
        next run of its phase's placeholder ids, which must be as long as its encoder output
        (items of a phase in the table's order: images, then videos)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of generated ids (stop ids left out)."""
        ...


class RecordTemplate:
    """A request rendered as a record of the run's data, by the run's tokenizer."""

    def __init__(self, pre: Preprocessor, chat: bool):
        self.pre, self.chat = pre, chat
        self.specials: Specials = pre.tokenizer.specials

    def prompt(self, text: str, media: Mapping[str, Sequence[Any]]) -> Sample:
        """See `Template.prompt`. Without any placeholder in `text`, the media come first, in
        the table's order (images, clips, then videos), as in the built-in data and most
        image-text data sets."""
        if not PLACEHOLDER.search(text):
            text = _placeholders(media) + text
        obj = {"id": "prompt", **_media_entries(media)}
        if self.chat:  # (a record needs an answer to parse: a stand-in, left out below)
            obj["messages"] = [
                {"role": "user", "content": text},
                {"role": "assistant", "content": "."},
            ]
        else:
            obj["text"] = text
        record = parse_record(obj, OWN_FILES, 0)
        if self.chat:
            record = dataclasses.replace(record, turns=record.turns[:-1])
        return self._sample(record)

    def prompt_ids(self, ids: Sequence[int], media: Mapping[str, Sequence[Any]]) -> Sample:
        """See `Template.prompt_ids`."""
        tokens = np.asarray(list(ids), np.int32)
        decoded = Sample(-1, tokens[:0], tokens[:0].astype(bool))
        if any(media.values()):  # (decoded as a record of the media alone)
            obj = {"id": "prompt", "text": _placeholders(media), **_media_entries(media)}
            decoded = self._sample(parse_record(obj, OWN_FILES, 0))
        for p in ENCODERS:
            marker, per = self.specials.phase_ids(p.name), self.pre.per_token[p.name]
            rows = sum(len(m[0]) // per for m in decoded.media[p.name])
            have = int(np.isin(tokens, marker).sum())
            if have != rows:
                what = "/".join(k.item for k in KINDS if k.phase == p.name)
                raise RecordError(
                    "placeholder_mismatch",
                    f"the prompt ids hold {have} {what} placeholder ids ({marker}); the "
                    f"{what} input(s) given need {rows} (one per encoder output row)",
                    "prompt",
                )
        return Sample(-1, tokens, np.zeros(len(tokens), bool), decoded.media, decoded.grids)

    def _sample(self, record) -> Sample:
        """The record as a prompt, media decoded (their sizes from the files' headers); an item
        its phase cannot use (a video too short for one temporal patch) is a RecordError, as in
        training, never left out or divided by."""
        sizes = self.pre.sizes(record)
        self.pre.check(record, sizes)
        sample = self.pre.sample(0, record, sizes, Limits(), generation=True)
        return dataclasses.replace(sample, id=-1)

    def decode(self, ids: Sequence[int]) -> str:
        """See `Template.decode`."""
        kept = [int(i) for i in ids if int(i) not in self.specials.stop]
        return self.pre.tokenizer.decode(np.asarray(kept, np.int64))


def _placeholders(media: Mapping[str, Sequence[Any]]) -> str:
    """A placeholder for each item, the table's kinds in order."""
    return "".join(k.placeholder * len(media.get(k.name, ())) for k in KINDS)


def _media_entries(media: Mapping[str, Sequence[Any]]) -> dict[str, list[str]]:
    """A record's media lists (`images`, `audio`, `videos`) of the given files."""
    return {k.items: [str(f) for f in media.get(k.name, ())] for k in KINDS}


def make_template(cfg: Config, kind: str = "auto", pretrained: bool = False) -> Template:
    """The template of a run's config: `chat` or `plain` (see the module docstring); `auto`:
    plain for the built-in synthetic data, else the form of the training data's first record
    (`messages`: chat; `text`: plain). `pretrained`: a checkpoint's own config (generation
    from `--hf`), whose data is none of ours: `data.tokenizer` renders, `auto` is chat when it
    has a chat template."""
    if kind not in TEMPLATES:
        raise ConfigError(f"template {kind!r}: must be one of {', '.join(TEMPLATES)}")
    # The built-in data is bytes whatever data.tokenizer says (SyntheticSource's tokenizer).
    synthetic = cfg.data.source == "synthetic" and not pretrained
    pre = Preprocessor(Params.from_config(cfg), ByteTokenizer() if synthetic else None)
    if kind == "auto" and pretrained:
        kind = "chat" if getattr(pre.tokenizer, "template", None) is not None else "plain"
    elif kind == "auto":
        kind = "plain" if synthetic else _data_form(cfg)
    return RecordTemplate(pre, chat=kind == "chat")


def _data_form(cfg: Config) -> str:
    """chat when the training data's first readable record has `messages`, else plain."""
    try:
        ds = data_sets(cfg)[0]
        records = open_records(ds.path, ds.format, ds.media_root, data=cfg.data, confine=ds.confine)
        for k in range(min(len(records), 16)):
            try:
                record = read_record(records, k)
            except RecordError:
                continue
            return "plain" if record.turns[0][0] == "text" else "chat"
    except (OSError, ConfigError):  # (a file gone, or one of no format it knows)
        pass
    return "chat"
