"""Planners that do not balance: what JAX users do today, behind the planner contract, so that
benchmarks run the same trainer, and the simplest correct planner.

- `first_fit`: (microbatch, device) slots filled in arrival order, media on their text's device.
- `naive`: a fixed number of samples per device, each in its own slot padded to the largest
  sample (MaxText's multimodal path pads images to a fixed count per example).
- `grain`: grain's `BestFitPackIterDataset` packing all phases jointly, per host over its own
  devices (one packing bin per (microbatch, device)), with no notion of cost or of other hosts;
  media stay on their text's device.
"""

from __future__ import annotations

import numpy as np

from jaxmllm.config.phases import LLM, NAMES
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.plan.contract import Capacities, ItemPlan, StepPlan, check_fits
from jaxmllm.plan.ragged import gather_items, offsets_in_bins
from jaxmllm.plan.stream import stream_of


class FirstFitPlanner:
    """The simplest correct planner: fill (microbatch, device) slots in order, arrival order.

    Each sample's media is encoded on its own device. A sample that does not fit the current
    slot moves on to the next slot, so nothing is skipped or reordered; fill suffers instead.
    """

    def __init__(self, index: LengthsIndex, caps: Capacities, seed: int):
        check_fits(index, caps)
        self.index, self.caps = index, caps
        self.llm = index.llm_tokens(caps.per_token)
        self.stream = stream_of(index, seed)
        self.cursor, self.step = 0, 0
        self.ages = np.zeros(0, np.int64)  # (nothing waits: every age is 0)

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
        placed, items = [], {p: [] for p in NAMES}
        k = 0
        for slot in range(slots):
            m, d = divmod(slot, caps.devices)
            rows = np.zeros(caps.llm_rows, np.int64)
            fill = dict.fromkeys(NAMES, 0)
            while k < len(window):
                s = int(window[k])
                need = {p: self.index.items[p].of(s) for p in NAMES}
                free = np.flatnonzero(rows + self.llm[s] <= caps.llm_row_len)
                if not len(free) or any(fill[p] + need[p].sum() > caps.units[p] for p in NAMES):
                    break
                r = int(free[0])
                owner = len(placed)
                placed.append((s, m, d, r, int(rows[r])))
                rows[r] += self.llm[s]
                for p in NAMES:
                    for j, n in enumerate(need[p]):
                        items[p].append((owner, j, d, fill[p]))
                        fill[p] += int(n)
                k += 1
        self.cursor += k
        self.step += 1
        cols = np.array(placed, np.int64).reshape(-1, 5).T
        self.ages = np.zeros(cols.shape[1], np.int64)
        return StepPlan(
            step=self.step - 1,
            samples=cols[0],
            micro=cols[1],
            device=cols[2],
            row=cols[3],
            offset=cols[4],
            items={p: _items_plan(items[p]) for p in NAMES},
        )


def _items_plan(rows: list[tuple[int, int, int, int]]) -> ItemPlan:
    if not rows:
        return ItemPlan.empty()
    a = np.array(rows, np.int64).T
    return ItemPlan(owner=a[0], item=a[1], device=a[2], offset=a[3])


