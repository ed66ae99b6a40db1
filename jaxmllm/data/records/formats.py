"""data.format: the file formats a data set may come in, and `auto`'s detection.

A format is a container (how records are stored: JSON lines, one JSON list, Parquet, .tar
shards, ArrayRecord) and a schema (what a record's fields are: `jaxmllm.data.records.schemas`).
`data.path` names a file, a directory of shards or a glob (`data_files`); `detect` reads the
files' names and, for JSON, the first record, and says which format it found and why.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from jaxmllm.config import ConfigError, printable
from jaxmllm.config.sections import FORMATS as FORMAT_NAMES
from jaxmllm.data.records.jsonarray import scan_array
from jaxmllm.data.records.parquet import ParquetRecords
from jaxmllm.data.records.record import PAIR_KEYS, parse_record
from jaxmllm.data.records.schemas import is_pair
from jaxmllm.data.records.walk import files_below, glob_files
from jaxmllm.data.rejects import RecordError

log = logging.getLogger("jaxmllm")


@dataclass(frozen=True)
class Format:
    """One value of data.format."""

    name: str
    container: str  # json (a list or JSON lines, by the file) | jsonl | parquet | tar | arrayrecord
    schema: str  # the records' fields (`schemas.SCHEMAS`)
    what: str  # what it reads, for messages


FORMATS = {
    f.name: f
    for f in (
        Format("jsonl", "jsonl", "jaxmllm", "jaxmllm's records, one JSON object a line"),
        Format(
            "llava",
            "json",
            "conversations",
            "LLaVA records ('conversations' of 'from'/'value' turns)",
        ),
        Format(
            "sharegpt",
            "json",
            "conversations",
            "ShareGPT records ('conversations' of 'from'/'value' turns)",
        ),
        Format(
            "messages",
            "json",
            "messages",
            "OpenAI-style 'messages' records (or preference pairs: 'prompt', 'chosen', 'rejected')",
        ),
        Format("parquet", "parquet", "any", "Parquet files"),
        Format("webdataset", "tar", "any", "WebDataset .tar shards"),
        Format("arrayrecord", "arrayrecord", "jaxmllm", "ArrayRecord files"),
    )
}
assert set(FORMATS) == set(FORMAT_NAMES) - {"auto"}, "config.sections.FORMATS != these"
BY_SUFFIX = {".parquet": "parquet", ".tar": "webdataset", ".array_record": "arrayrecord"}
JSON_SUFFIXES = (".json", ".jsonl")
DATA_SUFFIXES = (*BY_SUFFIX, *JSON_SUFFIXES)
PACKED = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip")  # a data file's, compressed: refused
PACKED_TARS = (".tgz", ".tbz", ".tbz2", ".txz")  # (a .tar, compressed, by its one suffix)
PEEK = 1 << 22  # bytes read to find a JSON list's first record (more when it is longer)
FIRST_MAX = 1 << 26  # the longest first record `detect` parses (a longer one: set data.format)


def data_files(path: str | Path) -> list[Path]:
    """The files `path` names: itself, the data files in a directory (at its top, else below
    it, leaving out index folders), or a glob's matches; in sorted order. Links to folders
    are followed once each (`walk`): never into a loop, never a folder's files twice."""
    text = str(path)
    if any(c in text for c in "*?["):
        files = glob_files(text)  # (links to folders followed once: never into a loop)
        if not files:
            raise FileNotFoundError(f"no data file matches {printable(text)}")
        return files
    path = Path(path)
    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.is_file() and _data_or_packed(f))
        if not any(f.suffix in DATA_SUFFIXES for f in files):  # (none at the top: below it)
            files = [
                f
                for f in files_below(path)
                if _data_or_packed(f) and not _hidden_or_index(f.relative_to(path))
            ]
        files = _without_packed(path, files)
        if not files:
            raise FileNotFoundError(
                f"{printable(path)} holds no data files ({', '.join(DATA_SUFFIXES)})"
            )
        return files
    if not path.exists():
        raise FileNotFoundError(f"no such data file: {printable(path)}")
    return [path]


def _packed(f: Path) -> str | None:
    """The data suffix of a compressed data file (`000.tar.gz`, `a.tgz`: `.tar`), else None."""
    if f.suffix in PACKED_TARS:
        return ".tar"
    inner = Path(f.stem).suffix
    return inner if f.suffix in PACKED and inner in DATA_SUFFIXES else None


def _data_or_packed(f: Path) -> bool:
    return f.suffix in DATA_SUFFIXES or _packed(f) is not None


def _without_packed(path: Path, files: list[Path]) -> list[Path]:
    """The folder's data files, refusing it when compressed files may be some of them
    (`000.tar.gz` beside `001.tar`, or nothing but compressed files): read at random they
    cannot be, and left out their records would be lost without a word. A compressed file of
    another kind than the data's (`images.tar.gz` beside `train.jsonl`: a media archive) is
    left out, and the log says so."""
    plain = [f for f in files if f.suffix in DATA_SUFFIXES]
    packed = [f for f in files if f.suffix not in DATA_SUFFIXES]
    if not packed:
        return files
    kinds = {f.suffix for f in plain}
    refused = [f for f in packed if not plain or _packed(f) in kinds]
    if not refused:
        log.warning(
            "%s: left out %d compressed file(s) that are not %s data files: %s",
            printable(path),
            len(packed),
            "/".join(sorted(kinds)),
            ", ".join(printable(f.name) for f in packed[:3]) + (" ..." if len(packed) > 3 else ""),
        )
        return plain
    names = ", ".join(printable(f.name) for f in refused[:3])
    more = f" and {len(refused) - 3} more" if len(refused) > 3 else ""
    glob = ""
    if plain:
        stars = "*" if all(f.parent == path for f in files) else "**/*"
        glob = f", or leave them out: data.path: {printable(path)}/{stars}{plain[0].suffix}"
    raise ConfigError(
        f"{printable(path)} holds compressed data files ({names}{more}), which jaxmllm cannot "
        f"read at random: decompress them (gunzip, zstd -d, ...){glob}"
    )


