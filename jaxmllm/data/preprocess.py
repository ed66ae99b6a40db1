"""Record -> Sample: tokenizing, the sequence layout, media decoding.

One layout function serves both the index and training: `layout(record, sizes, limits)` turns a
parsed record plus its media sizes (read from headers by the index, checked against the decoded
media at load time) into the exact token sequence and encoder items. So the index's counts are the
counts training sees, and the oversize policy can repair a sample (a smaller image budget, a
trimmed clip, a cut sequence) from the index alone. The tokenizer (`jaxmllm.data.text.tokenizer`)
says how a record becomes token runs and media markers (`pieces`) and which id fills an item's
rows (`specials`).

Each kind of media of the table (`jaxmllm.config.phases.KINDS`) has its media
(`jaxmllm.data.media.kinds.MEDIA`, by kind): how its files' sizes are read from their headers,
what parts an item becomes in its phase's bucket (an image one, a video one per temporal patch,
a long clip several chunks) and how they are decoded. A new modality adds its entry.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from jaxmllm.config.phases import BY_NAME, ENCODERS, KIND, KINDS, NAMES
from jaxmllm.data.media.kind import Decoding
from jaxmllm.data.media.kinds import MEDIA
from jaxmllm.data.media.video import VideoRule
from jaxmllm.data.params import SINCE, Limits, Params  # noqa: F401  (re-exported: their home)
from jaxmllm.data.records.record import Record
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.samples import Item, Sample
from jaxmllm.data.text.tokenizer import make_tokenizer

if TYPE_CHECKING:
    from jaxmllm.data.frame_store import FrameCache


@dataclass
class Sizes:
    """Media sizes of a record, per kind of media (every kind of the table): (height, width)
    per image, (samples, rate) per clip, (frames, rate, height, width) per video."""

    media: dict[str, list[tuple]] = field(default_factory=dict)

    def __post_init__(self):
        """Every kind of media of the table has its list (empty where the record has none)."""
        self.media = {k.name: list(self.media.get(k.name, [])) for k in KINDS}


class Text(NamedTuple):
    """A run of token ids in a layout, and which of them are learned."""

    ids: np.ndarray
    loss: np.ndarray


class Part(NamedTuple):
    """An encoder item in a layout: one part of one of the record's media items."""

    phase: str  # its encoder phase
    kind: str  # its kind of media
    source: int  # the record's item number of that kind
    part: int  # which part of it (a long clip's chunk, a video's temporal patch; 0 for an image)
    units: int  # patches / frames it takes in the phase's bucket
    # An image's or video frame's patch grid (rows, cols); a video placed in absolute time
    # (model.vision.tokens_per_second) adds M-RoPE's time step per temporal patch
    grid: tuple | None = None


@dataclass
class Layout:
    """The exact sequence of a sample: its text runs and encoder parts in order, and whether a
    limit cut it.

    A preference pair's layout holds its two documents' ops one after the other, the second's
    from `split` on. The same parts (the prompt's items) come in both: the sample's items are
    the first document's (`items`, `parts`), the second's are their placeholder rows again.
    The index row (`counts`) lists the items once and counts the second document's `repeated`
    placeholder rows as text, so that its LLM tokens (text + a token per encoder row) are the
    pair's tokens exactly, and says where it splits (`split`: the first document's LLM
    tokens, `first_tokens`), so that the planner prices its attention as two documents."""

    ops: list[Text | Part]
    cut: bool = False
    split: int | None = None  # where a pair's second document (rejected) starts; None: one
    repeated: int = 0  # a pair's placeholder rows in its second document
    first_tokens: int = 0  # a pair's first document's LLM tokens (text + a token per row)

    @property
    def items(self) -> list[Text | Part]:
        """The ops whose parts are the sample's items: all, or a pair's first document's."""
        return self.ops if self.split is None else self.ops[: self.split]

    def parts(self, phase: str | None = None) -> list[Part]:
        """The sample's encoder parts in order (of `phase` only, where given)."""
        return [op for op in self.items if isinstance(op, Part) and phase in (None, op.phase)]

    def counts(self) -> dict:
        """The sample in the lengths-file format."""
        text = sum(len(op.ids) for op in self.ops if isinstance(op, Text)) + self.repeated
        out = {"text": int(text)}
        out.update({BY_NAME[p].items: [op.units for op in self.parts(p)] for p in NAMES})
        if self.split is not None:  # (a pair: where its second document starts, in LLM tokens)
            out["split"] = int(self.first_tokens)
        return out

    def loss_tokens(self) -> int:
        """The tokens that carry the loss."""
        return int(sum(op.loss.sum() for op in self.ops if isinstance(op, Text)))


