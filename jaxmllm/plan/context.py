"""Context parallelism's split of an LLM bucket: a group's query blocks dealt to its devices.

With `Capacities.context` = C > 1 an LLM bucket is a context group of C devices, whose rows are
C times a device's (`Capacities.group_row_len`). Its rows' blocks of `block` tokens are dealt to
the C devices ("ranks"), each rank the same number of blocks (a device's `llm_rows x
llm_row_len` tokens: fixed shapes), and each rank computes the attention tiles of the query
blocks it holds, against the keys and values of the whole group (gathered every layer). So a
rank's work is the tiles of its query blocks, and the split should give every rank the same
tiles:

- `deal` (ours): blocks by tiles, largest first, in rounds of C blocks, the largest of a round
  to the least-loaded rank (every rank one block a round: equal counts), then swaps of a block
  of the most loaded rank for a lighter one of another rank while that lowers the most. A
  round never widens the ranks' spread past its own (its blocks' largest minus smallest): the
  rank it gives the most was the least loaded. A group's blocks step down by at most one tile
  (`contract.llm_deal_slack`), so no rank ends more than C tiles above another, nor above the
  group's mean plus C; a swap never raises the most.
- `uniform`: each row cut into C contiguous chunks (the plain sequence split);
- `zigzag`: each row cut into 2C chunks, rank c taking chunks c and 2C - 1 - c (MaxText's
  load-balanced reorder of one causal sequence; it ignores packed documents).

A rank lays its blocks out in ascending order (`layout`); tile lists name (a rank's local query
block, a key block of the gathered group: rank * blocks a rank + its local block), `rank_tiles`.
Pure numpy and deterministic (stable sorts only), like the rest of the planner.
"""

from __future__ import annotations

import numpy as np

from jaxmllm.config.phases import LLM
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.plan.contract import Capacities, StepPlan, phase_docs
from jaxmllm.plan.tiles import PAD, tile_list

SWAP_ROUNDS = 4  # swaps per rank, at most, after the rounds (each lowers the most loaded rank)
SPLITS = ("uniform", "zigzag", "ours")  # the splits `split` knows, as the bench names them


def block_weights(tiles_k2: np.ndarray, blocks: int) -> np.ndarray:
    """Tiles of each query block (int64 [blocks]) of a tile list [K, 2] (padding -1 ignored)."""
    q = tiles_k2[:, 0]
    return np.bincount(q[q >= 0], minlength=blocks).astype(np.int64)


def deal(weights: np.ndarray, ranks: int, swaps: int = SWAP_ROUNDS) -> np.ndarray:
    """The rank of each block (int64 [blocks]): equal counts, tiles balanced (module doc).

    Args:
      weights: tiles of each query block; len(weights) a multiple of `ranks`.
      ranks: the group's devices.
      swaps: swap rounds per rank after the dealing rounds.
    """
    n = len(weights)
    if n % ranks:
        raise ValueError(f"{n} blocks do not deal evenly to {ranks} ranks")
    owner = np.empty(n, np.int64)
    if ranks == 1:
        owner[:] = 0
        return owner
    order = np.argsort(-weights, kind="stable").reshape(-1, ranks)  # rounds, largest first
    load = np.zeros(ranks, np.int64)
    for blocks in order:  # (each round's blocks are in descending order)
        least = np.argsort(load, kind="stable")
        owner[blocks] = least
        load[least] += weights[blocks]
    return _swap(weights, owner, load, ranks * swaps)


def _swap(weights: np.ndarray, owner: np.ndarray, load: np.ndarray, rounds: int) -> np.ndarray:
    """Swaps a block of the most loaded rank for a lighter one of another rank, the pair that
    leaves the lower of the two new loads' maximum, while that is below the most."""
    for _ in range(rounds):
        top = int(np.argmax(load))
        mine = np.flatnonzero(owner == top)
        w_mine, at_mine = np.unique(weights[mine], return_index=True)
        best = (int(load[top]), -1, -1)
        for other in np.flatnonzero(load < load[top]).tolist():
            theirs = np.flatnonzero(owner == other)
            w_theirs, at_theirs = np.unique(weights[theirs], return_index=True)
            gap = int(load[top] - load[other])
            moved = w_mine[:, None] - w_theirs[None, :]  # what the swap moves from top
            worst = np.maximum(load[top] - moved, load[other] + moved)
            worst = np.where((moved > 0) & (moved < gap), worst, np.iinfo(np.int64).max)
            i, j = np.unravel_index(int(np.argmin(worst)), worst.shape)
            if worst[i, j] < best[0]:
                best = (int(worst[i, j]), int(mine[at_mine[i]]), int(theirs[at_theirs[j]]))
        if best[1] < 0:
            break
        a, b = best[1], best[2]
        other = int(owner[b])
        moved = int(weights[a] - weights[b])
        owner[a], owner[b] = other, top
        load[top] -= moved
        load[other] += moved
    return owner


