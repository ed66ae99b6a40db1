"""Bucketize's context split: each context group's LLM rows dealt to its devices.

With `mesh.context` = C > 1 the planner places text on context groups (`Capacities.context`):
bucketize writes a group's samples into group rows [M, groups, R, C x L] (`group_text`), then
`Split.deal` deals each group's query blocks to its C devices (`jaxmllm.plan.context.deal`:
equal blocks, tiles balanced, from the tiles its documents need), moves the tokens with their
positions, segment ids, targets and loss mask into each device's [R, L] rows (its blocks in
ascending order), writes each device's tile list (its query blocks against the gathered
group's key blocks; and the sliding-window layers' own, the tiles of those a window reaches),
and says where a token of a group row now lies (`Split.where`), which the routing tables need;
under ulysses, each device's blocks' indices in the group's rows (`llm_blocks`), which put the
group's tokens back in order for the layers that read them in order.
The loss is a sum over tokens, so nothing is put back in order.

Segment ids count 1, 2, ... over a group's rows (not per row): a device holds blocks of several
of them, and the segments name documents across them.
"""

from __future__ import annotations

import numpy as np

from jaxmllm.plan.context import block_weights, deal, rank_tiles
from jaxmllm.plan.contract import Capacities
from jaxmllm.plan.tiles import segment_tiles

# (llm_order: with M-RoPE, each token's index in its document, which the split's causal mask
# reads; the positions [..., 3] then are the rotary ones alone)
TEXT = ("llm_tokens", "llm_segment_ids", "llm_positions", "llm_targets", "llm_loss_mask")
TEXT += ("llm_order",)


def group_text(batch: dict[str, np.ndarray], caps: Capacities, pad: int) -> dict[str, np.ndarray]:
    """Empty group rows [M, groups, R, C x L, ...] for the text arrays of a host batch whose
    device axis holds whole groups (padding: `pad` tokens, the tokenizer's; zeros)."""
    m_n, d_n, r_n, _ = batch["llm_tokens"].shape
    shape = (m_n, d_n // caps.context, r_n, caps.group_row_len)
    out = {k: np.zeros(shape + batch[k].shape[4:], batch[k].dtype) for k in TEXT if k in batch}
    out["llm_tokens"][:] = pad
    return out


def local_groups(local: np.ndarray, context: int) -> np.ndarray:
    """Per group, its index among this host's groups (-1: another host's), from `local` (per
    device, its index in this host's batch, -1 elsewhere).

    Raises:
      ValueError: a host holds part of a group (keep mesh.context within a host).
    """
    per_group = local.reshape(-1, context)
    whole = (per_group >= 0).all(1)
    if ((per_group >= 0).any(1) != whole).any() or (
        whole.any() and (per_group[whole] != per_group[whole][:, :1] + np.arange(context)).any()
    ):
        raise ValueError(
            f"a host holds part of a context group of {context} devices: mesh.context must "
            "divide a host's devices (the mesh keeps its groups within a host)"
        )
    return np.where(whole, per_group[:, 0] // context, -1)


class Split:
    """Where each group's blocks went: `owner` [M, groups, blocks] (rank), `slot` (its block in
    the rank's rows)."""

    def __init__(self, owner: np.ndarray, caps: Capacities):
        self.owner, self.caps = owner, caps
        blocks = owner.shape[-1]
        # per group, its blocks rank by rank, each rank's ascending (`plan.context.layout`)
        self.order = np.argsort(owner, axis=-1, kind="stable")
        self.slot = np.empty_like(owner)
        per = np.tile(np.arange(blocks // caps.context), caps.context)
        np.put_along_axis(self.slot, self.order, np.broadcast_to(per, owner.shape), axis=-1)

    @classmethod
    def deal(
        cls,
        text: dict,
        batch: dict,
        caps: Capacities,
        tile_cap: int,
        step: int,
        groups: np.ndarray,
        reach: int | None = None,
    ) -> Split:
        """Deals every group of `text` (`group_text`, filled) to its devices: their rows and
        tile lists into `batch`. `groups`: global index of each of the host's groups; `reach`:
        the sliding-window layers' (`plan.tiles.window_reach`), whose own lists
        (`llm_window_tiles`, where the batch has them) go with the same blocks: a rank's
        windowed tiles are some of its causal ones, so they fit (`rank_window_capacity`)."""
        seg = text["llm_segment_ids"]
        m_n, g_n, r_n, bin_len = seg.shape
        c_n, block = caps.context, caps.attention_block
        blocks = r_n * bin_len // block
        rows = seg.reshape(m_n * g_n, r_n, bin_len)
        tiles, bucket = segment_tiles(rows, block, True)
        starts = np.searchsorted(bucket, np.arange(m_n * g_n + 1))
        owner = np.empty((m_n * g_n, blocks), np.int64)
        lists = batch["llm_tiles"].reshape(m_n * g_n, c_n, tile_cap, 2)
        narrow = "llm_window_tiles" in batch and reach is not None
        if narrow:  # (the blocks are dealt by their causal tiles: what the capacity holds)
            w_tiles, w_bucket = segment_tiles(rows, block, True, reach)
            w_starts = np.searchsorted(w_bucket, np.arange(m_n * g_n + 1))
            w_cap = batch["llm_window_tiles"].shape[2]
            w_lists = batch["llm_window_tiles"].reshape(m_n * g_n, c_n, w_cap, 2)
        for i in range(m_n * g_n):
            t = tiles[starts[i] : starts[i + 1]]
            owner[i] = deal(block_weights(t, blocks), c_n)
            try:
                lists[i] = rank_tiles(t, owner[i], c_n, tile_cap)
            except ValueError as e:
                m, g = divmod(i, g_n)
                raise ValueError(
                    f"step {step}: microbatch {m}, context group {int(groups[g])}: device "
                    f"{int(groups[g]) * c_n + e.rank} needs {e.need} llm attention tiles, more "
                    f"than batch.llm_tiles={tile_cap}; raise it (or -1: sized from the data)"
                ) from None
            if narrow:  # (never over: `window_tile_cap`, and the causal list just fit)
                window = w_tiles[w_starts[i] : w_starts[i + 1]]
                w_lists[i] = rank_tiles(window, owner[i], c_n, w_cap)
        split = cls(owner.reshape(m_n, g_n, blocks), caps)
        order = split.order.reshape(m_n * g_n, blocks)
        if "llm_blocks" in batch:  # (ulysses: where in the group's rows each block lies)
            batch["llm_blocks"][:] = split.order.reshape(batch["llm_blocks"].shape)
        for key in text:
            rest = text[key].shape[4:]  # (M-RoPE's positions: time, row, column)
            x = text[key].reshape(m_n * g_n, blocks, block, *rest)
            at = order.reshape(order.shape + (1,) * (1 + len(rest)))
            moved = np.take_along_axis(x, at, axis=1)
            batch[key][:] = moved.reshape(batch[key].shape)
        return split

    def where(self, m: int, g: int, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens at `flat` (index into group `g`'s rows flattened; g among this host's
        groups) of microbatch `m`: (this host's device, index into its rows flattened)."""
        block, inner = np.divmod(flat, self.caps.attention_block)
        device = g * self.caps.context + self.owner[m, g, block]
        return device, self.slot[m, g, block] * self.caps.attention_block + inner
