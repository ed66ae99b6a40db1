"""The planner contract: capacities in, a step plan out, and the checks both must pass.

A planner is pure numpy and a function of (seed, step, lengths index, carried state): resuming is
recomputation from the saved state. Every planner emits the same `StepPlan`, which `bucketize`
turns into the fixed-shape batch contract; a better planner changes the plan, not the contract.
This module is the bottom of `jaxmllm.plan`: it imports no planner.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from jaxmllm.config.checks import UserError
from jaxmllm.config.phases import ENCODERS, LLM, NAMES, PHASES
from jaxmllm.config.spec import BatchSpec, variant_tiles
from jaxmllm.data.lengths import (
    LengthsIndex,
    document_counts,
    document_table,
    split_documents,
)
from jaxmllm.plan.ragged import gather_items
from jaxmllm.plan.summary import summary_of
from jaxmllm.plan.tiles import bin_tiles, own_tiles, span_extra


@dataclass(frozen=True)
class Capacities:
    """Per device and per microbatch bucket sizes, in model units: the planner's view of a
    bucket spec (`Capacities.of`, over a number of data-parallel buckets).

    Per encoder phase (`jaxmllm.config.phases`, keyed by name, every phase of the table):
    `units` its bucket (0 when the model has no such encoder), `per_token` its units per LLM
    token (patches per merged token, frames per token), `per_row` its units per encoder row
    (what its attention sees: a patch; `stride` frames of a clip).
    """

    microbatches: int
    devices: int
    llm_rows: int
    llm_row_len: int
    units: Mapping[str, int]
    per_token: Mapping[str, int]
    per_row: Mapping[str, int]
    route_pair_capacity: int  # 0 = encoder outputs stay on the text's device
    # Block-sparse attention (jaxmllm.plan.tiles): units per side of a tile (0 = dense
    # attention: no tiles), and per phase (the LLM's and each encoder's) the tiles a device may
    # compute (0 or missing = no bound)
    attention_block: int = 0
    tiles: Mapping[str, int] = field(default_factory=dict)
    # Data-parallel positions per host (devices h * n ... (h + 1) * n - 1 on host h; 0 = all on
    # one host): routing keeps an item that cannot stay home on its text's host where it can
    devices_per_host: int = 0
    # Context parallelism (`jaxmllm.plan.context`): devices c * n ... (c + 1) * n - 1 form group
    # c, whose LLM bucket is llm_rows rows of context * llm_row_len tokens (a sample's text is
    # placed on a group; its query blocks are dealt to the group's devices, llm_row_len tokens
    # each); the encoders keep one bucket per device. 1 = every device its own LLM bucket.
    context: int = 1
    # A context degree per step: the long variants' LLM buckets are groups of this many
    # devices (`plan.context`), the base variant's those of `context` (1: each device its own);
    # 0 = every variant's those of `context`. A view of one variant is `at(variant)`.
    long_context: int = 0
    # The long variants of a step (`jaxmllm.plan.ladder`), cheapest first: per variant 1,
    # 2, ... and phase, the tiles a device may compute in a step planned for documents too
    # long for the base's tiles in the phases it raises (empty: every step is planned with
    # `tiles`; a phase missing or 0: the variant below's)
    long_tiles: tuple[Mapping[str, int], ...] = ()
    # Encoder phases whose items are bidirectional spans in the LLM's rows (their tiles above
    # the diagonal count in the LLM's tiles: `span_extras`)
    bidirectional: tuple[str, ...] = ()

    def __post_init__(self):
        for key in ("units", "per_token", "per_row"):
            missing = [p for p in NAMES if p not in getattr(self, key)]
            if missing:
                raise ValueError(f"Capacities.{key} lacks encoder phase(s) {missing}")

    @classmethod
    def of(cls, spec: BatchSpec, devices: int) -> Capacities:
        """The capacities of bucket spec `spec` over `devices` data-parallel buckets. A tile
        capacity the spec has not resolved (auto) is no bound: a dry run that sizes it plans
        without one.

        Raises:
          ValueError: the spec's route capacity still -1 (auto).
        """
        if spec.route_pair_capacity < 0:
            raise ValueError(
                "batch.route_pair_capacity=-1 (auto) must be resolved against the "
                "data first: jaxmllm.resolve.sizing.resolve_batch"
            )
        tiled = spec.tiled
        return cls(
            microbatches=spec.microbatches,
            devices=devices,
            llm_rows=spec.llm_rows,
            llm_row_len=spec.llm_row_len,
            units={p: spec.units.get(p, 0) for p in NAMES},
            per_token=dict(spec.per_token),
            per_row=dict(spec.per_row),
            route_pair_capacity=spec.route_pair_capacity,
            devices_per_host=spec.devices_per_host,
            context=spec.context,
            long_context=spec.long_context,
            attention_block=spec.attention_block if tiled else 0,
            tiles={p: spec.tiles.get(p, 0) if tiled else 0 for p in PHASES},
            long_tiles=tuple({p: long.get(p, 0) for p in PHASES} for long in spec.long_tiles),
            bidirectional=tuple(spec.bidirectional) if tiled else (),
        )

    def at(self, variant: int) -> Capacities:
        """The capacities of a step of `variant` as one context degree: with a degree per step
        (`long_context`), a long variant's LLM buckets are its groups; else these."""
        if not self.long_context:
            return self
        degree = self.long_context if variant else self.context
        return replace(self, context=degree, long_context=0)

    @property
    def top(self) -> Capacities:
        """The capacities of the top variant (what the data's longest samples must fit)."""
        return self.at(self.variants - 1)

    def row_units(self, phase: str) -> int:
        """Units per encoder row of an encoder phase."""
        return self.per_row[phase]

    def tile_caps(self, variant: int = 0) -> dict[str, int]:
        """Per phase, the tiles a device may compute (0 = no bound) in a step of `variant`
        (0: the base; v > 0: the long variant v, `long_tiles[v - 1]` where it sets a phase's)."""
        return variant_tiles({p: self.tiles.get(p, 0) for p in PHASES}, self.long_tiles, variant)

    @property
    def variants(self) -> int:
        """Step variants: the base one and each long one (`long_tiles`)."""
        return 1 + len(self.long_tiles)

    @property
    def llm_buckets(self) -> int:
        """LLM buckets: one per device, or one per context group."""
        return self.devices // self.context

    @property
    def group_row_len(self) -> int:
        """Tokens of one LLM row of a bucket (a context group's rows are `context` devices'
        rows long): `BatchSpec.group_row_len`."""
        return self.context * self.llm_row_len

    @property
    def llm_capacity(self) -> int:
        """LLM tokens a device (a group) holds per microbatch."""
        return self.llm_rows * self.llm_row_len


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
    device: np.ndarray  # [S] LLM bucket holding the sample's text: a device, or a context group
    row: np.ndarray  # [S] LLM row on that device
    offset: np.ndarray  # [S] first token in that row
    # Per encoder phase (every phase of the table, by name): where its items are encoded
    items: dict[str, ItemPlan] = field(default_factory=dict)
    deferred: int = 0  # samples waiting for a later step after this plan
    # The step's variant: 0 the base, v > 0 a long one (its tiles `Capacities.tile_caps(v)`)
    variant: int = 0

    def __post_init__(self):
        self.items = {p: self.items.get(p, ItemPlan.empty()) for p in NAMES}


