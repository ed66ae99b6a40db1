"""The token ids the data layer needs from a tokenizer, and jaxmllm's own reserved specials.

Every tokenizer carries a `Specials`: the id that fills padding, BOS, the end-of-sequence and
end-of-turn ids (generation stops at any of `stop`), and per kind of media the id whose slots
its encoder rows fill (one per image / video / clip row). The byte tokenizer and a bare
tokenizer.json use jaxmllm's reserved ids 256..263 below (each kind's `reserved_id`); a
HuggingFace tokenizer directory uses the checkpoint's own (`jaxmllm.data.text.pretrained`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from jaxmllm.config.data import BYTE_VOCAB
from jaxmllm.config.phases import KIND, KINDS

# jaxmllm's reserved specials (byte tokenizer, bare tokenizer.json): ids 256..263; the kinds of
# media's placeholders are theirs (`Kind.reserved_id`: image 259, audio 260, video 263).
PAD, BOS, EOS, USER, ASSISTANT = 256, 257, 258, 261, 262
NUM_SPECIAL = BYTE_VOCAB - 256  # ids 256..263 are reserved


@dataclass(frozen=True)
class Specials:
    """The ids a tokenizer gives the batch contract and generation.

    `pad` fills the unused slots of a bucket (never a target, never attended to); `bos` starts a
    sequence (None: the tokenizer has none); `eos` ends one; `stop` are the ids that end a turn
    or a sequence (eos first), where generation stops; `media[kind]` fills the slots of an
    item's encoder rows, so it never occurs in text: every kind of the table but those of a
    phase the model has no tower for where the tokenizer has no token of its own (no row is
    added for a placeholder nothing fills). Kinds of one phase may share an id (a checkpoint
    with no video token of its own places videos with its image token); kinds of different
    phases may not.
    """

    pad: int
    bos: int | None
    eos: int
    stop: tuple[int, ...]
    media: Mapping[str, int]

    def __post_init__(self):
        unknown = sorted(set(self.media) - set(KIND))
        if unknown:
            raise ValueError(f"no kind of media is named {unknown}")
        # bucketize finds a phase's slots by these values: no other role may share them.
        others = {self.pad, self.eos, *self.stop} | ({self.bos} if self.bos is not None else set())
        by_phase: dict[int, set[str]] = {}
        for name, i in self.media.items():
            by_phase.setdefault(i, set()).add(KIND[name].phase)
        if any(len(p) > 1 for p in by_phase.values()) or set(by_phase) & others:
            raise ValueError(
                "the media placeholder ids must differ from the rest, and between kinds of "
                f"different encoder phases: {self}"
            )

    def phase_of(self, token: int) -> str | None:
        """The encoder phase whose placeholder `token` is (None: not a placeholder)."""
        for k, i in self.media.items():
            if i == token:
                return KIND[k].phase
        return None

    def phase_ids(self, phase: str) -> list[int]:
        """The placeholder ids whose slots an encoder phase's rows fill (its kinds')."""
        return sorted({i for k, i in self.media.items() if KIND[k].phase == phase})


RESERVED = Specials(
    pad=PAD, bos=BOS, eos=EOS, stop=(EOS,), media={k.name: k.reserved_id for k in KINDS}
)