def uniform(rows: int, row_blocks: int, ranks: int) -> np.ndarray:
    """The rank of each block of `rows` rows of `row_blocks` blocks: contiguous chunks a row."""
    if row_blocks % ranks:
        raise ValueError(f"a row of {row_blocks} blocks does not split into {ranks} chunks")
    return np.tile(np.arange(row_blocks) * ranks // row_blocks, rows).astype(np.int64)


def zigzag(rows: int, row_blocks: int, ranks: int) -> np.ndarray:
    """The rank of each block: each row in 2 x ranks chunks, rank c holding chunks c and
    2 ranks - 1 - c (MaxText's reorder for a causal sequence)."""
    if row_blocks % (2 * ranks):
        raise ValueError(f"a row of {row_blocks} blocks does not split into {2 * ranks} chunks")
    chunk = np.arange(row_blocks) * 2 * ranks // row_blocks
    return np.tile(np.minimum(chunk, 2 * ranks - 1 - chunk), rows).astype(np.int64)


def split(name: str, weights: np.ndarray, rows: int, ranks: int) -> np.ndarray:
    """The rank of each block of a group's `rows` rows (`weights`: tiles per block) under the
    split called `name` (`SPLITS`)."""
    row_blocks = len(weights) // rows
    if name == "uniform":
        return uniform(rows, row_blocks, ranks)
    if name == "zigzag":
        return zigzag(rows, row_blocks, ranks)
    if name == "ours":
        return deal(weights, ranks)
    raise ValueError(f"unknown split {name!r}: one of {', '.join(SPLITS)}")


def rank_loads(weights: np.ndarray, owner: np.ndarray, ranks: int) -> np.ndarray:
    """Tiles each rank computes under a split (int64 [ranks])."""
    return np.bincount(owner, weights, ranks).astype(np.int64)


def layout(owner: np.ndarray, ranks: int) -> np.ndarray:
    """[ranks, blocks a rank]: the blocks each rank holds, ascending (a rank's local order)."""
    return np.argsort(owner, kind="stable").reshape(ranks, -1)


def rank_tiles(tiles_k2: np.ndarray, owner: np.ndarray, ranks: int, capacity: int) -> np.ndarray:
    """Each rank's tile list [ranks, capacity, 2] of a group's tiles (query block, key block
    numbered over the group's rows): (the rank's local query block, the key block in the
    gathered group: its rank * blocks a rank + its local block), sorted, padded with PAD.

    Raises:
      ValueError: a rank would need more than `capacity` tiles (`.need`, `.rank` say which).
    """
    per_rank = len(owner) // ranks
    local = np.empty(len(owner), np.int64)
    local[layout(owner, ranks).ravel()] = np.tile(np.arange(per_rank), ranks)
    q, k = tiles_k2[:, 0], tiles_k2[:, 1]
    rank = owner[q]
    q_local, k_all = local[q], owner[k] * per_rank + local[k]
    order = np.lexsort((k_all, q_local, rank))
    count = np.bincount(rank, minlength=ranks)
    if count.max(initial=0) > capacity:
        worst = int(np.argmax(count))
        err = ValueError(f"rank {worst} needs {int(count[worst])} tiles, over {capacity}")
        err.need, err.rank = int(count[worst]), worst  # type: ignore[attr-defined]
        raise err
    out = np.full((ranks, capacity, 2), PAD, np.int32)
    slot = np.arange(len(q)) - np.repeat(np.cumsum(count) - count, count)
    out[rank[order], slot, 0] = q_local[order]
    out[rank[order], slot, 1] = k_all[order]
    return out


def group_weights(plan: StepPlan, index: LengthsIndex, caps: Capacities) -> dict:
    """Per (microbatch, group) of a plan, the tiles of each query block of the group's rows
    (blocks numbered row by row), from the lengths index: what the bench deals."""
    micro, group, row, off, size = phase_docs(plan, index, caps, LLM)
    row_blocks = caps.group_row_len // caps.attention_block
    out = {}
    for m in range(caps.microbatches):
        for g in range(caps.llm_buckets):
            sel = (micro == m) & (group == g)
            tiles = tile_list(off[sel], size[sel], row[sel], row_blocks, caps.attention_block, True)
            out[m, g] = block_weights(tiles, caps.llm_rows * row_blocks)
    return out
