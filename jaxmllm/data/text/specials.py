"""The token ids the data layer needs from a tokenizer, and jaxmllm's own reserved specials.

Every tokenizer carries a `Specials`: the id that fills padding, BOS, the end-of-sequence and
end-of-turn ids (generation stops at any of `stop`), and per encoder phase the id whose slots its
encoder rows fill (one per image / clip row). The byte tokenizer and a bare tokenizer.json use
jaxmllm's reserved ids 256..263 below (each phase's `reserved_id`); a HuggingFace tokenizer
directory uses the checkpoint's own (`jaxmllm.data.text.pretrained`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from jaxmllm.config.phases import ENCODERS, NAMES

# jaxmllm's reserved specials (byte tokenizer, bare tokenizer.json): ids 256..263; the encoder
# phases' placeholders are theirs (`Phase.reserved_id`: 259, 260, and 263 free for one more).
PAD, BOS, EOS, USER, ASSISTANT = 256, 257, 258, 261, 262
NUM_SPECIAL = 8  # ids 256..263 are reserved; byte vocab needs vocab_size >= 264


@dataclass(frozen=True)
class Specials:
    """The ids a tokenizer gives the batch contract and generation.

    `pad` fills the unused slots of a bucket (never a target, never attended to); `bos` starts a
    sequence (None: the tokenizer has none); `eos` ends one; `stop` are the ids that end a turn
    or a sequence (eos first), where generation stops; `media[phase]` fills the slots of an
    item's encoder rows in that phase (every phase of the table), so it never occurs in text.
    """

    pad: int
    bos: int | None
    eos: int
    stop: tuple[int, ...]
    media: Mapping[str, int]

    def __post_init__(self):
        missing = [p for p in NAMES if p not in self.media]
        if missing:
            raise ValueError(f"no placeholder id for the encoder phase(s) {missing}")
        # bucketize finds encoder slots by these values: no other role may share them.
        others = {self.pad, self.eos, *self.stop} | ({self.bos} if self.bos is not None else set())
        ids = [self.media[p] for p in NAMES]
        if len(set(ids)) != len(ids) or set(ids) & others:
            raise ValueError(
                f"the media placeholder ids must differ from each other and the rest: {self}"
            )

    def phase_of(self, token: int) -> str | None:
        """The encoder phase whose placeholder `token` is (None: not a placeholder)."""
        for p, i in self.media.items():
            if i == token:
                return p
        return None


RESERVED = Specials(
    pad=PAD, bos=BOS, eos=EOS, stop=(EOS,), media={p.name: p.reserved_id for p in ENCODERS}
)
