"""A preprocessed sample: token ids, loss mask and its encoder inputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Sample:
    """One preprocessed sample, ready to be bucketized.

    `tokens` holds the whole LLM sequence with one IMAGE (AUDIO) id per encoder output row of
    each image (clip), in order. `loss[t]` says whether token t is a prediction target.
    """

    id: int
    tokens: np.ndarray  # int32 [T]
    loss: np.ndarray  # bool [T]
    images: list[tuple[np.ndarray, np.ndarray]] = field(
        default_factory=list
    )  # (patches_pd, pos_p2)
    audio: list[np.ndarray] = field(default_factory=list)  # frames [f, n_mels]
    # Each image's patch grid (rows, cols), known from the layout even where another host
    # decodes its pixels: M-RoPE places the image's tokens on it
    grids: list[tuple[int, int]] = field(default_factory=list)