class Planner(Protocol):
    """What the pipeline, the bench and the tests use of a planner."""

    ages: np.ndarray  # steps each sample of the last plan waited since it was pulled

    def plan(self) -> StepPlan:
        """Plans the next step and advances the carried state."""
        ...

    def get_state(self) -> dict:
        """The carried state: small and JSON-able, saved with every checkpoint."""
        ...

    def set_state(self, state: dict) -> None:
        """Restores `get_state()`'s state: the next plan is the one that followed it."""
        ...


class OversizeError(UserError):
    """A sample that cannot fit an empty bucket; names the sample and the capacity to raise."""


def check_fits(index: LengthsIndex, caps: Capacities) -> None:
    """Fails at start-up, naming the sample and the config key, if any sample can never fit
    (from the index's summary: its extremes are exact; the samples named are the longest)."""
    summary = summary_of(index, caps.per_token)
    tail = summary.body if summary.whole else summary.tail
    ids = summary.body_ids if summary.whole else summary.tail_ids
    checks = [(llm_row_key(caps), tail.llm_tokens(caps.per_token), caps.group_row_len)]
    units = tail.units()
    for p in ENCODERS:
        if caps.units[p.name]:
            checks.append((f"batch.{p.capacity}", units[p.name], caps.units[p.name]))
    for key, need, cap in checks:
        bad = np.flatnonzero(need > cap)
        if len(bad):
            count = f"{len(bad)}" if summary.whole else f"at least {len(bad)}"
            raise OversizeError(
                f"{count} sample(s) need more than {key}={cap} (sample {int(ids[bad[0]])} "
                f"needs {int(need[bad[0]])}, the largest {int(need.max())}); raise {key} to "
                f"at least {int(need.max())}"
            )
    for p in ENCODERS:
        if not caps.units[p.name] and len(index.items[p.name]):
            raise OversizeError(f"the data has {p.items} but model.{p.name}.enabled is false")
    check_tiles_fit(index, caps)


