"""Prompt templates: the seam between generation and a model's tokenizer and chat format.

A `Template` turns a request (text with `<image>` / `<audio>` placeholders, or token ids, and
media files) into a prompt `Sample` laid out like training samples, says which ids end an answer,
and reads generated ids as text. Generation (`jaxmllm.generate`) sees nothing else of the
tokenizer, so another chat format (a HuggingFace chat template and its special tokens) is one
more class with these three methods.

`RecordTemplate` is jaxmllm's own: a prompt is rendered by the training preprocessor
(`jaxmllm.data.preprocess`) as a record of the run's data would be, so generation sees exactly
the token layout and media preprocessing training saw:

- chat: a `messages` record's user turn, then the assistant marker: `BOS USER text ASSISTANT`;
  the answer ends with EOS, as assistant turns do in training;
- plain: a `text` record without its closing EOS, `BOS text`: the model continues the text (the
  built-in synthetic data lays out its questions so: `BOS <image> what is this? ` + answer EOS).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from jaxmllm.config import Config, ConfigError
from jaxmllm.data import tokenizer as tok
from jaxmllm.data.preprocess import Limits, Params, Preprocessor
from jaxmllm.data.records import PLACEHOLDER, open_records, parse_record, read_record
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.samples import Sample

TEMPLATES = ("auto", "chat", "plain")


class Template(Protocol):
    """How requests become prompts and generated ids become text (see the module docstring)."""

    stop_ids: frozenset[int]  # an answer ends at the first of these (it is kept in its ids)

    def prompt(self, text: str, images: Sequence[Any], audio: Sequence[Any]) -> Sample:
        """The prompt of a user message with media (paths or bytes), ready to generate from.

        Raises:
          RecordError: a media file that is missing, undecodable or over the data caps, or
            placeholders that do not match the media.
        """
        ...

    def prompt_ids(self, ids: Sequence[int], images: Sequence[Any], audio: Sequence[Any]) -> Sample:
        """A prompt of exactly these token ids; each image (clip) fills the next run of image
        (audio) placeholder ids, which must be as long as its encoder output."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of generated ids (stop ids left out)."""
        ...


class RecordTemplate:
    """jaxmllm's tokenizers and reserved specials, rendered like training records."""

    def __init__(self, pre: Preprocessor, chat: bool):
        self.pre, self.chat = pre, chat
        self.stop_ids = frozenset({tok.EOS})

    def prompt(self, text: str, images: Sequence[Any], audio: Sequence[Any]) -> Sample:
        """See `Template.prompt`. Without any placeholder in `text`, the media come first, in
        order (images, then clips), as in the built-in data and most image-text data sets."""
        if not PLACEHOLDER.search(text):
            text = "<image>" * len(images) + "<audio>" * len(audio) + text
        obj = {"id": "prompt", "images": [str(p) for p in images], "audio": [str(p) for p in audio]}
        if self.chat:  # (a record needs an answer: rendered, then cut at its turn's marker)
            obj["messages"] = [{"role": "user", "content": text},
                               {"role": "assistant", "content": "."}]  # fmt: skip
        else:
            obj["text"] = text
        sample = self._sample(obj)
        if self.chat:  # BOS USER ... ASSISTANT: the assistant's turn starts
            tokens = sample.tokens[: int(np.flatnonzero(sample.tokens == tok.ASSISTANT)[-1]) + 1]
        else:  # BOS text EOS: the model continues the text
            tokens = sample.tokens[:-1]
        return Sample(-1, tokens.astype(np.int32), np.zeros(len(tokens), bool), sample.images,
                      sample.audio)  # fmt: skip

    def prompt_ids(self, ids: Sequence[int], images: Sequence[Any], audio: Sequence[Any]) -> Sample:
        """See `Template.prompt_ids`."""
        tokens = np.asarray(list(ids), np.int32)
        media = Sample(-1, tokens[:0], tokens[:0].astype(bool))
        if images or audio:  # (decoded as a record of the media alone)
            media = self._sample({"id": "prompt", "text": "<image>" * len(images) + "<audio>" *
                                  len(audio), "images": [str(p) for p in images],
                                  "audio": [str(p) for p in audio]})  # fmt: skip
        merge_area, subsample = self.pre.p.merge**2, self.pre.p.subsample
        for name, marker, rows in (
            ("image", tok.IMAGE, sum(len(m[0]) // merge_area for m in media.images)),
            ("audio", tok.AUDIO, sum(len(m) // subsample for m in media.audio)),
        ):
            have = int((tokens == marker).sum())
            if have != rows:
                raise RecordError(
                    "placeholder_mismatch",
                    f"the prompt ids hold {have} {name} placeholder ids ({marker}); the {name} "
                    f"input(s) given need {rows} (one per encoder output row)",
                    "prompt",
                )
        return Sample(-1, tokens, np.zeros(len(tokens), bool), media.images, media.audio)

    def decode(self, ids: Sequence[int]) -> str:
        """See `Template.decode`."""
        kept = [int(i) for i in ids if int(i) not in self.stop_ids]
        return self.pre.tokenizer.decode(np.asarray(kept, np.int64))

    def _sample(self, obj: dict) -> Sample:
        record = parse_record(obj, Path.cwd(), 0)
        return self.pre.sample(0, record, self.pre.sizes(record), Limits())


def make_template(cfg: Config, kind: str = "auto") -> Template:
    """The template of a run's config: `chat` or `plain` (see the module docstring); `auto`:
    plain for the built-in synthetic data, else the form of the training data's first record
    (`messages`: chat; `text`: plain)."""
    if kind not in TEMPLATES:
        raise ConfigError(f"template {kind!r}: must be one of {', '.join(TEMPLATES)}")
    if kind == "auto":
        kind = "plain" if cfg.data.source == "synthetic" else _data_form(cfg)
    return RecordTemplate(Preprocessor(Params.from_config(cfg)), chat=kind == "chat")


def _data_form(cfg: Config) -> str:
    """chat when the training data's first readable record has `messages`, else plain."""
    try:
        records = open_records(cfg.data.path)
        for k in range(min(len(records), 16)):
            try:
                record = read_record(records, k)
            except RecordError:
                continue
            return "plain" if record.turns[0][0] == "text" else "chat"
    except OSError:
        pass
    return "chat"
