"""What the balancer works on: each sample's work per phase, and one microbatch's buckets while
they are being filled.

Phases are numbered as in a work vector: 0 = the LLM (tokens), 1 = vision (patches),
2 = audio (frames); `ENC` names the encoder phases.
"""

from __future__ import annotations

import numpy as np

from jaxmllm.data.samples import LengthsIndex
from jaxmllm.plan.bins import Cost, Loads, quad_cost, tile_cost
from jaxmllm.plan.contract import Capacities
from jaxmllm.plan.route import Routes
from jaxmllm.plan.tilecap import TileBudget

ENC = ("vision", "audio")


class Phases:
    """The index's work per sample and phase, and the per-device capacities it must fit."""

    def __init__(self, index: LengthsIndex, caps: Capacities):
        self.caps = caps
        self.llm = index.llm_tokens(caps.merge_area, caps.subsample)  # LLM tokens per sample
        self.sizes = {"vision": index.images, "audio": index.audio}  # per item
        self.ptr = {"vision": index.images_ptr, "audio": index.audio_ptr}  # items of a sample
        self.per_row = {"vision": caps.merge_area, "audio": caps.subsample}  # units per row
        self.cap = {"vision": caps.vision_patches, "audio": caps.audio_frames}  # per device
        self.work = np.stack(
            [
                self.llm,
                index.per_sample_sum(index.images, index.images_ptr),
                index.per_sample_sum(index.audio, index.audio_ptr),
            ],
            1,
        )  # [sample, phase]
        self.work_t = np.ascontiguousarray(self.work.T)  # [phase, sample], for fast columns
        self.cap_vec = np.array(
            [caps.llm_rows * caps.llm_row_len, caps.vision_patches, caps.audio_frames], np.int64
        )  # [phase]: units per device and microbatch
        # What the packers equalise: attention tiles with block-sparse attention, size**2 else
        self.cost: dict[str, Cost] = {p: quad_cost for p in ("llm", *ENC)}
        if caps.block:
            self.cost = {
                "llm": tile_cost(caps.block, True),
                "vision": tile_cost(caps.block, False),
                "audio": tile_cost(caps.block, False, caps.subsample),
            }


class Micro:
    """Bucket loads and placements of one microbatch while it is being filled."""

    def __init__(self, caps: Capacities, cost: dict[str, Cost] | None = None):
        cost = cost or {p: quad_cost for p in ("llm", *ENC)}
        # per LLM row (device * rows + row), per device for the encoders
        self.rows = Loads.zeros(caps.devices * caps.llm_rows, cost["llm"])
        self.enc = {p: Loads.zeros(caps.devices, cost[p]) for p in ENC}
        # exact attention tiles per device and phase, within their capacity (block-sparse)
        self.tiles = TileBudget(caps) if caps.block else None
        z = np.zeros(0, np.int64)
        self.entries: list[np.ndarray] = [z]  # pool positions placed, in order
        self.row_bin: list[np.ndarray] = [z]  # their LLM row bin (device * rows + row)
        # per phase: (owner entry, item number, size, device) of placed items
        self.items: dict[str, list[tuple[np.ndarray, ...]]] = {p: [] for p in ENC}
        self.routes = {
            "vision": Routes(
                caps.devices, caps.merge_area, caps.route_pair_capacity, caps.vision_patches
            ),
            "audio": Routes(
                caps.devices, caps.subsample, caps.route_pair_capacity, caps.audio_frames
            ),
        }

    def used(self) -> np.ndarray:
        """Units placed in each phase (llm, vision, audio), over all devices."""
        enc = self.enc
        return np.array(
            [self.rows.units.sum(), enc["vision"].units.sum(), enc["audio"].units.sum()]
        )
