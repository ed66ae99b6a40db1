"""The data sets a config names (data.path, or each of data.sources), where each one's lengths
index lives, and whether an index accepted enough of its records to train on.

An index's default folder is `<path>.index/<key>`: the key names what decides the index's
counts (the tokenizer and a hash of the preprocessing settings, the format and the media
folder), so two configs over one data set each keep their own index instead of overwriting
each other's. A data set holds the samples of one objective (`check_objective`): preference
pairs for `train.objective: dpo`, other records for `sft`.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from jaxmllm.config import Config, ConfigError, config_origin
from jaxmllm.config.data import no_data
from jaxmllm.config.sections import files_format
from jaxmllm.data.preprocess import Params


@dataclass(frozen=True)
class DataSet:
    """One data set a run reads."""

    path: str  # a file, a directory of shards or a glob
    format: str  # data.format (auto: detected when opened)
    media_root: str  # "" = the data file's folder
    index_dir: str  # "" = the keyed default (`index_dir`)
    name: str  # its name in the metrics and messages
    weight: float  # its share of a mixture (0: in proportion to its records)
    confine: str = ""  # the folder its media must stay inside; "" = media_root's (the base)


def data_sets(cfg: Config) -> list[DataSet]:
    """The data sets of a files source: data.path's, or one per data.sources entry.

    Raises:
      ConfigError: for a config that names no data (data.source: none, or left auto).
    """
    d = cfg.data
    if d.source == "none":
        origin = config_origin(cfg)
        raise ConfigError(no_data(origin[0] if origin else "<your config>"))
    if d.sources:
        return [
            DataSet(
                s.path,
                s.format if s.format != "auto" else files_format(d),
                s.media_root,
                s.index_dir,
                s.name or stem(s.path),
                s.weight,
                s.confine_media_to,
            )
            for s in d.sources
        ]
    fmt, confine = files_format(d), d.confine_media_to
    return [DataSet(d.path, fmt, d.media_root, d.index_dir, stem(d.path), 0.0, confine)]


def eval_set(cfg: Config) -> DataSet | None:
    """The held-out set of a files eval source (data.eval), or None."""
    e = cfg.data.eval
    if e.source in ("none", "synthetic"):
        return None
    d = cfg.data
    return DataSet(
        e.path, files_format(e), d.media_root, e.index_dir, stem(e.path), 0.0, d.confine_media_to
    )


def stem(path: str) -> str:
    """A data set's default name: its file's (folder's, glob's folder's) stem."""
    base = Path(_glob_base(path)) if _is_glob(path) else Path(path)
    return base.name.partition(".")[0] or "data"


def index_key(counted: dict, ds: DataSet) -> str:
    """What an index's counts depend on, as a folder name: the tokenizer's and a hash."""
    what = {
        **counted,
        "format": ds.format,
        "media_root": str(Path(ds.media_root).absolute()) if ds.media_root else "",
    }
    if ds.confine:  # (only when set: the keys of indexes built before it stay as they were)
        what["confine_media_to"] = str(Path(ds.confine).absolute())
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]
    tok = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(str(counted.get("tokenizer", "byte"))).name)
    return f"{tok}-{digest}"


def index_dir(ds: DataSet, counted: dict) -> Path:
    """Where a data set's lengths index lives: its index_dir, else `<path>.index/<key>` (a glob:
    `<its folder>/<the pattern>.index/<key>`)."""
    if ds.index_dir:
        return Path(ds.index_dir)
    key = index_key(counted, ds)
    if _is_glob(ds.path):
        name = re.sub(r"[*?\[\]]", "_", ds.path[len(_glob_base(ds.path)) :].strip("/"))
        return Path(_glob_base(ds.path)) / f"{name}.index" / key
    return Path(f"{str(ds.path).rstrip('/')}.index") / key


def _is_glob(path: str) -> bool:
    return any(c in str(path) for c in "*?[")


def _glob_base(path: str) -> str:
    """The folder part of a glob before its first wildcard."""
    head = re.split(r"[*?\[]", str(path), maxsplit=1)[0]
    return head.rpartition("/")[0] or "."


