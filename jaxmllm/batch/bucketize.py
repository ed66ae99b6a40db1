"""Turns a StepPlan and its loaded samples into the fixed-shape batch contract.

Every array has leading axes [M, D] (microbatch, data-parallel device bucket):

  llm_tokens, llm_segment_ids, llm_positions, llm_targets   int32  [M, D, R, L]
                                (llm_positions [M, D, R, L, 3] with M-RoPE: time, row, column)
  llm_loss_mask                                              f32    [M, D, R, L]

and per encoder phase of the table (`jaxmllm.config.phases`) the model has, for vision:

  llm_vision_src                                             int32  [M, D, R, L]
  vision_patches [M, D, P, patch*patch*C] uint8 pixels (its inputs, named batch.<capacity>;
                 the encoder normalises them: `config.spec.Inputs`),
  vision_segment_ids [M, D, P], vision_positions [M, D, P, 2] (row, col)
  vision_send                                                int32  [M, D, B, C]  (routed only)
  vision_send_count                                          int32  [M, D, B]     (routed only)

(audio: audio_frames [M, D, F, n_mels] f32 (bf16 under bf16 compute), positions [M, D, F]:
an encoder's `input_width` and `position_dims` shape its arrays; an item narrower than its
bucket's inputs repeats to fill them: an image's one frame in a vision bucket of
`temporal_patch`-frame patches, which videos' temporal patches fill as they are). With
block-sparse attention each phase has `<phase>_tiles` [M, D, tiles, 2] too, and a decoder with
sliding-window layers `llm_window_tiles` [M, D, window tiles, 2]: the tiles some window reaches,
which those layers compute (`window_tile_cap`; under context groups a rank's, dealt with its
query blocks). Under context groups by `mesh.context_strategy: ulysses`, `llm_blocks` [M, D,
blocks a device] int32: each of a device's blocks, its index in its group's rows (blocks
numbered row by row), from which the model puts the group's tokens back in order. A decoder
whose images (`model.llm.bidirectional`) attend both ways has
`llm_spans` [M, D, R, L] int32: an item's slots carry one id > 0 (its first slot's index in the
bucket's rows + 1), other tokens 0; the tile lists then hold the tiles above the diagonal the
spans need (`plan.tiles.span_tiles`).

Segment ids are 1, 2, ... per sample (per item in the encoder rows) and 0 for padding.
`llm_*_src[t] = -1` unless token t is a placeholder slot (of any kind of its phase: an image's
or a video's for the vision phase); then it indexes the device's row
buffer [own projector output rows (N) | received rows (B*C)], B the LLM buckets (= D): an item
encoded on the text's own device is read locally (index < N); with route_pair_capacity C > 0 an
item encoded on device s is read at N + s*C + c, which the all-to-all fills from
`*_send[s, d, c]` = the source's projector output row. C bounds only cross-device traffic; self
pairs are never used. Under context groups of G devices a bucket is a group (B = D / G): an
item encoded in the text's group is read from the group's gathered buffers at its encoder's
place s % G (buffer (s % G) x (N + B*C) + its row), one encoded in group h from the buffer of
the text's device at place s % G, at N + h*C + c (`*_send[s, g, c]`: the text's group g).
With one bucket (B = 1) nothing is received: a device's buffer is its N rows.

On several hosts each process fills only its own positions (`positions`, ascending indices into
D): the arrays' D axis holds those rows only (the `*_send` tables keep every bucket), and
`samples` needs only the samples with text or an encoder item on those positions. Routing
offsets are counted the same way on every host, from the lengths index when a sample failed to
load, so both ends of an exchange agree.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jaxmllm.batch.context import Split, group_text, local_groups
from jaxmllm.batch.pairs import document_segments, documents_of, write_sequences
from jaxmllm.batch.rollouts import rollout_shapes, write_advantages
from jaxmllm.config import Config, phases
from jaxmllm.config.phases import ENCODERS, LLM, PHASES, VISION, Phase
from jaxmllm.config.spec import BatchSpec
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.data.samples import Sample
from jaxmllm.data.text.specials import RESERVED, Specials
from jaxmllm.plan.contract import Capacities, StepPlan
from jaxmllm.plan.tiles import (
    TileOverflow,
    document_starts,
    from_segments,
    window_reach,
    window_tile_capacity,
)


def window_tile_cap(spec: BatchSpec, variant: int = 0) -> int:
    """The windowed layers' tile capacity of a bucket (`llm_window_tiles`) in a step of
    `variant`; 0 where they have no list of their own (no sliding window, or not
    block-sparse). Never planned: the windowed tiles of any bucket fit the fewer of its causal
    capacity and the band of tiles a window reaches (`plan.tiles.window_capacity`; a context
    group's rank: `rank_window_capacity`), widened where bidirectional spans reach ahead: as far
    as the largest item an encoder bucket holds."""
    if not (spec.window and spec.tiled):
        return 0
    longest = [spec.units[p] // spec.per_token[p] for p in spec.bidirectional if p in spec.units]
    causal = spec.tile_caps(variant)[LLM]
    rows, block = spec.llm_rows, spec.attention_block
    return window_tile_capacity(
        causal, rows, spec.llm_row_len, block, spec.window, max(longest, default=0), spec.context
    )


def batch_shapes(
    cfg: Config, devices: int, variant: int = 0
) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Global shape and dtype of every array in a step batch (the contract, for eval_shape) of
    a step of `variant` (its tile lists: `jaxmllm.plan.ladder`; with a context degree per step,
    its groups: `BatchSpec.at`); `cfg` resolved (`BatchSpec.of` says what is not)."""
    spec, m = BatchSpec.of(cfg).at(variant), cfg.model
    lead = (spec.microbatches, devices)
    llm = lead + (spec.llm_rows, spec.llm_row_len)
    keys = ("llm_tokens", "llm_segment_ids", "llm_positions", "llm_targets")
    out = {k: (llm, np.int32) for k in keys}
    out["llm_loss_mask"] = (llm, np.float32)
    if any(m.llm.mrope_section):  # M-RoPE: (time, row, column) per token
        out["llm_positions"] = (llm + (3,), np.int32)
        if spec.context > 1:  # (a gathered key is masked by its index in its document)
            out["llm_order"] = (llm, np.int32)
    if spec.context > 1 and spec.context_strategy == "ulysses" and spec.tiled:
        # (each of a device's blocks: its index in its group's rows, `Split.deal`)
        out["llm_blocks"] = (
            lead + (spec.llm_rows * spec.llm_row_len // spec.attention_block,),
            np.int32,
        )
    if spec.pairs:  # preference pairs: each token's sequence in its bucket, the pairs there
        out["llm_sequence"] = (llm, np.int32)
        out["llm_pairs"] = (lead, np.int32)
    if spec.pair_reference:  # each document's reference log-prob sum, on its first token
        out["llm_reference"] = (llm, np.float32)
    if m.llm.bidirectional:  # (an item's tokens see each other both ways)
        out["llm_spans"] = (llm, np.int32)
    out.update(rollout_shapes(cfg, lead, llm))  # (GRPO's completions: their advantages, weights)
    c = spec.route_pair_capacity
    for p in phases.in_batch(m, cfg.batch):  # (a zero bucket: no arrays, the step skips it)
        enc, units = p.encoder(m), spec.units[p.name]
        out[p.src] = (llm, np.int32)
        out[p.capacity] = (lead + (units, enc.input_width), spec.input_dtype(p.name))
        out[f"{p.name}_segment_ids"] = (lead + (units,), np.int32)
        at = (enc.position_dims,) if enc.position_dims else ()
        out[f"{p.name}_positions"] = (lead + (units, *at), np.int32)
        if c:  # (per LLM bucket: a device, or a context group)
            out[f"{p.name}_send"] = (lead + (devices // spec.context, c), np.int32)
            out[f"{p.name}_send_count"] = (lead + (devices // spec.context,), np.int32)
    for phase, cap in spec.tile_caps(variant).items():  # (block-sparse attention)
        out[f"{phase}_tiles"] = (lead + (cap, 2), np.int32)
    if window_tile_cap(spec, variant):  # (the sliding-window layers' own)
        out["llm_window_tiles"] = (lead + (window_tile_cap(spec, variant), 2), np.int32)
    return out


def empty_batch(
    cfg: Config, devices: int, local: int | None = None, pad: int = RESERVED.pad, variant: int = 0
) -> dict[str, np.ndarray]:
    """An all-padding batch (zeros; `*_src` = -1; tokens `pad`) of a step of `variant`;
    `local` rows of the D axis if given."""
    shapes = batch_shapes(cfg, devices, variant)
    if local is not None:
        shapes = {k: ((s[0], local) + s[2:], d) for k, (s, d) in shapes.items()}
    batch = {k: np.zeros(s, d) for k, (s, d) in shapes.items()}
    for p in ENCODERS:
        if p.src in batch:
            batch[p.src][:] = -1
    batch["llm_tokens"][:] = pad
    if "llm_sequence" in batch:
        batch["llm_sequence"][:] = -1
    return batch


def bucketize(
    plan: StepPlan,
    samples: dict[int, Sample | None],
    cfg: Config,
    caps: Capacities,
    positions: np.ndarray | None = None,
    index: LengthsIndex | None = None,
    specials: Specials = RESERVED,
    reference: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Fills the fixed-shape arrays of one step from a plan and its loaded samples.

    Args:
      plan: The step's plan (global: every device).
      samples: index -> Sample, or None for one that failed to load (its slots stay padding).
        With `positions`, only samples with text or an item on those positions are needed.
      cfg, caps: The resolved config and its capacities (with a context degree per step, the
        plan's variant's view of them is taken: `Capacities.at`).
      positions: This host's data-parallel positions; default all D.
      index: The lengths index; sizes the routing of a sample that failed to load.
      specials: The tokenizer's ids (the source's `specials`): padding is `pad`, an encoder
        phase's slots are the tokens equal to its `media` id.
      reference: Preference pairs' reference log-prob sums [samples, 2] (chosen, rejected),
        by sample index, where the batch takes them (`llm_reference`).
    """
    spec, caps = BatchSpec.of(cfg).at(plan.variant), caps.at(plan.variant)
    # (block-sparse attention: every bucket's tile list, of the step's variant; else {})
    tile_caps = spec.tile_caps(plan.variant)
    pos = np.arange(caps.devices) if positions is None else np.asarray(positions, np.int64)
    local, home = host_buckets(caps, positions)  # device, bucket -> this host's
    local_n = None if positions is None else len(pos)
    batch = empty_batch(cfg, caps.devices, local_n, specials.pad, plan.variant)
    # Text goes to its LLM bucket's rows: a device's, or a context group's (then dealt).
    grouped = caps.context > 1
    reach = window_reach(spec.window, spec.attention_block) if spec.tiled else None
    text = group_text(batch, caps, specials.pad) if grouped else batch
    slots = _write_texts(
        text, plan, samples, home, grouped, caps.group_row_len, specials, cfg, reference
    )
    split = None
    if grouped:
        groups = np.flatnonzero(home >= 0)
        split = Split.deal(text, batch, caps, tile_caps[LLM], plan.step, groups, reach)
    for p in ENCODERS:
        if p.capacity in batch:
            items = plan.items[p.name]
            units = (
                None
                if index is None
                else index.items[p.name].size(plan.samples[items.owner], items.item)
            )
            spans = p.name in cfg.model.llm.bidirectional
            hosts = (local, home, split)
            _write_items(batch, p, plan, samples, slots, caps, hosts, units, spans)
    if tile_caps:  # block-sparse attention
        _write_tiles(batch, cfg, tile_caps, spec.attention_block, plan, pos, grouped)
        if "llm_window_tiles" in batch and not grouped:  # (a group's: `Split.deal`'s)
            rows = batch["llm_segment_ids"]
            m_n, d_n = rows.shape[:2]
            cap = batch["llm_window_tiles"].shape[2]
            spans = batch.get("llm_spans")
            flat = lambda x: None if x is None else x.reshape(m_n * d_n, *x.shape[2:])
            # (never over: `window_tile_cap`, and `_write_tiles` held the causal capacity)
            tiles = from_segments(flat(rows), spec.attention_block, True, cap, reach, flat(spans))
            batch["llm_window_tiles"] = tiles.reshape(m_n, d_n, cap, 2)
    if spec.documents:  # cuDNN attention, a tower's class tokens
        _check_documents(batch, cfg, spec, plan.step, pos)
    return batch


BF16 = np.dtype(ml_dtypes.bfloat16)


def _castable(have: np.dtype, bucket: np.dtype) -> bool:
    """Whether an item's inputs go into a bucket of `bucket`'s dtype: the same dtype, or
    features into features (float32 frames into bf16: the cast the model's first layer does);
    never floats into pixels or pixels into features."""
    features = lambda dt: dt.kind == "f" or dt == BF16  # (numpy reads bfloat16 as kind "V")
    return have == bucket or (features(have) and features(bucket))


def _check_documents(batch, cfg: Config, spec: BatchSpec, step: int, positions) -> None:
    """cuDNN attention: every row within its phase's `batch.*_documents` (a static size of
    cuDNN's packed layout: a document past it would get no attention at all); likewise a
    tower's class-token rows (one per image: an image past them would have none)."""
    for phase, most in spec.documents.items():
        seg = _attention_rows(batch, cfg, phase)  # (the encoder's rows, as the planner's)
        count = document_starts(seg).sum(-1)  # documents per row
        if count.max(initial=0) > most:
            m, d = np.unravel_index(int(np.argmax(count)), count.shape)[:2]
            raise ValueError(
                f"step {step}: a {phase} row of microbatch {m} on device {int(positions[d])} "
                f"holds {int(count.max())} documents, more than batch.{phase}_documents={most} "
                "(cuDNN attention's packed layout, or the vision tower's class-token rows); raise "
                "it, or -1: sized from the data"
            )


def _write_tiles(batch, cfg: Config, tile_caps, block: int, plan, positions, grouped) -> None:
    """Each bucket's attention tile list, read off the segment ids just written (a document is
    a run of one segment id; the planner kept every bucket's tiles within its capacity,
    `tile_caps` of the step's variant); with context groups (`grouped`) the LLM's are written
    already (the split)."""
    for phase, cap in tile_caps.items():
        if grouped and phase == LLM:
            continue
        seg = _attention_rows(batch, cfg, phase)  # (an encoder attends over its rows)
        m_n, d_n = seg.shape[:2]
        rows = seg.reshape(m_n * d_n, -1, seg.shape[-1])
        spans = batch.get("llm_spans") if phase == LLM else None
        spans = None if spans is None else spans.reshape(rows.shape)
        try:
            tiles = from_segments(rows, block, phase == LLM, cap, spans=spans)
        except TileOverflow as e:
            m, d = divmod(e.bucket, d_n)
            key = f"{phase}_long_tiles" if plan.variant else f"{phase}_tiles"
            raise ValueError(
                f"step {plan.step}: microbatch {m} of device {int(positions[d])} needs {e.need} "
                f"{phase} attention tiles, more than batch.{key} allows ({cap}); raise it "
                "(or -1: sized from the data)"
            ) from None
        batch[f"{phase}_tiles"] = tiles.reshape(m_n, d_n, cap, 2)


def _attention_rows(batch, cfg: Config, phase: str) -> np.ndarray:
    """A phase's segment ids as its attention sees them: an encoder's rows are its units per
    row apart (a clip's `stride` frames); the LLM's tokens, patches, as they are."""
    seg = batch[f"{phase}_segment_ids"]
    if phase == LLM:
        return seg
    return seg[..., :: phases.phase(phase).per_row(cfg.model)]


def text_segments(plan: StepPlan, samples, home, grouped: bool, b_n: int, r_n: int) -> tuple:
    """(ks, bucket, segment): the planned samples whose text this host writes (their LLM bucket
    is here, `home[b]` >= 0, and they loaded), in plan order; every planned sample's bucket on
    this host; and each written sample's segment id: 1, 2, ... per row (a context group's: one
    count over all its rows), in plan order. `b_n`, `r_n`: this host's buckets and rows."""
    bucket = home[plan.device]
    here = [
        k
        for k, (s, b) in enumerate(zip(plan.samples.tolist(), bucket.tolist(), strict=True))
        if b >= 0 and samples[s] is not None
    ]
    ks = np.asarray(here, np.int64)
    m, b, r = plan.micro[ks], bucket[ks], plan.row[ks]
    key = m * b_n + b if grouped else (m * b_n + b) * r_n + r
    order = np.argsort(key, kind="stable")
    rank = np.empty(len(ks), np.int64)
    rank[order] = np.arange(len(ks)) - np.searchsorted(key[order], key[order])
    return ks, bucket, rank + 1


def host_buckets(caps: Capacities, positions) -> tuple[np.ndarray, np.ndarray]:
    """(local, home): per device its index in this host's arrays (`positions`; None: every
    device), per LLM bucket (a device, or a context group) its index among this host's, -1
    where another host holds it."""
    local = np.full(caps.devices, -1, np.int64)
    pos = np.arange(caps.devices) if positions is None else np.asarray(positions, np.int64)
    local[pos] = np.arange(len(pos))
    return local, (local_groups(local, caps.context) if caps.context > 1 else local)


def _write_texts(
    text, plan: StepPlan, samples, home, grouped: bool, row_len: int, specials, cfg, reference
):
    """Writes every loaded sample whose bucket is here into its rows at once (the samples'
    tokens concatenated, scattered at their flat positions), and returns per encoder phase its
    placeholder slots: (slots, begin, end) = every sample's slot indexes into its bucket's
    rows flattened, concatenated in plan order, and per planned sample where its own begin and
    end (-1: not written here)."""
    m_n, b_n, r_n, l_n = text["llm_tokens"].shape
    ks, bucket, _ = text_segments(plan, samples, home, grouped, b_n, r_n)
    loaded = [samples[s] for s in plan.samples[ks].tolist()]
    n = np.array([len(x.tokens) for x in loaded], np.int64)
    if not len(ks) or not n.sum():
        none = np.full(len(plan.samples), -1)
        return {p.name: (np.zeros(0, np.int64), none, none) for p in ENCODERS}
    tokens = np.concatenate([x.tokens for x in loaded])
    starts = np.cumsum(n) - n
    m, b, r, o = plan.micro[ks], bucket[ks], plan.row[ks], plan.offset[ks]
    # A sample's documents (one, or a pair's two): each its own segment, positions from 0
    docs = documents_of(loaded)
    doc_n = np.concatenate(docs)
    doc_starts = np.cumsum(doc_n) - doc_n
    within = np.arange(len(tokens)) - np.repeat(doc_starts, doc_n)  # a token's index in its doc
    in_sample = np.arange(len(tokens)) - np.repeat(starts, n)  # a token's index in its sample
    flat = np.repeat(((m * b_n + b) * r_n + r) * l_n + o, n) + in_sample
    key = m * b_n + b if grouped else (m * b_n + b) * r_n + r
    segment = document_segments(key, np.array([len(d) for d in docs], np.int64))
    text["llm_tokens"].reshape(-1)[flat] = tokens
    text["llm_segment_ids"].reshape(-1)[flat] = np.repeat(segment, doc_n)
    if text["llm_positions"].ndim == 5:  # M-RoPE: (time, row, column), each document's own
        vision, merge = specials.phase_ids(VISION.name), cfg.model.vision.merge
        mrope = [
            mrope_positions(part, vision, x.grids, merge)
            for x, d in zip(loaded, docs, strict=True)
            for part in np.split(x.tokens, np.cumsum(d)[:-1])
        ]
        text["llm_positions"].reshape(-1, 3)[flat] = np.concatenate(mrope)
        if "llm_order" in text:
            text["llm_order"].reshape(-1)[flat] = within
    else:
        text["llm_positions"].reshape(-1)[flat] = within
    # Token t predicts token t+1 of the same document; a document's last token predicts nothing.
    last = (np.cumsum(doc_n) - 1)[doc_n > 0]
    targets = np.append(tokens[1:], specials.pad)
    targets[last] = specials.pad
    text["llm_targets"].reshape(-1)[flat] = targets
    loss = np.append(np.concatenate([x.loss for x in loaded])[1:], False)
    loss[last] = False
    text["llm_loss_mask"].reshape(-1)[flat] = loss
    if "llm_sequence" in text:
        write_sequences(text, loaded, docs, m * b_n + b, flat)
    if "llm_advantage" in text:  # (a rollout's completion: `jaxmllm.step.grpo`)
        write_advantages(text, loaded, docs, flat, cfg.rl.loss_aggregation)
    if "llm_reference" in text:  # (a document's sum on its first token)
        if reference is None:
            raise ValueError("the batch takes the pairs' reference log-probs: none were given")
        values = np.asarray(reference, np.float32)[plan.samples[ks]].reshape(-1)
        text["llm_reference"].reshape(-1)[flat[doc_starts]] = values
    # placeholder slots per phase (its kinds'): index into the bucket's rows flattened
    first = np.full(len(plan.samples), -1)
    slots = {}
    for p in ENCODERS:
        at = np.flatnonzero(np.isin(tokens, specials.phase_ids(p.name)))
        owner = np.searchsorted(starts, at, "right") - 1  # (into ks)
        counts = np.bincount(owner, minlength=len(ks))
        begin, end = first.copy(), first.copy()
        end[ks] = np.cumsum(counts)
        begin[ks] = end[ks] - counts
        slots[p.name] = ((r * row_len + o)[owner] + in_sample[at], begin, end)
    return slots


def _write_items(
    batch,
    p: Phase,
    plan: StepPlan,
    samples,
    slots,
    caps: Capacities,
    hosts: tuple,
    units: np.ndarray | None,
    spans: bool = False,
) -> None:
    """Writes encoder inputs and the routing of their output rows to LLM placeholder slots
    (`spans`: and each item's slots' bidirectional span, `llm_spans`).

    `hosts` = (local, home, split): `local[g]` is global device g's row in this host's arrays,
    `home[b]` LLM bucket b's (a device or a context group), -1 when another host holds it;
    `split` where a context split moved each token of a group's rows (None: no groups).

    A row reaches its slot from the device that holds it after the exchange: the encoding
    device when it is in the text's bucket (local), else the bucket's device at the encoding
    device's position in its own group (`recv`: the text's device without groups), at
    N + (src's group) * C + c of its received rows (`*_send[src, bucket, c]`). With groups the
    slots read the group's rows gathered, each device's N + B * C after the other ("base").
    """
    local, home, split = hosts
    phase, items, per_row = p.name, plan.items[p.name], caps.per_token[p.name]
    data_key, src_key = p.capacity, p.src
    pair_cap, ctx = caps.route_pair_capacity, caps.context
    own_rows = batch[data_key].shape[2] // per_row  # received rows follow the own ones
    # (a device's buffer: its own rows, then what other buckets sent it: one bucket, none)
    received = caps.llm_buckets * pair_cap if caps.llm_buckets > 1 else 0
    gathered = own_rows + received if ctx > 1 else 0
    seg_counter: dict[tuple[int, int], int] = {}
    pair_fill: dict[tuple[int, int, int], int] = {}
    used = [0] * len(plan.samples)  # placeholder slots consumed per owner sample
    order = np.lexsort((items.item, items.owner))  # a sample's items in placeholder order
    for k in order.tolist():
        owner, j = int(items.owner[k]), int(items.item[k])
        m, enc_dev, off = int(plan.micro[owner]), int(items.device[k]), int(items.offset[k])
        d, r = int(plan.device[owner]), int(plan.row[owner])
        enc_here, text_here = local[enc_dev] >= 0, home[d] >= 0
        if not (enc_here or text_here):
            continue  # both ends on other hosts
        sample = samples[int(plan.samples[owner])]
        if units is not None:  # the index's count: what every host counts, loaded or not
            n = int(units[k])
        elif sample is not None:
            n = len(sample.media[phase][j][0])
        else:
            continue  # failed to load, one host: no encoder rows, no routing
        rows = off // per_row + np.arange(n // per_row)  # projector output rows of this item
        if sample is not None and enc_here:
            e = int(local[enc_dev])
            seg = seg_counter[(m, e)] = seg_counter.get((m, e), 0) + 1
            values, pos = sample.media[phase][j]
            width = batch[data_key].shape[-1]
            if not _castable(values.dtype, batch[data_key].dtype):  # (floats into pixels)
                raise TypeError(
                    f"sample {int(plan.samples[owner])} {p.item} {j}: {values.dtype} inputs for "
                    f"{data_key}, which holds {batch[data_key].dtype} (config.spec.Inputs)"
                )
            if values.shape[-1] != width:  # (an image's frame, in a bucket of temporal patches)
                values = np.tile(values, (1, width // values.shape[-1]))
            batch[data_key][m, e, off : off + n] = values
            batch[f"{phase}_positions"][m, e, off : off + n] = pos
            batch[f"{phase}_segment_ids"][m, e, off : off + n] = seg
        dest, copies = None, 1
        at, begin, end = slots[phase]
        if text_here and begin[owner] >= 0:
            first = begin[owner] + used[owner]
            # (a sample of several documents shares its media: its rows fill each one's slots)
            copies = max(len(sample.documents), 1) if sample is not None else 1
            part = (end[owner] - begin[owner]) // copies  # (a document's slots)
            dest = at[first : min(first + len(rows), begin[owner] + part)]
            if copies > 1:  # (the later documents' slots of the item: as many, a part later)
                dest = np.concatenate([at[first + k * part :][: len(dest)] for k in range(copies)])
            used[owner] += len(rows)
            if spans and len(dest):  # (its slots: one span, named by its first slot)
                where = (home, split, m, d, r)
                _fill(batch["llm_spans"][m], where, dest, np.full(len(dest), dest[0] + 1))
        recv = d * ctx + enc_dev % ctx  # (= d without groups)
        base = (enc_dev % ctx) * gathered  # (0 without groups)
        if pair_cap == 0 or enc_dev // ctx == d:  # the local path: no exchange
            if enc_dev // ctx != d:
                raise ValueError(
                    f"plan step {plan.step}: sample {int(plan.samples[owner])} {p.item} "
                    f"{j} is on another device but batch.route_pair_capacity is 0"
                )
            if dest is not None:
                values = _copies(base + rows, dest, copies)
                _fill(batch[src_key][m], (home, split, m, d, r), dest, values)
            continue
        c0 = pair_fill.get((m, enc_dev, d), 0)
        if c0 + len(rows) > pair_cap:
            raise ValueError(
                f"plan step {plan.step}: device {enc_dev} -> {recv} needs more than "
                f"batch.route_pair_capacity={pair_cap} {phase} rows"
            )
        pair_fill[(m, enc_dev, d)] = c0 + len(rows)
        if enc_here and sample is not None:
            e = int(local[enc_dev])
            batch[f"{phase}_send_count"][m, e, d] = c0 + len(rows)  # rows a ragged send moves
            batch[f"{phase}_send"][m, e, d, c0 : c0 + len(rows)] = rows
        if dest is not None:
            got = base + own_rows + enc_dev // ctx * pair_cap + c0 + np.arange(len(rows))
            _fill(batch[src_key][m], (home, split, m, d, r), dest, _copies(got, dest, copies))


def _copies(rows: np.ndarray, dest: np.ndarray, copies: int) -> np.ndarray:
    """The rows for `dest`, the item's slots in each of `copies` documents (a pair's two, a
    group's G; one: a sample of one document) one document's after the other: the rows taken
    once a document."""
    return np.tile(rows[: len(dest) // copies], copies)


def _fill(src_drl: np.ndarray, where: tuple, dest: np.ndarray, values: np.ndarray) -> None:
    """Writes `values` into one microbatch's slot sources [D, R, L] at the bucket's slots
    `dest` (index into its rows flattened); `where` = (home, split, m, bucket, row)."""
    home, split, m, d, _ = where
    if split is None:
        src_drl[home[d]].reshape(-1)[dest] = values
        return
    device, flat = split.where(m, int(home[d]), dest)
    src_drl.reshape(len(src_drl), -1)[device, flat] = values


def fill_stats(batch: dict[str, np.ndarray]) -> dict[str, float]:
    """Real (non-padding) share of each phase's capacity in this batch."""
    return {
        phase: float((batch[f"{phase}_segment_ids"] > 0).mean())
        for phase in PHASES
        if f"{phase}_segment_ids" in batch
    }


def mrope_positions(
    tokens: np.ndarray, vision: int | list[int], grids: list[tuple], merge: int
) -> np.ndarray:
    """M-RoPE positions [T, 3] (time, row, column) of a sample, as Qwen2-VL's and Qwen2.5-VL's
    `get_rope_index` make them: text counts on in all three; the k-th image or video is the
    next block of vision placeholder tokens (`vision`: the ids of images' and videos' slots)
    its grid fills (items may follow each other with no text between), its grid of t temporal
    patches of (rows / merge) x (cols / merge) tokens, time-major, then row-major, at (start +
    time, start + row, start + column), and the text after it resumes at start + the merged
    grid's longer side (the time does not count: transformers 5's rule). `grids`: (t, rows,
    cols) in patches each, (rows, cols) for an image, or (t, rows, cols, step) for a video
    placed in absolute time (Qwen2.5-VL): temporal patch k at time floor(k x step) in float32,
    step = tokens_per_second x seconds a temporal patch spans (`video_time_step`)."""
    out = np.zeros((len(tokens), 3), np.int32)
    is_vision = np.isin(tokens, vision)
    full = [(1, *g) if len(g) == 2 else g for g in grids]
    merged = [(g[0], g[1] // merge, g[2] // merge) for g in full]
    steps = [g[3] if len(g) == 4 else None for g in full]
    total = sum(t * h * w for t, h, w in merged)
    if int(is_vision.sum()) != total:
        raise ValueError(
            f"{int(is_vision.sum())} image tokens but the sample's {len(grids)} image grids "
            f"merge to {total} (videos count as images here)"
        )
    at, pos = 0, 0
    for (t, h, w), step in zip(merged, steps, strict=True):
        # The item's tokens are the next t * h * w vision tokens (a run of them may be several
        # items, in order).
        size = t * h * w
        start = at + int(np.argmax(is_vision[at:]))
        if not is_vision[start : start + size].all():
            raise ValueError(f"image/video at token {start}: its {size} tokens are not contiguous")
        out[at:start] = (pos + np.arange(start - at))[:, None]
        pos += start - at
        time, rest = np.divmod(np.arange(size), h * w)
        if step is not None:  # (torch: arange * float32 interval, then .long())
            time = (time.astype(np.float32) * np.float32(step)).astype(np.int64)
        r, c = np.divmod(rest, w)
        out[start : start + size] = np.stack([time, r, c], -1) + pos
        pos += max(h, w)
        at = start + size
    out[at:] = (pos + np.arange(len(tokens) - at))[:, None]
    return out
