"""Documents and preference pairs in a bucket's rows: a sample may hold several documents
(`Sample.documents`: a pair's chosen and rejected), each its own segment; a pair's tokens say
which pair of their bucket and which side they are (`llm_sequence`)."""

from __future__ import annotations

import numpy as np

from jaxmllm.data.samples import Sample


def documents_of(loaded: list[Sample]) -> list[np.ndarray]:
    """Each sample's documents' lengths (one document: its tokens)."""
    return [np.asarray(x.documents or (len(x.tokens),), np.int64) for x in loaded]


def document_segments(key: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The segment id of each document of samples in plan order (`count` documents each): 1, 2,
    ... per row (`key`: a sample's row, or its context group's), in plan order."""
    order = np.argsort(key, kind="stable")
    ends = np.cumsum(count[order])
    group_start = np.searchsorted(key[order], key[order])  # first of its row, in `order`
    before = np.concatenate([[0], ends])[group_start]  # documents of the rows before it
    first = np.empty(len(key), np.int64)
    first[order] = ends - count[order] - before + 1  # the sample's first document's id
    return np.concatenate([f + np.arange(c) for f, c in zip(first, count, strict=True)])


def pair_slots(bucket_key: np.ndarray) -> np.ndarray:
    """Each written pair's slot k in its (microbatch, bucket) (`bucket_key`, in plan order):
    0, 1, ... in plan order within a bucket."""
    order = np.argsort(bucket_key, kind="stable")
    rank = np.empty(len(bucket_key), np.int64)
    sorted_key = bucket_key[order]
    rank[order] = np.arange(len(order)) - np.searchsorted(sorted_key, sorted_key)
    return rank


def write_sequences(text, loaded, docs, bucket_key: np.ndarray, flat: np.ndarray) -> None:
    """Preference pairs: each token's sequence in its (microbatch, bucket), 2k for the chosen
    document of the bucket's k-th pair and 2k + 1 for its rejected one (-1: no pair's), and
    each bucket's count of pairs (`llm_pairs`). A pair is one sample, so both its sequences
    sit in one row of one bucket: the loss sums them there, with no exchange."""
    is_pair = np.array([x.is_pair for x in loaded], bool)
    key = np.where(is_pair, bucket_key, -1)  # (a sample of one document: no pair, -1; the
    rank = pair_slots(key)  # data layer refuses SFT data under dpo, generation's prompts pass)
    seq = [
        2 * k + np.repeat([0, 1], d) if pair else np.full(int(d.sum()), -1)
        for k, d, pair in zip(rank.tolist(), docs, is_pair.tolist(), strict=True)
    ]
    text["llm_sequence"].reshape(-1)[flat] = np.concatenate(seq)
    pairs = text["llm_pairs"].reshape(-1)
    np.add.at(pairs, bucket_key[is_pair], 1)
