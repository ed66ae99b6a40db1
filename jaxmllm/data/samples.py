"""A preprocessed sample: token ids, loss mask and its encoder inputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxmllm.config.phases import NAMES

# One encoder item's inputs: (values [n units, input width], positions [n] or [n, 2]) — an
# image's patches and their (row, column), a video's temporal patch (its frames side by side
# per patch), a clip's log-mel frames and their indices. None in a sample where another host
# encodes the item (its units are in the lengths index).
Item = tuple[np.ndarray, np.ndarray]


@dataclass
class Sample:
    """One preprocessed sample, ready to be bucketized.

    `tokens` holds the whole LLM sequence with one placeholder id per encoder output row of each
    item, in order (`Specials.media[kind]`). `loss[t]` says whether token t is a prediction
    target. `media[phase]` lists the phase's items in the order their placeholders come
    (`jaxmllm.config.phases`: every phase of the table, empty where the sample has none; the
    vision phase's hold images and videos' temporal patches).
    """

    id: int
    tokens: np.ndarray  # int32 [T]
    loss: np.ndarray  # bool [T]
    media: dict[str, list[Item | None]] = field(default_factory=dict)
    # Each image's or video's grid (temporal patches, rows, cols) in patches, in order, known
    # from the layout even where another host decodes its pixels: M-RoPE places its tokens on
    # it (an image: one temporal patch); a video placed in absolute time (Qwen2.5-VL) adds its
    # time step per temporal patch: (t, rows, cols, step), `batch.bucketize.mrope_positions`
    grids: list[tuple] = field(default_factory=list)
    # How its videos were read: {"cache_hit": n, "decoded": n, "decoded_<why>": n} (the frame
    # cache's misses by reason, `data.frame_store.MISSES`); the loader sums them as metrics
    frames: dict[str, int] = field(default_factory=dict)
    # The documents `tokens` holds, as their lengths in order (they sum to len(tokens)); empty:
    # one document. A preference pair is two: the prompt and its chosen completion, then the
    # prompt and its rejected one (`loss` marks the completions' tokens only); a GRPO group is
    # G: the prompt and each of its completions. Its media are listed once (encoded once) and
    # their placeholder rows come in every document, in the same order: the rows of each item
    # fill every document's slots. Each document attends only to itself, its positions start at
    # 0, and its last token predicts nothing.
    documents: tuple[int, ...] = ()
    # A rollout's completions (`train.objective: grpo`): each document's advantage (its
    # completion's, in its group), written on each of its tokens (`llm_advantage`); a number:
    # the one document's; None for every other sample
    advantage: float | tuple[float, ...] | None = None

    def __post_init__(self):
        self.media = {p: list(self.media.get(p, [])) for p in NAMES}
        if self.documents and sum(self.documents) != len(self.tokens):
            raise ValueError(
                f"sample {self.id}: documents of {list(self.documents)} tokens, "
                f"{len(self.tokens)} tokens"
            )

    @property
    def is_pair(self) -> bool:
        """Whether this is a preference pair (chosen, then rejected)."""
        return len(self.documents) == 2

    def keep_only(self, keep: dict[str, tuple[int, ...]]) -> Sample:
        """This sample with only the items `keep[phase]` lists (by number) kept, in place; the
        others (all of a phase `keep` lacks) None: another host encodes them."""
        for p, items in self.media.items():
            self.media[p] = [m if j in keep.get(p, ()) else None for j, m in enumerate(items)]
        return self