class NaivePlanner:
    """`k` samples per device and microbatch, in arrival order, each padded to the largest."""

    def __init__(self, index: LengthsIndex, caps: Capacities, seed: int):
        check_fits(index, caps)
        self.index, self.caps = index, caps
        self.stream = stream_of(index, seed)
        self.llm = index.llm_tokens(caps.per_token)
        self.slot_llm = max(int(self.llm.max()), 1)
        self.per_row = caps.llm_row_len // self.slot_llm
        k = caps.llm_rows * self.per_row
        self.slot = {}
        for p in NAMES:
            items = index.items[p]
            most = int(items.per_sample().max()) if len(items) else 0
            self.slot[p] = most
            if most:
                k = min(k, caps.units[p] // most)
        self.k = max(k, 1)
        self.cursor, self.step = 0, 0
        self.ages = np.zeros(0, np.int64)

    def get_state(self) -> dict:
        return {"cursor": int(self.cursor), "step": int(self.step)}

    def set_state(self, state: dict) -> None:
        self.cursor, self.step = int(state["cursor"]), int(state["step"])

    def plan(self) -> StepPlan:
        caps, k = self.caps, self.k
        n = caps.microbatches * caps.devices * k
        s = self.stream.take(self.cursor, n)
        slot = np.arange(n)
        micro, dev, j = slot // (caps.devices * k), (slot // k) % caps.devices, slot % k
        items = {}
        for p in NAMES:
            owner, item, flat = gather_items(self.index.items[p].ptr, s)
            size = self.index.items[p].sizes[flat]
            within = np.cumsum(size) - size
            first = np.searchsorted(owner, owner, "left")
            within = within - within[first] if len(owner) else within
            items[p] = ItemPlan(
                owner=owner, item=item, device=dev[owner], offset=j[owner] * self.slot[p] + within
            )
        plan = StepPlan(
            step=self.step,
            samples=s,
            micro=micro,
            device=dev,
            row=j // self.per_row,
            offset=(j % self.per_row) * self.slot_llm,
            items=items,
        )
        self.cursor += n
        self.step += 1
        self.ages = np.zeros(n, np.int64)
        return plan


class GrainPlanner:
    """grain's best-fit packer over all phases jointly, one packer per host of 8 devices."""

    def __init__(self, index: LengthsIndex, caps: Capacities, seed: int, devices_per_host: int = 8):
        check_fits(index, caps)
        if caps.llm_rows != 1:
            raise ValueError(
                "batch.planner=grain packs one LLM row per device (grain packs a "
                "feature as one sequence); set batch.llm_rows=1"
            )
        self.index, self.caps, self.seed = index, caps, seed
        self.stream = stream_of(index, seed)
        self.llm = index.llm_tokens(caps.per_token)
        self.units = index.units()  # per encoder phase, per sample
        per = min(devices_per_host, caps.devices)
        self.host_devices = [
            np.arange(h, min(h + per, caps.devices)) for h in range(0, caps.devices, per)
        ]
        self.length_struct = {LLM: caps.llm_row_len}
        self.length_struct.update({p: caps.units[p] for p in NAMES if caps.units[p]})
        self.step = 0
        self.frontier: list[int] = []  # per step: the largest stream position seen so far
        self.ages = np.zeros(0, np.int64)
        self._iters = [self._host_iter(h) for h in range(len(self.host_devices))]

    def _host_iter(self, h: int):
        # (imported here, not with the module: config imports the planner registry, and a
        # config load should not pay for grain's import, seconds, unless this planner is built)
        import grain

        hosts = len(self.host_devices)

        def element(i):
            p = h + int(i) * hosts  # host h reads every hosts-th position of the global stream
            s = int(self.stream.at(np.array([p]))[0])
            out = {LLM: np.zeros(self.llm[s], np.int8), "pos": p}
            for phase in self.length_struct:
                if phase != LLM:
                    out[phase] = np.zeros(self.units[phase][s], np.int8)
            return out

        ds = (
            grain.MapDataset.range(0, 1 << 40)
            .map(element)
            .to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        )
        packed = grain.experimental.BestFitPackIterDataset(
            ds,
            length_struct=self.length_struct,
            num_packing_bins=self.caps.microbatches * len(self.host_devices[h]),
            seed=self.seed,
            shuffle_bins=False,
            meta_features=("pos",),
        )
        return iter(packed)

    def get_state(self) -> dict:
        return {
            "step": self.step,
            "frontier": list(self.frontier),
            "hosts": [it.get_state() for it in self._iters],
        }

    def set_state(self, state: dict) -> None:
        self.step = int(state["step"])
        self.frontier = [int(x) for x in state["frontier"]]
        for it, st in zip(self._iters, state["hosts"], strict=True):
            it.set_state(st)

    def plan(self) -> StepPlan:
        caps = self.caps
        pos, micro, dev = [], [], []
        for h, it in enumerate(self._iters):
            devs = self.host_devices[h]
            for b in range(caps.microbatches * len(devs)):
                got = next(it)["pos"]
                pos += got
                micro += [b // len(devs)] * len(got)
                dev += [int(devs[b % len(devs)])] * len(got)
        pos, micro, dev = (np.array(x, np.int64) for x in (pos, micro, dev))
        samples = self.stream.at(pos)
        bins = micro * caps.devices + dev  # packed in arrival order within each bin
        offset = offsets_in_bins(bins, self.llm[samples])
        items = {}
        for p in NAMES:
            owner, item, flat = gather_items(self.index.items[p].ptr, samples)
            items[p] = ItemPlan(
                owner=owner,
                item=item,
                device=dev[owner],
                offset=offsets_in_bins(bins[owner], self.index.items[p].sizes[flat]),
            )
        # Age: steps since the stream frontier (largest position planned so far) first passed a
        # sample's position. Only the last few steps are kept: grain holds samples briefly.
        prev = self.frontier[-1] if self.frontier else -1
        self.frontier = (self.frontier + [max(prev, int(pos.max()) if len(pos) else prev)])[-32:]
        first = self.step + 1 - len(self.frontier)
        arrival = first + np.searchsorted(np.array(self.frontier), pos, "left")
        self.ages = self.step - arrival
        plan = StepPlan(
            step=self.step,
            samples=samples,
            micro=micro,
            device=dev,
            row=np.zeros(len(samples), np.int64),
            offset=offset,
            items=items,
        )
        self.step += 1
        return plan
