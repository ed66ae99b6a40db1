"""data.on_oversize: what happens to a sample no bucket can hold, decided at start-up.

`apply_oversize` finds the samples over a bound (`sample_limits` of the bucket spec: an LLM row
of a bucket, a context group's under context parallelism, and the encoder buckets when their
size is fixed) in one vectorised pass over the index's counts, a window of rows at a
time (memory bounded whatever the index's size), then applies the policy to those alone:
shrink lowers the image and video pixel budgets until the sample fits, then trims audio, cuts
videos and the sequence; truncate only trims and cuts; skip drops the sample; fail stops
naming it. A preference pair is never trimmed nor cut: shrunk until it fits whole, or skipped
(`pair_too_long`, naming the setting to raise). An index with none over is used as mapped;
otherwise the planner gets a patched copy of the counts (8 bytes a sample and an item).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxmllm.config import Config
from jaxmllm.config.phases import BY_NAME, ENCODERS
from jaxmllm.config.spec import BatchSpec
from jaxmllm.data.columnar import CHUNK, window
from jaxmllm.data.lengths import Items, LengthsIndex
from jaxmllm.data.preprocess import MEDIA, Limits, Preprocessor
from jaxmllm.data.records import read_record
from jaxmllm.data.rejects import DataError, RecordError, fail_message


def sample_limits(spec: BatchSpec) -> Limits:
    """What one sample may use, from the bucket spec: an LLM row of a bucket (a context
    group's row under context parallelism, `BatchSpec.group_row_len`: the planner places a
    sample's text on a group and deals its blocks to the group's devices), and each encoder
    bucket whose size is fixed (`batch.capacity: auto` sizes them from the data, so they always
    fit); with a context degree per step, the long variants' groups (`BatchSpec.top`)."""
    return Limits(max_tokens=spec.top.group_row_len, max_units=dict(spec.sample_units))


def apply_oversize(cfg: Config, stored, records, pre: Preprocessor):
    """Applies data.on_oversize to the samples of `stored` (a `StoredIndex`) no bucket holds.

    Returns (the planner's lengths, the index row of each sample or None where that is the
    sample's own, repairs by sample, reject entries).
    """
    spec = BatchSpec.of(cfg, resolved=False)  # (before the data sized the rest)
    caps, policy = sample_limits(spec), cfg.data.on_oversize
    index = stored.lengths()
    if within_bounds(stored.summary, caps):  # (the build's maxima: nothing to look for)
        return index, None, {}, []
    over, needs = over_bounds(index, pre.per_token, caps, row_key(spec))
    if not len(over):
        return index, None, {}, []
    repaired: dict[int, tuple[Limits, dict]] = {}
    dropped, rejects = [], []
    pairs = bool(stored.summary.get("pairs"))  # (a pair is never cut: shrunk, or skipped)
    for i, what in zip(over.tolist(), needs, strict=True):
        rid, line = stored.ids[i], int(stored.line[i])
        err = RecordError("oversize", what, rid)
        if pairs:  # (skipped or stopping the run, it is said so; shrunk, it is an oversize)
            why = f"{what}, its two documents together (a preference pair is never cut)"
            skip = RecordError("pair_too_long", f"{why}: raise {row_key(spec)}", rid)
        else:
            skip = err
        if policy == "fail":
            raise DataError(fail_message(skip, "data.on_oversize", f"line {line}"))
        fixed = None
        if policy != "skip":
            record = read_record(records, int(stored.row[i]))
            fixed = repair(record, stored.media_sizes(i), pre, caps, policy)
        if fixed is None:
            dropped.append(i)
            rejects.append(skip.to_json(line=line, action="skip"))
            continue
        repaired[i] = fixed
        rejects.append(err.to_json(line=line, action=policy, limits=fixed[0].to_json()))
    patched, keep = patch(index, {i: counts for i, (_, counts) in repaired.items()}, dropped)
    new_row = (lambda i: i) if keep is None else (lambda i: int(np.searchsorted(keep, i)))
    limits = {new_row(i): lim for i, (lim, _) in repaired.items()}
    return patched, keep, limits, rejects


def within_bounds(summary: dict, caps: Limits) -> bool:
    """Whether the index's summary says no sample is over a bound of `caps` (its maxima of
    LLM tokens and units per sample, which the build computed from the columns)."""
    stats = summary.get("percentiles", {})
    most = {None: stats.get("llm_tokens", {}).get("max")}
    for name in caps.max_units:
        p = BY_NAME[name]
        most[name] = stats.get(f"{p.unit}_per_sample", {"max": 0}).get("max")
    bounds = {None: caps.max_tokens, **caps.max_units}
    return all(isinstance(most[k], int) and most[k] <= bounds[k] for k in bounds)


def row_key(spec: BatchSpec) -> str:
    """The config key(s) that set the tokens of a sample's row, for messages."""
    top = spec.top  # (a context degree per step: the long variants' groups)
    if top.context == 1:
        return "batch.llm_row_len"
    return f"batch.llm_row_len x mesh.context (a context group's row, context {top.context})"


