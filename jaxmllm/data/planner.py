"""Step planners: which sample goes to which device, microbatch, row and offset, per phase.

A planner is pure numpy and a function of (seed, step, lengths index, carried state): resuming is
recomputation from the saved state. Every planner emits the same `StepPlan`, which `bucketize`
turns into the fixed-shape batch contract; a better planner changes the plan, not the contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxmllm.config import Config
from jaxmllm.data.samples import LengthsIndex


@dataclass(frozen=True)
class Capacities:
    """Per device and per microbatch bucket sizes, in model units."""

    microbatches: int
    devices: int
    llm_rows: int
    llm_row_len: int
    vision_patches: int  # 0 when vision is disabled
    audio_frames: int  # 0 when audio is disabled
    merge_area: int  # patches per LLM token
    subsample: int  # frames per LLM token
    route_pair_capacity: int  # 0 = encoder outputs stay on the text's device

    @classmethod
    def from_config(cls, cfg: Config, devices: int) -> Capacities:
        b, m = cfg.batch, cfg.model
        if b.route_pair_capacity < 0:
            raise ValueError(
                "batch.route_pair_capacity=-1 (auto) must be resolved against the "
                "data first: jaxmllm.data.pipeline.resolve_batch"
            )
        return cls(
            microbatches=b.microbatches,
            devices=devices,
            llm_rows=b.llm_rows,
            llm_row_len=b.llm_row_len,
            vision_patches=b.vision_patches if m.vision.enabled else 0,
            audio_frames=b.audio_frames if m.audio.enabled else 0,
            merge_area=m.vision.merge**2,
            subsample=m.audio.subsample,
            route_pair_capacity=b.route_pair_capacity,
        )


@dataclass
class ItemPlan:
    """Placement of encoder items (images or clips) of the planned samples.

    owner[k] indexes StepPlan.samples; item[k] is the image/clip number within that sample;
    device[k] is the device that encodes it (may differ from the text's device when routing);
    offset[k] is its first patch/frame in that device's packed encoder row.
    """

    owner: np.ndarray
    item: np.ndarray
    device: np.ndarray
    offset: np.ndarray

    @classmethod
    def empty(cls) -> ItemPlan:
        z = np.zeros(0, np.int64)
        return cls(z, z.copy(), z.copy(), z.copy())


@dataclass
class StepPlan:
    """One step's plan. Arrays over planned samples: which, and where their text goes."""

    step: int
    samples: np.ndarray  # int64 [S] sample indices into the source / lengths index
    micro: np.ndarray  # [S] microbatch
    device: np.ndarray  # [S] device holding the sample's text (the LLM phase)
    row: np.ndarray  # [S] LLM row on that device
    offset: np.ndarray  # [S] first token in that row
    vision: ItemPlan = field(default_factory=ItemPlan.empty)
    audio: ItemPlan = field(default_factory=ItemPlan.empty)
    deferred: int = 0  # samples waiting for a later step after this plan


class OversizeError(ValueError):
    """A sample that cannot fit an empty bucket; names the sample and the capacity to raise."""


def check_fits(index: LengthsIndex, caps: Capacities) -> None:
    """Fails at start-up, naming the sample and the config key, if any sample can never fit."""
    llm = index.llm_tokens(caps.merge_area, caps.subsample)
    checks = [("batch.llm_row_len", llm, caps.llm_row_len)]
    if caps.vision_patches:
        checks.append(
            (
                "batch.vision_patches",
                index.per_sample_sum(index.images, index.images_ptr),
                caps.vision_patches,
            )
        )
    if caps.audio_frames:
        checks.append(
            (
                "batch.audio_frames",
                index.per_sample_sum(index.audio, index.audio_ptr),
                caps.audio_frames,
            )
        )
    for key, need, cap in checks:
        bad = np.flatnonzero(need > cap)
        if len(bad):
            raise OversizeError(
                f"{len(bad)} sample(s) need more than {key}={cap} (sample {int(bad[0])} needs "
                f"{int(need[bad[0]])}, the largest {int(need.max())}); raise {key} to at least "
                f"{int(need.max())}"
            )
    if not caps.vision_patches and len(index.images):
        raise OversizeError("the data has images but model.vision.enabled is false")
    if not caps.audio_frames and len(index.audio):
        raise OversizeError("the data has audio but model.audio.enabled is false")


class SampleStream:
    """The epoch-shuffled order of samples; position p is sample order(p // N)[p % N]."""

    # Epoch orders kept: those of at most KEEP_ITEMS samples in all, or 2 epochs (take()
    # drops those before its start; a large dataset's window spans one or two epochs).
    KEEP_ITEMS = 1 << 22

    def __init__(self, num_samples: int, seed: int):
        self.n, self.seed = num_samples, seed
        self._orders: dict[int, np.ndarray] = {}

    def take(self, start: int, count: int) -> np.ndarray:
        """Sample indices at stream positions start .. start+count-1."""
        out = np.empty(count, np.int64)
        done = 0
        for epoch in [e for e in self._orders if e < start // max(self.n, 1)]:
            del self._orders[epoch]  # (streams are read forward: those come back rarely)
        while done < count:  # one contiguous slice of an epoch's order at a time
            epoch, first = divmod(start + done, self.n)
            k = min(count - done, self.n - first)
            out[done : done + k] = self.order(epoch)[first : first + k]
            done += k
        return out

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of epoch `epoch`, drawn once and then kept: a planner reads a step's
        window past where it cuts it, and the next step starts there (omni, 20k samples, at
        512 devices: 17 permutations drawn in 6 steps, 25 when only the last one was kept)."""
        order = self._orders.get(epoch)
        if order is None:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._orders[epoch] = order
            while len(self._orders) > max(2, self.KEEP_ITEMS // max(self.n, 1)):
                del self._orders[min(self._orders)]
        return order


class FirstFitPlanner:
    """The simplest correct planner: fill (microbatch, device) slots in order, arrival order.

    Each sample's media is encoded on its own device. A sample that does not fit the current
    slot moves on to the next slot, so nothing is skipped or reordered; fill suffers instead.
    """

    def __init__(self, index: LengthsIndex, caps: Capacities, seed: int):
        check_fits(index, caps)
        self.index, self.caps = index, caps
        self.llm = index.llm_tokens(caps.merge_area, caps.subsample)
        self.stream = SampleStream(len(index), seed)
        self.cursor, self.step = 0, 0

    def get_state(self) -> dict:
        """Carried state: small and JSON-able, saved with every checkpoint."""
        return {"cursor": int(self.cursor), "step": int(self.step)}

    def set_state(self, state: dict) -> None:
        self.cursor, self.step = int(state["cursor"]), int(state["step"])

    def plan(self) -> StepPlan:
        """Plans the next step and advances the state."""
        caps = self.caps
        slots = caps.microbatches * caps.devices
        # Upper bound on what one step can take: every slot holds at most row_len*rows tokens.
        window = self.stream.take(
            self.cursor, slots * caps.llm_rows * caps.llm_row_len // 2 + slots
        )
        placed, vis, aud = [], [], []
        k = 0
        for slot in range(slots):
            m, d = divmod(slot, caps.devices)
            rows = np.zeros(caps.llm_rows, np.int64)
            vis_fill = aud_fill = 0
            while k < len(window):
                s = int(window[k])
                need_v = self._items(self.index.images, self.index.images_ptr, s)
                need_a = self._items(self.index.audio, self.index.audio_ptr, s)
                free = np.flatnonzero(rows + self.llm[s] <= caps.llm_row_len)
                if (
                    not len(free)
                    or vis_fill + need_v.sum() > caps.vision_patches
                    or aud_fill + need_a.sum() > caps.audio_frames
                ):
                    break
                r = int(free[0])
                owner = len(placed)
                placed.append((s, m, d, r, int(rows[r])))
                rows[r] += self.llm[s]
                for j, n in enumerate(need_v):
                    vis.append((owner, j, d, vis_fill))
                    vis_fill += int(n)
                for j, n in enumerate(need_a):
                    aud.append((owner, j, d, aud_fill))
                    aud_fill += int(n)
                k += 1
        self.cursor += k
        self.step += 1
        cols = np.array(placed, np.int64).reshape(-1, 5).T
        return StepPlan(
            step=self.step - 1,
            samples=cols[0],
            micro=cols[1],
            device=cols[2],
            row=cols[3],
            offset=cols[4],
            vision=_items_plan(vis),
            audio=_items_plan(aud),
        )

    @staticmethod
    def _items(values: np.ndarray, ptr: np.ndarray, s: int) -> np.ndarray:
        return values[ptr[s] : ptr[s + 1]]


def _items_plan(rows: list[tuple[int, int, int, int]]) -> ItemPlan:
    if not rows:
        return ItemPlan.empty()
    a = np.array(rows, np.int64).T
    return ItemPlan(owner=a[0], item=a[1], device=a[2], offset=a[3])


def make_planner(cfg: Config, index: LengthsIndex, devices: int):
    """The planner named by batch.planner, over `devices` data-parallel buckets."""
    caps = Capacities.from_config(cfg, devices)
    if cfg.batch.planner == "first_fit":
        return FirstFitPlanner(index, caps, cfg.data.seed)
    if cfg.batch.planner in ("balanced", "orchestrated"):
        from jaxmllm.data.balancer import BalancedPlanner, OrchestratedPlanner

        cls = OrchestratedPlanner if cfg.batch.planner == "orchestrated" else BalancedPlanner
        return cls(index, caps, cfg.data.seed)
    if cfg.batch.planner in ("naive", "grain"):
        from jaxmllm.data.baselines import GrainPlanner, NaivePlanner

        cls = GrainPlanner if cfg.batch.planner == "grain" else NaivePlanner
        return cls(index, caps, cfg.data.seed)
    raise ValueError(f"batch.planner: unknown planner {cfg.batch.planner!r}")
