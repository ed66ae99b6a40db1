"""The token ids the data layer needs from a tokenizer, and jaxmllm's own reserved specials.

Every tokenizer carries a `Specials`: the id that fills padding, BOS, the end-of-sequence and
end-of-turn ids (generation stops at any of `stop`), and the ids whose slots encoder rows fill
(one per image / clip row). The byte tokenizer and a bare tokenizer.json use jaxmllm's reserved
ids 256..263 below; a HuggingFace tokenizer directory uses the checkpoint's own
(`jaxmllm.data.text.pretrained`).
"""

from __future__ import annotations

from dataclasses import dataclass

# jaxmllm's reserved specials (byte tokenizer, bare tokenizer.json): ids 256..263.
PAD, BOS, EOS, IMAGE, AUDIO, USER, ASSISTANT = 256, 257, 258, 259, 260, 261, 262
NUM_SPECIAL = 8  # ids 256..263 are reserved; byte vocab needs vocab_size >= 264


@dataclass(frozen=True)
class Specials:
    """The ids a tokenizer gives the batch contract and generation.

    `pad` fills the unused slots of a bucket (never a target, never attended to); `bos` starts a
    sequence (None: the tokenizer has none); `eos` ends one; `stop` are the ids that end a turn
    or a sequence (eos first), where generation stops; `image` / `audio` fill the slots of an
    image's / clip's encoder rows, so they never occur in text.
    """

    pad: int
    bos: int | None
    eos: int
    stop: tuple[int, ...]
    image: int
    audio: int

    def __post_init__(self):
        # bucketize finds encoder slots by these values: no other role may share them.
        others = {self.pad, self.eos, *self.stop} | ({self.bos} if self.bos is not None else set())
        if self.image == self.audio or {self.image, self.audio} & others:
            raise ValueError(
                f"the image and audio ids must differ from each other and the rest: {self}"
            )


RESERVED = Specials(pad=PAD, bos=BOS, eos=EOS, stop=(EOS,), image=IMAGE, audio=AUDIO)
