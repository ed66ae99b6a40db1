"""The training source of a data set in any format: index checked, oversize applied.

`open_source(cfg)` is what the trainer's pipeline calls: it loads the lengths index that
`python -m jaxmllm.data.index` wrote (and stops, printing that command, when it is missing, was
built with other preprocessing settings or for other files, or accepted too few records),
applies data.on_oversize to the rows no bucket can hold, and returns a `ManifestSource` whose
item i is the Sample of index row i; for data.sources, a `MixtureSource` of one per source.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import grain
import numpy as np

from jaxmllm.config import Config, ConfigError, phases
from jaxmllm.config.phases import BY_NAME, ENCODERS
from jaxmllm.data.datasets import DataSet, acceptance_problem, data_sets, index_command, index_dir
from jaxmllm.data.frame_store import MANIFEST, FrameCache
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.data.mixture import MixtureSource
from jaxmllm.data.preprocess import MEDIA, Limits, Params, Preprocessor, Sizes
from jaxmllm.data.records import open_records, read_record
from jaxmllm.data.records.formats import data_files
from jaxmllm.data.rejects import DataError, RecordError, fail_message, index_line
from jaxmllm.data.samples import Sample
from jaxmllm.data.synthetic import SyntheticSource
from jaxmllm.data.text.tokenizer import PretrainedTokenizer, make_tokenizer

log = logging.getLogger("jaxmllm")

# ----------------------------------------------------------------------------- the source


class ManifestSource:
    """grain random-access source over the index's accepted records: `source[i]` -> Sample.

    Row i of the lengths index is record `rows[i]["row"]` of the file; `limits[i]` holds the
    oversize policy's repair of row i, if any.
    """

    def __init__(self, records, pre: Preprocessor, rows: list[dict], limits: dict[int, Limits]):
        self.records, self.pre, self.rows, self.limits = records, pre, rows, limits
        self.specials = pre.tokenizer.specials  # what bucketize pads with and finds slots by
        self.media_ids = list(self.specials.media.values())
        self.index = LengthsIndex.from_records(rows)
        self.startup_rejects: list[dict] = []  # oversize repairs and skips made at start-up
        self.index_rejects: dict[str, int] = {}  # rejects counted by the index, by reason

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Sample:
        return self.load(i)

    def load(self, i: int, keep: dict[str, tuple[int, ...]] | None = None) -> Sample:
        """Sample i, decoding only the items `keep[phase]` lists (None = all); the others are
        None in the Sample (on several hosts, another host encodes them)."""
        row = self.rows[int(i)]
        record = read_record(self.records, int(row["row"]))
        if record.id != row["id"]:
            raise RecordError(
                "changed_since_index", f"record {row['row']} is now {record.id!r}", row["id"]
            )
        limits = self.limits.get(int(i), Limits())
        sample = self.pre.sample(int(i), record, sizes_of(row), limits, keep)
        # The plan reserved exactly the index's counts; a record edited since (same byte size,
        # other tokens) would overflow its slot into a neighbour's, so refuse it instead.
        want = self.index.record(int(i))
        got = {"text": int(np.isin(sample.tokens, self.media_ids, invert=True).sum())}
        for p in ENCODERS:
            got[p.items] = [_indexed(want[p.items], j) if m is None else len(m[0])
                            for j, m in enumerate(sample.media[p.name])]  # fmt: skip
        if got != want:
            raise RecordError("changed_since_index", f"now {got}, the index says {want}", row["id"])
        return sample

    def record_id(self, i: int) -> str:
        return self.rows[int(i)]["id"]


def _indexed(counts: list, j: int) -> int:
    return counts[j] if j < len(counts) else -1  # -1: not in the index, a mismatch


def sizes_of(row: dict) -> Sizes:
    """The media sizes an index row recorded."""
    return Sizes({p: [tuple(s) for s in row.get(media.size_key, [])] for p, media in MEDIA.items()})


# ----------------------------------------------------------------------------- loading the index


def load_index(cfg: Config, ds: DataSet) -> tuple[list[dict], dict, Path]:
    """The index rows, summary and folder of data set `ds`, checked against the config and the
    files: it must exist, match the preprocessing settings and the files, and have accepted
    enough of the records (data.min_accept)."""
    out = index_dir(ds, Params.from_config(cfg).counted())
    try:
        files = data_files(ds.path)
    except FileNotFoundError as e:
        raise ConfigError(f"data.path: {e}") from None
    rebuild = f"Build it once with:\n  {index_command(cfg)}"
    if not (out / "summary.json").exists():
        raise ConfigError(f"no lengths index for {ds.path} in {out}/ (data.index_dir). {rebuild}")
    summary = json.loads((out / "summary.json").read_text())
    want = Params.from_config(cfg).counted()
    diff = [f"{k}: index {summary['params'].get(k)!r}, config {v!r}" for k, v in want.items()
            if summary["params"].get(k) != v]  # fmt: skip
    if diff:
        raise ConfigError(
            f"the index in {out}/ was built with other preprocessing settings ({'; '.join(diff)})."
            f" Rebuild it:\n  {index_command(cfg)}"
        )
    now = [[str(f.absolute()), f.stat().st_size] for f in files]
    if summary.get("files") != now:
        raise ConfigError(
            f"{ds.path} changed since its index in {out}/ was built. Rebuild it:\n"
            f"  {index_command(cfg)}"
        )
    problem = acceptance_problem(summary, cfg.data.min_accept)
    if problem:
        raise ConfigError(
            f"the index of {ds.path} in {out}/ {problem}; see {out}/rejects.jsonl, fix the "
            f"data (or data.format), then rebuild it:\n  {index_command(cfg)}"
        )
    with open(out / "lengths.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows, summary, out


def open_source(cfg: Config) -> ManifestSource | MixtureSource:
    """The training source of the config's data (data.path, or a mixture of data.sources):
    indexes loaded and checked, oversize policy applied."""
    sets = data_sets(cfg)  # (a config that names no data stops here, saying so)
    tokenizer = make_tokenizer(cfg.data.tokenizer, cfg.data.template_date)
    if cfg.model.llm.vocab_size < tokenizer.vocab_size:
        what = (
            f"incl. {len(tokenizer.added_tokens)} added placeholder token(s)"
            if isinstance(tokenizer, PretrainedTokenizer)
            else "incl. the 8 reserved specials"
        )
        raise ConfigError(
            f"model.llm.vocab_size={cfg.model.llm.vocab_size} is smaller than the tokenizer "
            f"({cfg.data.tokenizer}: {tokenizer.vocab_size} ids {what}); "
            f"raise model.llm.vocab_size to at least {tokenizer.vocab_size}"
        )
    parts = [open_data_set(cfg, ds, tokenizer) for ds in sets]
    if not cfg.data.sources:
        return parts[0]
    return MixtureSource(parts, sets)


def open_data_set(cfg: Config, ds: DataSet, tokenizer) -> ManifestSource:
    """One data set's source: its index loaded and checked, oversize policy applied."""
    rows, summary, out = load_index(cfg, ds)
    check_videos(cfg, sum(len(r.get(MEDIA["video"].size_key, [])) for r in rows), ds.path)
    if cfg.data.on_error == "fail" and summary.get("rejected"):
        first = json.loads((out / "rejects.jsonl").read_text().splitlines()[0])
        err = RecordError(first["reason"], first["detail"], first["id"])
        raise DataError(
            fail_message(err, "data.on_error", first.get("where") or f"line {first['line']}")
            + f" ({summary['rejected']} rejected records in all: {out}/rejects.jsonl)"
        )
    pre = Preprocessor(Params.from_config(cfg), tokenizer)
    if cfg.data.frame_cache:
        pre.frames = open_frame_cache(cfg, ds, out)
    with np.load(out / "scan.npz", allow_pickle=False) as saved:
        scan = dict(saved)
    records = open_records(
        ds.path, summary["format"], ds.media_root, scan, data=cfg.data, confine=ds.confine
    )
    level = logging.WARNING if summary.get("rejected") else logging.INFO  # (once, at start-up)
    log.log(level, index_line(ds.path, records.format, summary, out))
    kept, limits, startup = apply_oversize(cfg, rows, records, pre)
    source = ManifestSource(records, pre, kept, limits)
    source.startup_rejects = startup
    source.index_rejects = dict(summary.get("rejects", {}))
    return source


