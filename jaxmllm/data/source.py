"""The training source of a data set in any format: index checked, oversize applied.

`open_source(cfg)` is what the trainer's pipeline calls: it maps the lengths index that
`python -m jaxmllm.data.index` wrote (and stops, printing that command, when it is missing,
damaged or of an older format, was built with other preprocessing settings or for other files,
or accepted too few records), applies data.on_oversize to the samples no bucket can hold
(`jaxmllm.data.oversize`), and returns a `ManifestSource` whose item i is the Sample of index
row i; for data.sources, a `MixtureSource` of one per source. Opening reads the summary and
each column's header, checks the counts in one pass of bounded memory, and keeps nothing per
sample: the planner's lengths are views of the mapped columns.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from jaxmllm.config import Config, ConfigError
from jaxmllm.config.phases import ENCODERS, KIND
from jaxmllm.data.columnar import ColumnError, Strings
from jaxmllm.data.datasets import (
    DataSet,
    acceptance_problem,
    check_index_dirs,
    check_objective,
    check_videos,
    data_sets,
    eval_set,
    index_command,
    index_dir,
)
from jaxmllm.data.frame_store import MANIFEST, FrameCache
from jaxmllm.data.lengths import Items, LengthsIndex
from jaxmllm.data.mixture import MixtureSource
from jaxmllm.data.oversize import apply_oversize
from jaxmllm.data.preprocess import MEDIA, Limits, Params, Preprocessor
from jaxmllm.data.records import Records, media_paths, read_record
from jaxmllm.data.records.formats import data_files, detect
from jaxmllm.data.rejects import DataError, RecordError, fail_message, index_line
from jaxmllm.data.samples import Sample
from jaxmllm.data.stored import FORMAT, StoredIndex, check_lengths, check_places
from jaxmllm.data.synthetic import SyntheticSource
from jaxmllm.data.text.tokenizer import PretrainedTokenizer, config_tokenizer

log = logging.getLogger("jaxmllm")

# ----------------------------------------------------------------------------- the source


class ManifestSource:
    """grain random-access source over the index's accepted records: `source[i]` -> Sample.

    `stored` is the mapped index (`jaxmllm.data.stored.StoredIndex`); `index` the planner's
    lengths (the stored counts, or, where the oversize policy repaired or dropped samples, a
    patched copy); sample i is stored row `keep[i]` (None: row i), and `limits[i]` holds the
    oversize policy's repair of sample i, if any.
    """

    def __init__(
        self,
        records,
        pre: Preprocessor,
        stored: StoredIndex,
        index: LengthsIndex,
        keep: np.ndarray | None = None,
        limits: dict[int, Limits] | None = None,
    ):
        """A source over `index`'s rows (`keep`: the rows of `stored` they are, where some were
        dropped), laid out by `pre`; `limits`: per row, the oversize policy's repairs."""
        self.records, self.pre, self.stored, self.index = records, pre, stored, index
        self.keep, self.limits = keep, dict(limits or {})
        # (the planner's lengths are the mapped columns themselves: a worker maps them again)
        self.mapped = keep is None and index.text is stored.text
        self.specials = pre.tokenizer.specials  # what bucketize pads with and finds slots by
        self.media_ids = list(self.specials.media.values())
        self.startup_rejects: list[dict] = []  # oversize repairs and skips made at start-up
        self.index_rejects: dict[str, int] = {}  # rejects counted by the index, by reason
        # Whether every sample is a preference pair (`Sample.documents`: chosen, rejected);
        # the data set's index says (`train.objective: dpo` takes these and no others)
        self.pairs = False

    def __len__(self) -> int:
        """The accepted records: rows of the index."""
        return len(self.index)

    def __getitem__(self, i: int) -> Sample:
        """Index row i as a Sample, every item decoded (`load`)."""
        return self.load(i)

    def stored_row(self, i: int) -> int:
        """The index row of sample i."""
        return int(i) if self.keep is None else int(self.keep[int(i)])

    @property
    def rows(self) -> Rows:
        """The samples' index rows, as dicts (ids, places, counts, media sizes)."""
        return Rows(self)

    def load(self, i: int, keep: dict[str, tuple[int, ...]] | None = None) -> Sample:
        """Sample i, decoding only the items `keep[phase]` lists (None = all); the others are
        None in the Sample (on several hosts, another host encodes them)."""
        j = self.stored_row(i)
        rid, k = self.stored.ids[j], int(self.stored.row[j])
        if not 0 <= k < len(self.records):
            raise RecordError("changed_since_index", f"record {k} is past the data's end", rid)
        record = read_record(self.records, k)
        if record.id != rid:
            raise RecordError("changed_since_index", f"record {k} is now {record.id!r}", rid)
        limits = self.limits.get(int(i), Limits())
        sample = self.pre.sample(int(i), record, self.stored.media_sizes(j), limits, keep)
        # The plan reserved exactly the index's counts; a record edited since (same byte size,
        # other tokens) would overflow its slot into a neighbour's, so refuse it instead.
        want = self.index.record(int(i))
        got = {"text": index_text(sample, self.media_ids)}
        for p in ENCODERS:
            got[p.items] = [
                _indexed(want[p.items], j) if m is None else len(m[0])
                for j, m in enumerate(sample.media[p.name])
            ]
        if "split" in want:  # (a pair of an index that says where it splits)
            cuts = [int(d) for d in sample.documents[:-1]]
            got["split"] = (cuts[0] if len(cuts) == 1 else cuts) if cuts else 0
        if got != want:
            raise RecordError("changed_since_index", f"now {got}, the index says {want}", rid)
        return sample

    def record_id(self, i: int) -> str:
        """The record id of index row i (what rejects and summaries name)."""
        return self.stored.ids[self.stored_row(i)]

    def __getstate__(self):
        """The source as it travels to a loader worker: a mapped index is left out (the worker maps
        the files again) rather than copied through the pipe."""
        return {**self.__dict__, "index": None} if self.mapped else self.__dict__

    def __setstate__(self, state: dict) -> None:
        """The source in a loader worker: its index mapped again from the stored files."""
        self.__dict__.update(state)
        if self.index is None:
            self.index = self.stored.lengths()

    def head(self, n: int) -> ManifestSource:
        """This source's first `n` samples (a held-out set's share)."""
        index = self.index
        items = {
            p: Items(it.ptr[: n + 1], it.sizes[: int(it.ptr[n])]) for p, it in index.items.items()
        }
        split = index.split_rows(slice(0, n))
        part = LengthsIndex(index.text[:n], items, shuffle=index.shuffle, split=split)
        keep = np.arange(n) if self.keep is None else self.keep[:n]
        limits = {i: lim for i, lim in self.limits.items() if i < n}
        head = ManifestSource(self.records, self.pre, self.stored, part, keep, limits)
        head.pairs = self.pairs
        return head