def check_index_dirs(cfg: Config, sets: list[DataSet]) -> None:
    """Refuses data sets that would share an index folder (two data.sources given one
    index_dir): an index is one data set's, so each build would replace the other's and
    training would then find a data set "changed since its index" that no rebuild fixes.

    Raises:
      ConfigError: naming both data sets and the folder.
    """
    counted = Params.from_config(cfg).counted()
    owner: dict[Path, DataSet] = {}
    for ds in sets:
        folder = index_dir(ds, counted).absolute()
        first = owner.setdefault(folder, ds)
        if first is not ds and str(first.path) != str(ds.path):
            raise ConfigError(
                f"{first.path} and {ds.path} would share the index folder {folder}/ (an "
                "index is one data set's: each build would replace the other's): give each "
                "data.sources entry (and data.eval) its own index_dir, or leave index_dir "
                "empty for the keyed folder beside each data set"
            )


def index_command(cfg: Config) -> str:
    """The command that (re)builds the indexes of `cfg`'s data: the config and overrides it
    was loaded with, when known."""
    origin = config_origin(cfg)
    if origin is None:
        return "python -m jaxmllm.data.index --config <your config>"
    path, overrides = origin
    sets = "".join(f" --set {shlex.quote(o)}" for o in overrides)
    return f"python -m jaxmllm.data.index --config {shlex.quote(path)}{sets}"


def check_objective(cfg: Config, ds: DataSet, pairs: int, records: int) -> None:
    """Refuses a data set whose records the run's objective does not train on: preference
    pairs under `train.objective: sft`, other records under `dpo`, or both in one data set
    (`pairs` of its `records` are pairs).

    Raises:
      ConfigError: naming the data set, what it holds and what to set.
    """
    objective, where = cfg.train.objective, data_key(cfg, ds)
    if 0 < pairs < records:
        raise ConfigError(
            f"{where} holds {pairs} preference pairs (prompt/chosen/rejected) and "
            f"{records - pairs} other records: a data set holds one kind; split it in two and "
            f"train each with its train.objective (dpo for the pairs, sft for the rest)"
        )
    if pairs and objective != "dpo":
        raise ConfigError(
            f"{where} holds preference pairs (prompt/chosen/rejected); set train.objective: "
            f"dpo (it is {objective!r}), or point the data at records to fine-tune on"
        )
    if records and not pairs and objective == "dpo":
        raise ConfigError(
            f"{where} holds no preference pairs (records with prompt/chosen/rejected), but "
            "train.objective is 'dpo'; set train.objective: sft, or point the data at "
            "preference pairs"
        )


def data_key(cfg: Config, ds: DataSet) -> str:
    """The config key that names data set `ds`, with its path (for messages)."""
    if cfg.data.sources:
        return f"data.sources' {ds.name!r} ({ds.path})"
    return f"data.path {ds.path}"


def acceptance_problem(summary: dict, min_accept: float) -> str | None:
    """Why an index is not fit to train on (it accepted nothing, or less than `min_accept` of
    its records), naming the most common reject reason with an example; None when it is."""
    records, accepted = summary.get("records", 0), summary.get("accepted", 0)
    if records and accepted and accepted >= min_accept * records:
        return None
    if not records:
        return f"{summary.get('data', 'the data')} holds no records"
    share = accepted / records
    why = f"accepted {accepted} of {records} records ({share:.0%})"
    why += ", none" if not accepted else f", less than data.min_accept={min_accept:g}"
    rejects = summary.get("rejects", {})
    if rejects:
        reason, n = max(rejects.items(), key=lambda kv: kv[1])
        example = summary.get("examples", {}).get(reason)
        why += f"; most common reason: {reason} ({n} records"
        why += f", e.g. {example['id']}: {example['detail']})" if example else ")"
    for hint in (summary.get("format_hint"), summary.get("media_hint")):
        why += f". {hint}" if hint else ""
    return why


def check_videos(cfg: Config, videos: int, where: str = "") -> None:
    """Stops the run when the data (the data set at `where`) has videos and the vision encoder
    does not take them."""
    if videos and not (cfg.model.vision.enabled and cfg.model.vision.video):
        raise ConfigError(
            f"the data ({where or cfg.data.path or cfg.data.source}) has {videos} video(s), but "
            "model.vision.video is false: set model.vision.video: true (and "
            "model.vision.enabled), or use data without videos"
        )
