"""Preference pairs for the tests, made from the built-in data: each synthetic sample's prompt
with its own answer as the chosen completion and the answer's bytes reversed as the rejected one
(a pair the data layer would build: its media once, its placeholders in both documents; the
lengths index's row counts one copy of them, `jaxmllm.data.samples.Sample.documents`)."""

from __future__ import annotations

import numpy as np

from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.data.samples import Sample


def pair_of(sample: Sample) -> Sample:
    """`sample` as a pair: chosen its tokens, rejected the same with the learned run reversed
    (its last token, EOS, kept in place)."""
    learned = np.flatnonzero(sample.loss)
    rejected = sample.tokens.copy()
    body = learned[:-1] if len(learned) > 1 else learned
    rejected[body] = sample.tokens[body][::-1]
    if (rejected == sample.tokens).all():  # (a palindrome: change a byte)
        rejected[body[0]] = (int(rejected[body[0]]) + 1) % 256
    n = len(sample.tokens)
    return Sample(
        id=sample.id,
        tokens=np.concatenate([sample.tokens, rejected]),
        loss=np.concatenate([sample.loss, sample.loss]),
        media=sample.media,
        grids=sample.grids,
        documents=(n, n),
    )


def document(pair: Sample, side: int) -> Sample:
    """One document of a pair, as a sample of its own (its media again)."""
    n = pair.documents[0]
    cut = slice(0, n) if side == 0 else slice(n, None)
    return Sample(pair.id, pair.tokens[cut], pair.loss[cut], pair.media, pair.grids)


class PairSource:
    """A source's samples as pairs, and its lengths index with each pair's row (`split`:
    where it splits, both documents n tokens; `split=False`: the row without it, a pair priced
    as one document of 2n tokens, as the planner priced pairs before the index said)."""

    def __init__(self, source, index: LengthsIndex, split: bool = True):
        self.source = source
        records = [index.record(i) for i in range(len(index))]
        for i, r in enumerate(records):  # text: both documents less one copy of the slots
            n = len(source[i].tokens)  # (n tokens = text + slots; a pair's 2n)
            r["text"] += n
            if split:
                r["split"] = n
        self.index = LengthsIndex.from_records(records)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Sample:
        return pair_of(self.source[int(i)])