class Preprocessor:
    """Turns parsed records into layouts (from sizes alone) and Samples (decoding media)."""

    def __init__(self, params: Params, tokenizer=None):
        """A preprocessor of `params` with their tokenizer (or `tokenizer`, already made)."""
        self.p = params
        have = [name for name in params.encoders.split(",") if name]
        self.tokenizer = tokenizer or make_tokenizer(
            params.tokenizer, params.template_date, params.max_tokenizer_bytes, have
        )
        # (per encoder phase, from its own kind's media: every kind of a phase has the same)
        self.per_token = {p.name: MEDIA[p.name].per_token(params) for p in ENCODERS}
        self.frames: FrameCache | None = None  # videos' frames decoded once (data.frame_cache)
        self.frame_counts: Counter = Counter()  # the last sample's videos: cached or decoded

    def grid(self, h: int, w: int, limits: Limits = Limits()) -> tuple[int, int]:
        """The patch grid (rows, cols) of an h x w image within `limits`' pixel budget."""
        return self.p.patch_grid(h, w, limits.max_pixels or 0)

    def video_rule(self, limits: Limits = Limits()) -> VideoRule:
        """Videos' sampling and resize rule, within `limits`' video budget."""
        return self.p.video_rule(limits.video_pixels)

    def sizes(self, record: Record) -> Sizes:
        """The media sizes of a record, read from the files' headers (nothing is decoded);
        raises RecordError for a file over the bomb caps or one that does not open."""
        return Sizes(
            {
                k: [media.read_size(self.p, src, record.id) for src in record.media[k]]
                for k, media in MEDIA.items()
            }
        )

    def check(self, record: Record, sizes: Sizes) -> None:
        """Raises RecordError for an item its phase cannot use at all (a clip too short for
        one frame of features, a video for one temporal patch)."""
        for k, media in MEDIA.items():
            for j, size in enumerate(sizes.media[k]):
                media.check(self.p, j, size, record.id)

    def clip_chunks(self, samples: int, rate: int) -> list[int]:
        """The frames of each chunk of a clip of `samples` at `rate` Hz (`Params.clip_chunks`)."""
        return self.p.clip_chunks(samples, rate)

    def layout(
        self, record: Record, sizes: Sizes, limits: Limits = Limits(), generation: bool = False
    ) -> Layout:
        """The token sequence and encoder items of `record`, cut where `limits` say;
        `generation`: the prompt that generation continues (the tokenizer's `pieces`; a
        pair's prompt alone). A preference pair is never cut short: where its documents do
        not fit whole, its layout says `cut` and `sample` refuses it (`pair_too_long`)."""
        if record.is_pair and not generation:
            return self._pair(record, sizes, limits)
        return self._document(record, sizes, limits, generation)

    def _pair(self, record: Record, sizes: Sizes, limits: Limits) -> Layout:
        """A preference pair's layout: its chosen document, then its rejected one, each laid
        out whole with `limits`' media budgets (the same grids in both); cut where together
        they pass `limits.max_tokens`, or either passes a phase's units."""
        whole = replace(limits, max_tokens=None)
        chosen, rejected = (self._document(record.document(s), sizes, whole) for s in (0, 1))
        if [p[:5] for p in chosen.parts()] != [p[:5] for p in rejected.parts()]:
            raise RecordError(
                "placeholder_mismatch",
                "its chosen and rejected documents place the prompt's media differently (the "
                "chat template renders the prompt otherwise before each completion)",
                record.id,
            )
        rows = sum(p.units // self.per_token[p.phase] for p in chosen.parts())
        ops = [*chosen.ops, *rejected.ops]
        tokens = sum(len(op.ids) for op in ops if isinstance(op, Text)) + 2 * rows
        cut = chosen.cut or rejected.cut
        cut |= limits.max_tokens is not None and tokens > limits.max_tokens
        first = sum(len(op.ids) for op in chosen.ops if isinstance(op, Text)) + rows
        return Layout(ops, cut, split=len(chosen.ops), repeated=rows, first_tokens=first)

    def _document(
        self, record: Record, sizes: Sizes, limits: Limits, generation: bool = False
    ) -> Layout:
        """One document's layout (see `layout`)."""
        pieces = self.tokenizer.pieces(record, generation)
        budget = _Budget(limits)
        ops: list[Text | Part] = []
        for piece in pieces:
            if piece[0] == "text":
                keep = budget.take_tokens(len(piece[1]))
                if keep:
                    ops.append(Text(piece[1][:keep], piece[2][:keep]))
                if keep < len(piece[1]):
                    return Layout(ops, cut=True)
                continue
            kind, j = piece
            media, phase = MEDIA[kind], KIND[kind].phase
            per = self.per_token[phase]
            size = sizes.media[kind][j]
            stamps = media.stamps(self.p, size, limits)
            for c, (units, grid) in enumerate(media.parts(self.p, size, limits)):
                around = self.tokenizer.frame_text(kind, stamps[c]) if stamps else ()
                if around and not budget.fits(phase, units, per, sum(map(len, around))):
                    return Layout(ops, cut=True)  # (a temporal patch and its time, or neither)
                if around:
                    budget.take_tokens(len(around[0]))
                    ops.append(Text(around[0], np.zeros(len(around[0]), bool)))
                keep = budget.take(phase, units, per, whole=media.whole)
                if keep:
                    ops.append(Part(phase, kind, j, c, keep, grid))
                if len(around) and len(around[1]):
                    budget.take_tokens(len(around[1]))
                    ops.append(Text(around[1], np.zeros(len(around[1]), bool)))
                if keep < units:
                    return Layout(ops, cut=True)
        return Layout(ops)

    def sample(
        self,
        index: int,
        record: Record,
        sizes: Sizes,
        limits: Limits,
        keep: Mapping[str, tuple[int, ...]] | None = None,
        generation: bool = False,
    ) -> Sample:
        """Decodes the media and builds the Sample; checks the media against `sizes`.

        `keep[phase]`: numbers of the phase's Sample items (images, videos' temporal patches;
        clip chunks) to decode; the others are None, their tokens laid out from `sizes`
        (another host encodes them). None = all. `generation`: the record as a prompt to
        generate from.
        """
        lay = self.layout(record, sizes, limits, generation)
        if lay.split is not None and lay.cut:
            raise RecordError(
                "pair_too_long",
                f"its two documents do not fit whole in {limits.to_json()} (a pair is never "
                "cut): raise batch.llm_row_len (or the encoder buckets' capacity)",
                record.id,
            )
        count = dict.fromkeys(NAMES, 0)
        wanted: dict[tuple[str, int], list[int]] = {}  # (kind, source) -> its parts to decode
        for op in lay.parts():
            if keep is None or count[op.phase] in keep.get(op.phase, ()):
                wanted.setdefault((op.kind, op.source), []).append(op.part)
            count[op.phase] += 1
        self.frame_counts = Counter()  # (Videos.load: read from the frame cache, or decoded)
        decoding = Decoding(self.frames, self.frame_counts)
        decoded = {
            (kind, j): MEDIA[kind].load(
                self.p,
                record.media[kind][j],
                sizes.media[kind][j],
                limits,
                record.id,
                parts,
                item=j,
                decoding=decoding,
            )
            for (kind, j), parts in wanted.items()
        }
        tokens, loss = [], []
        media: dict[str, list[Item | None]] = {p: [] for p in NAMES}
        first = len(lay.items)  # (a pair's second document: its items' rows again, no items)
        for n, op in enumerate(lay.ops):
            if isinstance(op, Text):
                tokens.append(op.ids)
                loss.append(op.loss)
                continue
            if n < first:
                wants = op.part in wanted.get((op.kind, op.source), ())
                got = _part(decoded[op.kind, op.source], op, record.id) if wants else None
                media[op.phase].append(got)
            rows = op.units // self.per_token[op.phase]
            tokens.append(np.full(rows, self.tokenizer.specials.media[op.kind], np.int32))
            loss.append(np.zeros(rows, bool))
        ids = np.concatenate(tokens).astype(np.int32)
        chosen = sum(len(t) for t in tokens[:first])  # (one run of ids an op)
        return Sample(
            id=index,
            tokens=ids,
            loss=np.concatenate(loss).astype(bool),
            media=media,
            grids=grids(lay),
            frames=dict(self.frame_counts),
            documents=() if lay.split is None else (chosen, len(ids) - chosen),
        )


def grids(lay: Layout) -> list[tuple[int, int, int]]:
    """The (temporal patches, rows, cols) grid of each image or video of a layout, in order
    (M-RoPE places their tokens on it): an image is one temporal patch, a video as many as the
    layout kept of it (and its time step, where it is placed in absolute time); a video with
    text between its temporal patches (its times: data.video_timestamps) one grid each, as
    Qwen3-VL's `get_rope_index` splits a video's grid into its frames."""
    out: list[tuple] = []
    last = None  # the item of the op before, when it is a part
    for op in lay.items:
        if not isinstance(op, Part) or op.grid is None:
            last = None  # (text between a video's temporal patches: Qwen3-VL's times)
            continue
        if (op.kind, op.source) == last:
            out[-1] = (out[-1][0] + 1, *op.grid)
        else:
            out.append((1, *op.grid))
        last = (op.kind, op.source)
    return out


def _part(parts: list[Item | None], op: Part, record_id: str) -> Item:
    """Part `op.part` of a decoded item, as the layout took it: whole where its kind takes
    parts whole (the index's units exactly), else cut to the layout's units."""
    got = parts[op.part] if op.part < len(parts) else None
    values, pos = got if got is not None else (np.zeros(0), np.zeros(0, np.int32))
    whole = MEDIA[op.kind].whole
    if (len(values) != op.units) if whole else (len(values) < op.units):
        kind, phase = KIND[op.kind], BY_NAME[op.phase]
        raise RecordError(
            "changed_since_index",
            f"{kind.item} {op.source} (part {op.part}) has {len(values)} {phase.unit}, the index "
            f"says {op.units}",
            record_id,
        )
    return values[: op.units], pos[: op.units]


class _Budget:
    """Running totals against Limits while a layout is built."""

    def __init__(self, limits: Limits):
        """Tokens and, per encoder phase, units left under `limits` (unbounded where none)."""
        inf = math.inf
        self.tokens_left = limits.max_tokens if limits.max_tokens is not None else inf
        self.units_left = {p: limits.max_units.get(p, inf) for p in NAMES}

    def take_tokens(self, n: int) -> int:
        """Takes up to n tokens of what is left; returns how many fit."""
        keep = int(min(n, self.tokens_left))
        self.tokens_left -= keep
        return keep

    def fits(self, phase: str, units: int, per_token: int, tokens: int) -> bool:
        """Whether a whole part of `units` and `tokens` more tokens fit what is left."""
        left = self.tokens_left - tokens - units // per_token
        return units <= self.units_left[phase] and left >= 0

    def take(self, phase: str, units: int, per_token: int, whole: bool) -> int:
        """Units of an encoder part the limits let in: all or none where it is taken `whole`,
        else as many whole LLM tokens' worth as fit."""
        left = self.units_left[phase]
        if whole:
            keep = units if units <= left and units // per_token <= self.tokens_left else 0
        else:
            keep = int(min(units, left, self.tokens_left * per_token))
            keep -= keep % per_token
        self.units_left[phase] = left - keep
        self.tokens_left -= keep // per_token
        return keep