class Rows:
    """A source's samples as index rows (dicts): `rows[i]`, `len(rows)`, iteration."""

    def __init__(self, source: ManifestSource):
        """The rows of `source`'s index."""
        self.source = source

    def __len__(self) -> int:
        """The source's rows."""
        return len(self.source)

    def __getitem__(self, i: int) -> dict:
        """Index row i as a dict: its record's id, row and line in the data files, its counts
        and its media sizes by the kinds' keys (what the lengths file holds)."""
        s, j = self.source, self.source.stored_row(i)
        sizes = s.stored.media_sizes(j)
        row = {"id": s.stored.ids[j], "row": int(s.stored.row[j]), "line": int(s.stored.line[j])}
        row.update(s.index.record(int(i)))
        row.update({m.size_key: [list(x) for x in sizes.media[k]] for k, m in MEDIA.items()})
        return row

    def __iter__(self):
        """Every row in order."""
        return (self[i] for i in range(len(self)))


def index_text(sample: Sample, media_ids: list[int]) -> int:
    """A sample's `text` in the lengths index: its tokens but its items' placeholder rows
    (a preference pair's rows come in both documents: counted as text once, so that text +
    a token per encoder row is its length)."""
    placed = int(np.isin(sample.tokens, media_ids).sum())
    return len(sample.tokens) - placed // max(1, len(sample.documents))