def llm_row_key(caps: Capacities) -> str:
    """The config key(s) that set an LLM bucket's row length, for messages."""
    if caps.context == 1:
        return "batch.llm_row_len"
    return f"batch.llm_row_len x mesh.context (a group's row, context {caps.context})"


def documents(index: LengthsIndex, caps: Capacities) -> dict[str, tuple[np.ndarray, bool, int]]:
    """Per phase, what its attention sees: every document's size in the phase's units (LLM
    tokens of a sample, or of each of a preference pair's two documents:
    `LengthsIndex.llm_documents`; an encoder item's rows = its units / the phase's units per
    row), whether it is causal, and the length of one packed row of the phase's bucket."""
    out = {LLM: (index.llm_documents(caps.per_token), True, caps.group_row_len)}
    for p in NAMES:
        per = caps.row_units(p)
        out[p] = (index.items[p].sizes // per, False, caps.units[p] // per)
    return out


def span_extras(index: LengthsIndex, samples: np.ndarray, caps: Capacities) -> np.ndarray | None:
    """Per sample of `samples`, the most LLM tiles above the diagonal its bidirectional spans
    add (`caps.bidirectional`: each item of those phases one span of its LLM tokens, wherever
    it lands, `tiles.span_extra`; a sample of several documents fills each one's slots with
    its items: a pair's twice, a group's once a document); None where none are (no such
    phase, or no tiles)."""
    if not (caps.bidirectional and caps.attention_block):
        return None
    s = np.asarray(samples, np.int64)
    out = np.zeros(len(s), np.int64)
    for p in caps.bidirectional:
        owner, _, flat = gather_items(index.items[p].ptr, s)
        tokens = np.asarray(index.items[p].sizes[flat], np.int64) // caps.per_token[p]
        out += np.bincount(owner, span_extra(tokens, caps.attention_block), len(s)).astype(np.int64)
    if index.split is not None:
        out *= document_counts(index.split_of(s))
    return out


def spans_alone(index: LengthsIndex, caps: Capacities, anywhere: bool = False) -> tuple[int, int]:
    """With bidirectional spans (`caps.bidirectional`), the most LLM tiles one sample needs
    alone in a bucket, its documents' and its spans' (`span_extras`), and that sample's LLM
    tokens: each document from a block boundary, or (`anywhere`) from wherever in a block
    (one block more than its size in blocks). Every sample is counted: which one needs the
    most depends on its items, not only its length."""
    b, everyone = caps.attention_block, np.arange(len(index.text))
    llm = llm_tokens_of(index, everyone, caps.per_token)
    split = index.split_of(everyone)
    docs = split_documents(llm, split)  # (a sample's one or more, in order)
    blocks = np.where(docs > 0, (docs - 1) // b + 2, 0) if anywhere else -(-docs // b)
    count = document_counts(split)
    first = np.cumsum(count) - count
    alone = np.add.reduceat(own_tiles(blocks, True), first) + span_extras(index, everyone, caps)
    top = int(np.argmax(alone)) if len(alone) else 0
    return (int(alone[top]), int(llm[top])) if len(alone) else (0, 0)


def check_tiles_fit(index: LengthsIndex, caps: Capacities) -> None:
    """Fails at start-up, naming the config key, if a document alone (at the start of an empty
    bucket) needs more attention tiles than its phase's tile capacity (of the top variant: a
    document too long for the base waits for a long step). With bidirectional spans a
    sample's LLM tiles are its documents' and its spans' (`span_extras`): counted for every
    sample, not only the longest."""
    if not caps.attention_block:
        return
    b = caps.attention_block
    most = summary_of(index, caps.per_token).most  # (each phase's largest document)
    variant = caps.variants - 1
    for phase, cap in bucket_tile_caps(caps, variant).items():
        per = 1 if phase == LLM else caps.row_units(phase)
        size = most[phase] // per
        if not caps.tile_caps(variant)[phase] or not size:
            continue
        need = int(own_tiles(np.array([-(-size // b)]), phase == LLM)[0])
        if phase == LLM and caps.bidirectional:
            need, size = spans_alone(index, caps)
        if need > cap:
            key = f"{phase}_long_tiles" if variant else f"{phase}_tiles"  # (its last value)
            least = need
            if phase == LLM and caps.context > 1:  # (a rank's share, and the dealing's slack)
                least = -(-least // caps.context) + llm_deal_slack(caps)
            raise OversizeError(
                f"a {phase} document of {size} units needs {need} attention tiles of {b}, more "
                f"than batch.{key}={caps.tile_caps(variant)[phase]} allows; raise batch.{key} "
                f"to at least {least} (or -1: sized from the data)"
            )


def llm_deal_slack(caps: Capacities) -> int:
    """With context groups, how far above the group's mean tiles dealing its query blocks may
    leave a rank: `context` (0 without groups). A block's tiles are the blocks of its document
    up to it (a block two documents share adds no tile), so a group's blocks hold every count
    from 2 to its longest document's blocks: sorted, they step by at most 1 (2 at the bottom,
    from 2 to 0), a round of `context` of them spans at most `context`, and dealing a round's
    largest to the least-loaded rank never widens the ranks' spread past a round's
    (`jaxmllm.plan.context.deal`): no rank ends more than `context` above another."""
    return caps.context if caps.context > 1 and caps.attention_block else 0


def device_tile_caps(caps: Capacities, bucket: dict[str, int]) -> dict:
    """The inverse of `bucket_tile_caps`: per phase the `*_tiles` capacities whose buckets
    hold `bucket` tiles (with context groups, an LLM group's share per device plus the slack
    of dealing; the same values without)."""
    out = dict(bucket)
    if caps.context > 1 and out.get(LLM):
        out[LLM] = -(-out[LLM] // caps.context) + llm_deal_slack(caps)
    return out


def bucket_tile_caps(caps: Capacities, variant: int = 0) -> dict[str, int]:
    """Per phase, the tiles one bucket may need (0 = no bound) in a step of `variant`:
    `caps.tile_caps(variant)`, but with context groups the LLM bucket is a group, whose ranks
    each compute `llm_tiles`: the group holds context x (llm_tiles - `llm_deal_slack`), so
    that its blocks dealt to the ranks keep every rank within llm_tiles (at least 1 where
    llm_tiles bounds: a capacity within the slack holds nothing, and `check_tiles_fit` says
    so)."""
    out = caps.tile_caps(variant)
    if caps.context > 1 and out[LLM]:
        out[LLM] = max(caps.context * (out[LLM] - llm_deal_slack(caps)), 1)
    return out


def check_plan(plan: StepPlan, index: LengthsIndex, caps: Capacities) -> None:
    """Raises ValueError unless the plan honours the contract (capacities, no overlap, every
    item of every planned sample placed once, items local or within the route capacity,
    attention tiles within their capacity; a long variant's buckets, where it has a context
    degree of its own, its groups: `Capacities.at`)."""
    caps = caps.at(plan.variant) if plan.variant < caps.variants else caps
    d_n, r_n, row_len = caps.devices, caps.llm_rows, caps.group_row_len
    g_n = caps.llm_buckets
    llm = llm_tokens_of(index, plan.samples, caps.per_token)
    if (
        len(plan.samples)
        and (
            (plan.micro < 0)
            | (plan.micro >= caps.microbatches)
            | (plan.device < 0)
            | (plan.device >= g_n)
            | (plan.row < 0)
            | (plan.row >= r_n)
        ).any()
    ):
        raise ValueError(f"step {plan.step}: a sample outside the [M, D, R] buckets")
    key = (plan.micro * g_n + plan.device) * r_n + plan.row
    _check_segments(plan.step, LLM, key, plan.offset, llm, row_len)
    for p in NAMES:
        it, items, per = plan.items[p], index.items[p], caps.per_token[p]
        want = items.ptr[plan.samples + 1] - items.ptr[plan.samples]
        got = np.bincount(it.owner, minlength=len(plan.samples)) if len(it.owner) else want * 0
        uniq = len(np.unique(it.owner * (int(want.max(initial=0)) + 1) + it.item))
        if (got != want).any() or uniq != len(it.owner) or (it.item >= want[it.owner]).any():
            raise ValueError(f"step {plan.step}: {p} items of planned samples not placed once")
        if not len(it.owner):
            continue
        size = items.size(plan.samples[it.owner], it.item)
        micro = plan.micro[it.owner]
        _check_segments(plan.step, p, micro * d_n + it.device, it.offset, size, caps.units[p])
        if (it.offset % per).any():
            raise ValueError(f"step {plan.step}: {p} item offsets must be multiples of {per}")
        if caps.route_pair_capacity == 0:
            if (it.device // caps.context != plan.device[it.owner]).any():
                raise ValueError(f"step {plan.step}: {p} item away from its text, no routing")
            continue
        if pair_rows(plan, index, caps, p).max(initial=0) > caps.route_pair_capacity:
            raise ValueError(
                f"step {plan.step}: {p} rows between two devices exceed "
                f"route_pair_capacity={caps.route_pair_capacity}"
            )
    if plan.variant >= caps.variants:
        raise ValueError(f"step {plan.step}: variant {plan.variant}, the capacities have none")
    if caps.attention_block:
        caps_by_phase = bucket_tile_caps(caps, plan.variant)
        for p, need in step_tiles(plan, index, caps).items():
            cap = caps_by_phase[p] if caps.tile_caps(plan.variant)[p] else 0
            if cap and need.max(initial=0) > cap:
                raise ValueError(
                    f"step {plan.step}: a device needs {int(need.max())} {p} attention tiles, "
                    f"more than its tile capacity {cap}"
                )


def work_of(index: LengthsIndex, samples: np.ndarray, per_token: Mapping[str, int]) -> np.ndarray:
    """`LengthsIndex.work` of `samples` alone (a plan's, not the whole index's): per sample
    its LLM tokens, then each encoder phase's units [sample, phase]."""
    s = np.asarray(samples, np.int64)
    out = np.zeros((len(s), len(PHASES)), np.int64)
    out[:, 0] = index.text[s]
    for k, (p, items) in enumerate(index.items.items(), 1):
        owner, _, flat = gather_items(items.ptr, s)
        size = np.asarray(items.sizes[flat], np.int64)
        out[:, 0] += np.bincount(owner, size // per_token[p], len(s)).astype(np.int64)
        out[:, k] = np.bincount(owner, size, len(s)).astype(np.int64)
    return out


def llm_tokens_of(
    index: LengthsIndex, samples: np.ndarray, per_token: Mapping[str, int]
) -> np.ndarray:
    """The LLM sequence length of each of `samples` (`work_of`'s first column)."""
    return work_of(index, samples, per_token)[:, 0]


def item_rows(plan: StepPlan, index: LengthsIndex, caps: Capacities, phase: str) -> np.ndarray:
    """Encoder output rows of each item of an encoder phase of a plan (its units / units per
    LLM token)."""
    it = plan.items[phase]
    return index.items[phase].size(plan.samples[it.owner], it.item) // caps.per_token[phase]


def pair_rows(plan: StepPlan, index: LengthsIndex, caps: Capacities, phase: str) -> np.ndarray:
    """Encoder output rows each (microbatch, src, dst) device pair carries in an encoder phase
    of a plan, over the pairs that carry any (what `batch.route_pair_capacity` bounds).

    With context groups dst is the text's group (`plan.device`), and an item encoded in it
    needs no exchange: its group gathers its devices' rows (`route.Routes`)."""
    it = plan.items[phase]
    home = plan.device[it.owner]
    remote = it.device // caps.context != home
    if not remote.any():
        return np.zeros(0, np.int64)
    d_n = caps.devices
    pair = (plan.micro[it.owner] * d_n + it.device) * caps.llm_buckets + home
    _, inv = np.unique(pair[remote], return_inverse=True)
    return np.bincount(inv, item_rows(plan, index, caps, phase)[remote]).astype(np.int64)


def phase_docs(
    plan: StepPlan, index: LengthsIndex, caps: Capacities, phase: str
) -> tuple[np.ndarray, ...]:
    """The documents attention sees in one phase of a plan, in its units (LLM tokens, patches,
    audio encoder rows = frames / audio stride): (microbatch, device, row, offset, size) each.
    A sample of several documents (a preference pair, a GRPO group: `LengthsIndex.split`) is
    its documents, each right after the one before."""
    if phase == LLM:
        llm = llm_tokens_of(index, plan.samples, caps.per_token)
        if index.split is None:
            return plan.micro, plan.device, plan.row, plan.offset, llm
        split = index.split_of(plan.samples)
        return pair_documents(split, llm, plan.offset, plan.micro, plan.device, plan.row)
    it = plan.items[phase]
    size = index.items[phase].size(plan.samples[it.owner], it.item)
    per = caps.row_units(phase)
    row = np.zeros(len(it.owner), np.int64)
    return plan.micro[it.owner], it.device, row, it.offset // per, size // per


def pair_documents(
    split: np.ndarray, llm: np.ndarray, offset: np.ndarray, *where: np.ndarray
) -> tuple[np.ndarray, ...]:
    """The documents of samples of `llm` tokens at `offset`, split at `split` [samples, K]
    (all 0: one document; else each document's tokens but the last's, the next right after
    it): (each of `where`, offset, size) per document, a sample's in order."""
    sizes, real = document_table(llm, split)
    within = np.cumsum(sizes, 1) - sizes  # (a document's start in its sample)
    count = real.sum(1)
    off = (np.asarray(offset, np.int64)[:, None] + within)[real]
    return (*(np.repeat(w, count) for w in where), off, sizes[real])


def step_tiles(plan: StepPlan, index: LengthsIndex, caps: Capacities) -> dict[str, np.ndarray]:
    """Per phase, the attention tiles each bucket of the plan needs [microbatch, bucket]
    (`jaxmllm.plan.tiles`; needs caps.attention_block > 0); an LLM bucket is a context group when
    caps.context > 1, or for the plan's variant (`Capacities.at`)."""
    caps = caps.at(plan.variant)
    m_n, out = caps.microbatches, {}
    for phase in PHASES:
        micro, dev, row, off, size = phase_docs(plan, index, caps, phase)
        rows = caps.llm_rows if phase == LLM else 1
        d_n = caps.llm_buckets if phase == LLM else caps.devices
        bins = (micro * d_n + dev) * rows + row
        tiles = bin_tiles(bins, off, size, m_n * d_n * rows, caps.attention_block, phase == LLM)
        extras = span_extras(index, plan.samples, caps) if phase == LLM else None
        if extras is not None:  # (bidirectional spans: the most their tiles above the diagonal)
            at = (plan.micro * d_n + plan.device) * rows + plan.row
            tiles += np.bincount(at, extras, m_n * d_n * rows).astype(np.int64)
        out[phase] = tiles.reshape(m_n, d_n, rows).sum(2)
    return out


def step_documents(plan: StepPlan, index: LengthsIndex, caps: Capacities) -> dict[str, int]:
    """Per phase, the most documents one packed row of the plan holds (cuDNN attention's
    static bound, `batch.*_documents`)."""
    out = {}
    for phase in PHASES:
        micro, dev, row, _, size = phase_docs(plan, index, caps, phase)
        rows = caps.llm_rows if phase == LLM else 1
        d_n = caps.llm_buckets if phase == LLM else caps.devices
        bins = ((micro * d_n + dev) * rows + row)[size > 0]
        out[phase] = int(np.bincount(bins).max(initial=0)) if len(bins) else 0
    return out


def _check_segments(
    step: int, what: str, key: np.ndarray, start: np.ndarray, size: np.ndarray, cap: int
) -> None:
    end = start + size
    if len(key) and ((start < 0) | (end > cap)).any():
        raise ValueError(f"step {step}: {what} capacity {cap} exceeded")
    o = np.lexsort((start, key))
    same = key[o][1:] == key[o][:-1]
    if (start[o][1:][same] < end[o][:-1][same]).any():
        raise ValueError(f"step {step}: {what} segments overlap")