def open_frame_cache(cfg: Config, ds: DataSet, out: Path) -> FrameCache:
    """Data set `ds`'s frame cache (data.frame_cache), in its index folder `out`: built by
    `python -m jaxmllm.data.frames` for these preprocessing settings, or a ConfigError that
    says how to build it."""
    folder = out / "frames"
    build = index_command(cfg).replace("jaxmllm.data.index", "jaxmllm.data.frames")
    if not (folder / MANIFEST).is_file():
        raise ConfigError(
            f"data.frame_cache is true but {ds.path} has no frame cache in {folder}/ (for these "
            f"preprocessing settings). Build it once with:\n  {build}\nor set "
            "data.frame_cache: false to decode videos while training"
        )
    cache = FrameCache(folder)
    log.info("frame cache %s: %d videos (the others are decoded, counted)", folder, len(cache))
    return cache


def check_videos(cfg: Config, videos: int, where: str = "") -> None:
    """Stops the run when the data (the data set at `where`) has videos and the vision encoder
    does not take them."""
    if videos and not (cfg.model.vision.enabled and cfg.model.vision.video):
        raise ConfigError(
            f"the data ({where or cfg.data.path or cfg.data.source}) has {videos} video(s), but "
            "model.vision.video is false: set model.vision.video: true (and "
            "model.vision.enabled), or use data without videos"
        )