def _indexed(counts: list, j: int) -> int:
    """The index's count of item `j`, or -1 where the index has no such item (a mismatch)."""
    return counts[j] if j < len(counts) else -1  # -1: not in the index, a mismatch


# ----------------------------------------------------------------------------- loading the index


def load_index(cfg: Config, ds: DataSet) -> StoredIndex:
    """The index of data set `ds`, mapped and checked against the config and the files: it
    must exist, be whole (every column what its summary says), match the preprocessing
    settings and the files, and have accepted enough of the records (data.min_accept)."""
    out = index_dir(ds, Params.from_config(cfg).counted())
    try:
        files = data_files(ds.path)
    except FileNotFoundError as e:
        raise ConfigError(f"data.path: {e}") from None
    rebuild = f"Rebuild it:\n  {index_command(cfg)}"
    summary = _summary(out, ds, cfg)
    want = Params.from_config(cfg).counted()
    params = summary.get("params") if isinstance(summary.get("params"), dict) else {}
    diff = [
        f"{k}: index {params.get(k)!r}, config {v!r}" for k, v in want.items() if params.get(k) != v
    ]
    if diff:
        raise ConfigError(
            f"the index in {out}/ was built with other preprocessing settings ({'; '.join(diff)})."
            f" {rebuild}"
        )
    try:
        stored = StoredIndex(out, summary)
    except ColumnError as e:
        raise ConfigError(f"the index in {out}/ is damaged: {e}. {rebuild}") from None
    if not same_files(stored, files):
        built_for = summary.get("data")
        if isinstance(built_for, str) and built_for != str(ds.path):  # (a folder two shared)
            raise ConfigError(
                f"the index in {out}/ was built for {built_for} (its summary.json), not "
                f"{ds.path}: each data set needs an index folder of its own (data.index_dir, "
                f"data.sources[].index_dir). {rebuild}"
            )
        raise ConfigError(f"{ds.path} changed since its index in {out}/ was built. {rebuild}")
    fmt = ds.format if ds.format != "auto" else detect(files)[0]
    if summary.get("format") != fmt:
        raise ConfigError(
            f"the index in {out}/ says its files are {summary.get('format')!r}, they read as "
            f"{fmt!r}. {rebuild}"
        )
    problem = acceptance_problem(summary, cfg.data.min_accept)
    if problem:
        raise ConfigError(
            f"the index of {ds.path} in {out}/ {problem}; see {out}/rejects.jsonl, fix the "
            f"data (or data.format), then rebuild it:\n  {index_command(cfg)}"
        )
    return stored


def _summary(out: Path, ds: DataSet, cfg: Config) -> dict:
    """The index's summary.json, or a ConfigError saying why there is no usable one."""
    command = index_command(cfg)
    if not (out / "summary.json").exists():
        if (out / "lengths.jsonl").exists():
            raise ConfigError(
                f"the index in {out}/ is an older jaxmllm's (lengths.jsonl); this one maps "
                f"columns instead. Rebuild it:\n  {command}"
            )
        raise ConfigError(
            f"no lengths index for {ds.path} in {out}/ (data.index_dir). Build it once "
            f"with:\n  {command}"
        )
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (ValueError, OSError) as e:
        raise ConfigError(
            f"{out}/summary.json is unreadable ({e}). Rebuild it:\n  {command}"
        ) from None
    if not isinstance(summary, dict) or summary.get("index_format") != FORMAT:
        found = summary.get("index_format") if isinstance(summary, dict) else None
        raise ConfigError(
            f"the index in {out}/ is of another format ({out}/summary.json says "
            f"index_format {found!r}, this jaxmllm reads {FORMAT!r}). Rebuild it:\n  {command}"
        )
    return summary


def same_files(stored: StoredIndex, files: list[Path]) -> bool:
    """Whether `files` are the index's data files, with the sizes they had."""
    now = Strings.of(str(f.absolute()) for f in files)
    sizes = np.asarray([f.stat().st_size for f in files], np.int64)
    indexed = stored.files
    return (
        np.array_equal(now.offsets, indexed.offsets)
        and np.array_equal(now.data, indexed.data)
        and np.array_equal(sizes, stored.file_sizes)
    )