def over_bounds(
    index: LengthsIndex, per_token, caps: Limits, row: str = "batch.llm_row_len"
) -> tuple[np.ndarray, list[str]]:
    """The samples over a bound of `caps` (in order), and what each is over, in words (`row`:
    the key of the LLM row's bound)."""
    bounds = [("tokens", caps.max_tokens, row, None)]
    for name, cap in caps.max_units.items():
        p = BY_NAME[name]
        bounds.append((p.unit, cap, f"batch.{p.capacity}", name))
    found, words = [], []
    for start in range(0, len(index), CHUNK):
        stop = min(len(index), start + CHUNK)
        if not caps.max_units and most_tokens(index, start, stop, per_token) <= caps.max_tokens:
            continue  # (no sample of the window can be over: no sums needed)
        llm, units = chunk_needs(index, start, stop, per_token, caps.max_units)
        need = {None: llm, **units}
        over = np.zeros(stop - start, bool)
        for _, cap, _, phase in bounds:
            over |= need[phase] > cap
        for j in np.flatnonzero(over).tolist():
            found.append(start + j)
            over_what = [
                f"{need[phase][j]} {unit} > {key}={cap}"
                for unit, cap, key, phase in bounds
                if need[phase][j] > cap
            ]
            words.append(", ".join(over_what))
    return np.asarray(found, np.int64), words


def most_tokens(index: LengthsIndex, start: int, stop: int, per_token) -> int:
    """A bound on samples start..stop-1's LLM tokens: text + items x the window's largest."""
    bound = window(index.text, start, stop).astype(np.int64)
    for name, items in index.items.items():
        if len(items):
            ptr = window(items.ptr, start, stop + 1)
            largest = int(window(items.sizes, int(ptr[0]), int(ptr[-1])).max(initial=0))
            bound += np.diff(ptr) * (largest // per_token[name])
    return int(bound.max(initial=0))


def chunk_needs(index: LengthsIndex, start: int, stop: int, per_token, bounded=()) -> tuple:
    """Samples start..stop-1's LLM tokens, and units per encoder phase of those `bounded`."""
    llm = window(index.text, start, stop).astype(np.int64)
    units = {name: np.zeros(stop - start, np.int64) for name in bounded}
    for name, items in index.items.items():
        if not len(items):
            continue
        ptr = window(items.ptr, start, stop + 1)
        local = Items(ptr - ptr[0], window(items.sizes, int(ptr[0]), int(ptr[-1])))
        if name in bounded:
            units[name] = local.per_sample()
        per = per_token[name]  # (a shift where it is a power of two: integer division is slow)
        power = per & (per - 1) == 0
        llm += local.per_sample(
            local.sizes >> (per.bit_length() - 1) if power else local.sizes // per
        )
    return llm, units


def repair(record, sizes, pre: Preprocessor, caps: Limits, policy: str):
    """(limits, the repaired counts) or None when nothing learnable is left."""
    pixels = any(sizes.media[k] for k, media in MEDIA.items() if media.pixels)
    p = pre.p
    budget = p.image_max_pixels if policy == "shrink" and pixels else None
    unit = (p.patch_size * p.merge) ** 2
    while True:
        # (a video's budget shrinks with the images': at the same share of its own)
        video = None if budget is None else p.video_max_pixels * budget // p.image_max_pixels
        lim = dataclasses.replace(caps, max_pixels=budget, video_pixels=video or None)
        layout = pre.layout(record, sizes, lim)
        if budget is None or not layout.cut or budget <= unit:
            break
        budget = max(unit, int(budget * 0.8))  # shrink the images and videos until nothing is cut
    if layout.loss_tokens() == 0 or (layout.cut and layout.split is not None):
        return None  # (nothing learnable left, or a pair that does not fit whole)
    return lim, layout.counts()


def patch(index: LengthsIndex, counts: dict[int, dict], dropped: list[int]):
    """(`index` with sample i's counts replaced by `counts[i]` and the `dropped` samples left
    out, the index row of each remaining sample or None when none was left out)."""
    n = len(index)
    kept = np.ones(n, bool)
    kept[np.asarray(dropped, np.int64)] = False
    text = np.array(index.text, np.int64)
    split = None if index.split is None else np.array(index.split_of(), np.int64)
    changed = sorted(counts)
    for i in changed:
        text[i] = counts[i]["text"]
        if split is not None:  # (a pair repaired: where it splits now)
            cuts = np.atleast_1d(np.asarray(counts[i].get("split", 0), np.int64))
            split[i] = 0
            split[i, : len(cuts)] = cuts
    items = {}
    for p in ENCODERS:
        it = index.items[p.name]
        per = np.diff(it.ptr).astype(np.int64)
        pieces, last = [], 0
        for i in changed:
            new = np.asarray(counts[i][p.items], np.int64)
            pieces += [np.asarray(it.sizes[last : int(it.ptr[i])]), new]
            per[i], last = len(new), int(it.ptr[i + 1])
        sizes = np.concatenate([*pieces, np.asarray(it.sizes[last:])]).astype(np.int64)
        sizes = sizes[np.repeat(kept, per)]
        per = per[kept]
        items[p.name] = Items(np.concatenate([[0], np.cumsum(per)]).astype(np.int64), sizes)
    split = None if split is None else split[kept]
    patched = LengthsIndex(text[kept], items, shuffle=index.shuffle, split=split)
    return patched, (np.flatnonzero(kept) if len(dropped) else None)
