"""The built-in data's preference pairs (`train.objective: dpo`): a wrong answer for every
sample, drawn from (seed, index) alone, for one sample at a time (`SyntheticSource[i]`) and
for all at once (its lengths) by the same arithmetic.

A sample's twist (`twists`, splitmix64's mix of the seed and its index) says which words of
its answer are wrong and what they become: another colour and/or shape for one of its images,
another pitch and/or contour for a clip (`wrong_names`); a video's is its other way, a
counting run's one digit more (`text_pair`).
"""

from __future__ import annotations

import numpy as np

from jaxmllm.data.samples import Sample


def twists(seed: int, ids: np.ndarray) -> np.ndarray:
    """A non-negative number per sample, from (seed, its index) alone, that says how its
    rejected answer is wrong (splitmix64's mix of both; uint64 arithmetic wraps)."""
    x = np.asarray(ids, np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed % 2**64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return ((x ^ (x >> np.uint64(31))) >> np.uint64(2)).astype(np.int64)


def wrong_names(twist, a, b, names_a, names_b) -> tuple[np.ndarray, np.ndarray]:
    """Per sample, other names for a and/or b (numbers of `names_a`, `names_b`): the twist
    changes a, b or both (twist % 3), each to one of the others (by further bits)."""
    mode = twist % 3
    other_a = (a + 1 + (twist >> 8) % (len(names_a) - 1)) % len(names_a)
    other_b = (b + 1 + (twist >> 16) % (len(names_b) - 1)) % len(names_b)
    return np.where(mode != 1, other_a, a), np.where(mode != 0, other_b, b)


def wrong_images(images, n_images, twist, colours, shapes) -> tuple[np.ndarray, np.ndarray]:
    """Per sample, its two image slots' colour and shape numbers (`images[:, slot, 2:4]`)
    with one image's (of its `n_images`, by the twist) wrong (`wrong_names`)."""
    colour, shape = images[:, :, 2].astype(np.int64), images[:, :, 3].astype(np.int64)
    rows = np.arange(len(images))
    k = (twist >> 24) % np.maximum(n_images, 1)
    colour[rows, k], shape[rows, k] = wrong_names(
        twist, colour[rows, k], shape[rows, k], colours, shapes
    )
    return colour, shape


def text_pair(i: int, tokens: np.ndarray) -> Sample:
    """A counting run's (BOS, run, EOS) pair: the prompt BOS and the first number with its
    space (BOS alone where nothing would follow them), the rest of the run and EOS chosen, the
    same with its last digit one more (mod 10) rejected (every number after the first follows
    from it: the rejected run is wrong)."""
    run = tokens[1:-1]
    space = np.flatnonzero(run == ord(" "))
    start = 1 + (int(space[0]) + 1 if len(space) and space[0] + 1 < len(run) else 0)
    loss = np.arange(len(tokens)) >= start
    wrong = tokens.copy()
    digits = np.flatnonzero((tokens[start:-1] >= ord("0")) & (tokens[start:-1] <= ord("9")))
    j = start + int(digits[-1])  # (the run after the prompt always holds a digit)
    wrong[j] = ord("0") + (wrong[j] - ord("0") + 1) % 10
    both = np.concatenate([tokens, wrong]).astype(np.int32)
    n = len(tokens)
    return Sample(id=i, tokens=both, loss=np.concatenate([loss, loss]), documents=(n, n))