def open_source(cfg: Config) -> ManifestSource | MixtureSource:
    """The training source of the config's data (data.path, or a mixture of data.sources):
    indexes loaded and checked, oversize policy applied."""
    sets = data_sets(cfg)  # (a config that names no data stops here, saying so)
    check_index_dirs(cfg, [*sets, *[e for e in [eval_set(cfg)] if e is not None]])
    tokenizer = config_tokenizer(cfg)
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
    """One data set's source: its index mapped and checked, oversize policy applied."""
    stored = load_index(cfg, ds)
    summary, out = stored.summary, stored.folder
    pairs = int(summary.get("pairs", 0))  # (an index from before pairs holds none)
    check_objective(cfg, ds, pairs, int(summary.get("accepted", 0)))
    check_videos(cfg, len(stored.sizes["video"][1]), ds.path)
    if cfg.data.on_error == "fail" and summary.get("rejected"):
        with open(out / "rejects.jsonl") as f:
            first = json.loads(f.readline())
        err = RecordError(first["reason"], first["detail"], first["id"])
        raise DataError(
            fail_message(err, "data.on_error", first.get("where") or f"line {first['line']}")
            + f" ({summary['rejected']} rejected records in all: {out}/rejects.jsonl)"
        )
    try:
        check_lengths(stored, largest_items(cfg))
        check_places(stored)
    except ColumnError as e:
        raise ConfigError(
            f"the index in {out}/ is damaged: {e}. Rebuild it:\n  {index_command(cfg)}"
        ) from None
    pre = Preprocessor(Params.from_config(cfg), tokenizer)
    if cfg.data.frame_cache:
        pre.frames = open_frame_cache(cfg, ds, out)
    files = FileList(stored.files)
    caps = {"max_bytes": cfg.data.max_media_bytes, "max_memory": pre.p.worker_memory}
    paths = media_paths(ds.path, files, ds.media_root, cfg.data, ds.confine)
    records = Records(
        files,
        stored.file_starts,
        summary["format"],
        paths,
        stored.scans,
        summary.get("detected", ""),
        caps,
    )
    level = logging.WARNING if summary.get("rejected") else logging.INFO  # (once, at start-up)
    log.log(level, index_line(ds.path, records.format, summary, out))
    index, keep, limits, startup = apply_oversize(cfg, stored, records, pre)
    source = ManifestSource(records, pre, stored, index, keep, limits)
    source.pairs = pairs > 0
    source.startup_rejects = startup
    source.index_rejects = dict(summary.get("rejects", {}))
    return source


class FileList:
    """The index's data files as Paths, from its mapped column."""

    def __init__(self, paths: Strings):
        """The index's mapped column of data file paths."""
        self.paths = paths

    def __len__(self) -> int:
        """The data files."""
        return len(self.paths)

    def __getitem__(self, f: int) -> Path:
        """Data file f's path."""
        return Path(self.paths[f])


def largest_items(cfg: Config) -> dict[str, int]:
    """Per encoder phase, the most units one item can have under the config's preprocessing
    (an index claiming more was not written by a build with these settings)."""
    out: dict[str, int] = {}
    for kind, media in MEDIA.items():
        if hasattr(media, "largest"):
            phase = KIND[kind].phase
            out[phase] = max(out.get(phase, 0), media.largest(cfg))
    return out


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


def make_source(
    cfg: Config,
) -> tuple[SyntheticSource | ManifestSource | MixtureSource, LengthsIndex]:
    """The record source data.source names (`source[i]` -> the Sample of index row i, as
    itself: a random-access source is all the feed reads) and its lengths index.

    A manifest or ArrayRecord source reads its index (`python -m jaxmllm.data.index`), checks it
    against the config and applies data.on_oversize; row i of the index is `source[i]`.
    """
    if cfg.data.source == "synthetic":
        source = SyntheticSource(cfg)
        return source, source.lengths()
    manifest = open_source(cfg)
    return manifest, manifest.index