def _hidden_or_index(rel: Path) -> bool:
    return any(part.startswith(".") or part.endswith(".index") for part in rel.parts)


def detect(files: list[Path]) -> tuple[str, str]:
    """(the data.format of `files`, why): by their suffix, and a JSON file by its first record."""
    kinds = {BY_SUFFIX.get(f.suffix, "json") for f in files}
    if len(kinds) > 1:
        suffixes = sorted({f.suffix or "(none)" for f in files})
        raise ConfigError(
            f"{files[0].parent} holds files of several formats "
            f"({', '.join(suffixes)}): point data.path at one kind, e.g. a glob "
            f"{files[0].parent}/*{files[0].suffix}"
        )
    kind = kinds.pop()
    many = f"{len(files)} files" if len(files) > 1 else files[0].name
    if kind != "json":
        return kind, f"{many} ending in {files[0].suffix}"
    container = json_container(files[0])
    obj = first_record(files[0], container)
    shape = "a JSON list" if container == "array" else "JSON lines"
    if not isinstance(obj, dict):
        raise ConfigError(
            f"cannot tell the format of {files[0]}: its first record is not a JSON "
            "object; set data.format"
        )
    if is_pair(obj):  # (TRL's, RLAIF-V's, LLaMA-Factory's: read as `schemas.from_pair` says)
        return "messages", f"{many}: {shape} of preference pairs ('chosen' and 'rejected')"
    if "prompt" in obj or "question" in obj:  # (online RL's: `schemas.prompt_answer`)
        return "messages", f"{many}: {shape} of prompts ('prompt' or 'question') with answers"
    if "conversations" in obj:
        return "llava", f"{many}: {shape} whose first record has 'conversations' (LLaVA/ShareGPT)"
    if "messages" in obj or "text" in obj:
        if container == "lines" and _native(obj, files[0].parent):
            return "jsonl", f"{many}: JSON lines of jaxmllm records ('id', 'text' or 'messages')"
        return "messages", f"{many}: {shape} whose first record has 'messages' or 'text'"
    keys = ", ".join(list(obj)[:8])
    raise ConfigError(
        f"cannot tell the format of {files[0]}: its first record has keys {keys}; "
        f"set data.format to one of {', '.join(FORMATS)}"
    )


def holds_pairs(files: list[Path], fmt: str) -> bool | None:
    """Whether the data set of `files` in data.format `fmt` holds preference pairs, by its first
    record (JSON) or its columns (Parquet); None where that takes more than a look (.tar
    shards, ArrayRecord: the index counts its pairs, `summary.json`'s `pairs`)."""
    container = FORMATS[fmt].container
    if container in ("json", "jsonl"):
        obj = first_record(files[0], json_container(files[0]))
        return is_pair(obj) if isinstance(obj, dict) else None
    if container == "parquet":
        try:
            columns = ParquetRecords(files[0]).columns()
        except ConfigError:
            return None
        return any(k in columns for k in PAIR_KEYS)
    return None


def _native(obj: dict, base: Path) -> bool:
    """Whether jaxmllm's own parser reads the record's fields (its media aside): no content
    part names its own file (jaxmllm's parts are bare placeholders)."""
    messages = obj.get("messages") if isinstance(obj.get("messages"), list) else []
    for m in messages:
        parts = m.get("content") if isinstance(m, dict) else None
        for part in parts if isinstance(parts, list) else []:
            if isinstance(part, dict) and any(
                v is not None for k, v in part.items() if k not in ("type", "text")
            ):
                return False
    try:
        parse_record(obj, base, 1)
    except RecordError as e:
        return e.reason != "malformed_line"
    return True


def json_container(path: Path) -> str:
    """`array` (the file is one JSON list) or `lines` (JSON lines), by its first character.

    Raises:
      ConfigError: for a UTF-16 or UTF-32 file (by its byte-order mark), which would read as
        lines cut in the middle of their characters, each a reject that does not say why.
    """
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith((b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")):
        raise ConfigError(
            f"{printable(path)}: UTF-16 or UTF-32 text (it starts with that byte-order mark); "
            "JSON data files are read as UTF-8: convert it, e.g. iconv -f UTF-16 -t UTF-8"
        )
    head = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    return "array" if head.startswith(b"[") else "lines"


def first_record(path: Path, container: str) -> object:
    """The first record of a JSON file (None when it has none, or it does not parse)."""
    with open(path, "rb") as f:
        if container == "lines":
            for line in f:
                if line.strip():
                    try:
                        return json.loads(line)
                    except (ValueError, RecursionError):
                        return None
            return None
        data = f.read(PEEK)
        text = data.decode("utf-8-sig", errors="replace").lstrip()[1:].lstrip()
        try:
            return json.JSONDecoder().raw_decode(text)[0]
        except (ValueError, RecursionError):
            if len(data) < PEEK:
                return None
    try:  # (a first record longer than PEEK: found without reading the file whole)
        scan = scan_array(path, limit=1)
    except ConfigError:
        return None
    if not len(scan["starts"]) or scan["ends"][0] - scan["starts"][0] > FIRST_MAX:
        return None  # (then the format is data.format's to say)
    start, end = int(scan["starts"][0]), int(scan["ends"][0])
    with open(path, "rb") as f:
        f.seek(start)
        try:
            return json.loads(f.read(end - start))
        except (ValueError, RecursionError):
            return None