# ----------------------------------------------------------------------------- oversize


def bucket_limits(cfg: Config) -> Limits:
    """What one sample may use: the LLM row always; encoder buckets when their size is fixed
    (`batch.capacity: auto` sizes them from the data, so they always fit)."""
    b, m = cfg.batch, cfg.model
    fixed = b.capacity == "fixed"
    units = {p.name: p.bucket(b) for p in phases.enabled(m)} if fixed else {}
    return Limits(max_tokens=b.llm_row_len, max_units=units)


def apply_oversize(cfg: Config, rows: list[dict], records, pre: Preprocessor):
    """Applies data.on_oversize to rows no bucket can hold.

    Returns (kept rows, their repairs by new row number, reject entries). shrink lowers the
    image and video pixel budgets until the sample fits, then trims audio, cuts videos and the
    sequence; truncate only trims and cuts; skip drops the record; fail stops naming it.
    """
    caps, policy = bucket_limits(cfg), cfg.data.on_oversize
    need = _needs(LengthsIndex.from_records(rows), pre, caps)  # {what: (cap, key, per sample)}
    over = np.zeros(len(rows), bool)
    for cap, _, values in need.values():
        over |= values > cap
    kept, limits, rejects = [], {}, []
    for i, row in enumerate(rows):
        if not over[i]:
            kept.append(row)
            continue
        what = ", ".join(
            f"{values[i]} {unit} > batch.{key}={cap}"
            for unit, (cap, key, values) in need.items()
            if values[i] > cap
        )
        err = RecordError("oversize", what, row["id"])
        if policy == "fail":
            raise DataError(fail_message(err, "data.on_oversize", f"line {row['line']}"))
        repaired = None if policy == "skip" else _repair(row, records, pre, caps, policy)
        if repaired is None:
            rejects.append(err.to_json(line=row["line"], action="skip"))
            continue
        lim, new_row = repaired
        limits[len(kept)] = lim
        kept.append(new_row)
        rejects.append(err.to_json(line=row["line"], action=policy, limits=lim.to_json()))
    return kept, limits, rejects


def _needs(index: LengthsIndex, pre: Preprocessor, caps: Limits) -> dict[str, tuple]:
    """What each sample needs of each bounded bucket: {its unit: (the bound, its batch key,
    the need per sample)}."""
    out = {"tokens": (caps.max_tokens, "llm_row_len", index.llm_tokens(pre.per_token))}
    units = index.units()
    for name, cap in caps.max_units.items():
        p = BY_NAME[name]
        out[p.unit] = (cap, p.capacity, units[name])
    return out


def _repair(row: dict, records, pre: Preprocessor, caps: Limits, policy: str):
    """(limits, repaired row) or None when nothing learnable is left."""
    record = read_record(records, int(row["row"]))
    sizes = sizes_of(row)
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
    if layout.loss_tokens() == 0:
        return None
    return lim, {**row, **layout.counts()}


def make_source(cfg: Config) -> tuple[grain.MapDataset, LengthsIndex]:
    """The record source named by data.source and its lengths index.

    A manifest or ArrayRecord source reads its index (`python -m jaxmllm.data.index`), checks it
    against the config and applies data.on_oversize; row i of the index is `source[i]`.
    """
    if cfg.data.source == "synthetic":
        source = SyntheticSource(cfg)
        return grain.MapDataset.source(source), source.lengths()
    manifest = open_source(cfg)
    return grain.MapDataset.source(manifest), manifest.index
