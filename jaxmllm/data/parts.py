"""A build's parts and their merge: what each shard of an index build writes, and how the parts
become the index's columns without holding more than one part in memory.

A part is an .npz of arrays, written under a temporary name and renamed when complete
(`save_part`): a measure shard's accepted rows (`row_part`: counts per row, `<name>.count` and
the values of each ragged column), its rejects (`reject_part`), a scan shard's per-file
scans. `stream` writes columns from parts in two passes over them, one part loaded at a time:
the sizes, then the values, each column into a preallocated .npy (`columnar.ColumnWriter`).
A spec names a column and where its values are in a part:

    ("plain", name, key)                      part[key], a row per row
    ("strings", name, key)                    `Strings` from part[key.offsets], part[key.bytes]
    ("ragged", name, count_key, values_name, values_key)
                                              `<name>.ptr` from the counts per row, and the
                                              values (an array, or strings) as `values_name`

`keep` (a mask per part) leaves rows out (the duplicates the merge found), and with them their
ragged values.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from pathlib import Path

import numpy as np

from jaxmllm.config.phases import ENCODERS
from jaxmllm.data.columnar import ColumnWriter, Strings
from jaxmllm.data.preprocess import MEDIA

SIZES = {kind: media.size_key for kind, media in MEDIA.items()}


def size_dtype(kind: str):
    return np.float64 if float in MEDIA[kind].size_types else np.int64


def ragged_columns() -> list[tuple[str, str, object, tuple]]:
    """(name, its values' column, their dtype, a value's shape) of each ragged column of an
    index: the pointers are `<name>.ptr`, a part's counts per row `<name>.count`."""
    out = [(p.name, f"{p.name}.sizes", np.int64, ()) for p in ENCODERS]
    for kind, key in SIZES.items():
        out.append((key, f"{key}.values", size_dtype(kind), (len(MEDIA[kind].size_types),)))
    return out


# ----------------------------------------------------------------------------- parts


def row_part(rows: list[dict]) -> dict[str, np.ndarray]:
    """A shard's accepted rows (the index's measure() dicts) as a part's arrays."""
    ids = Strings.of(r["id"] for r in rows)
    out = {
        "text": _ints(r["text"] for r in rows),
        "row": _ints(r["row"] for r in rows),
        "line": _ints(r["line"] for r in rows),
        "id.offsets": ids.offsets,
        "id.bytes": ids.data,
        "id.hash": id_hashes(r["id"] for r in rows),
        "documents": _ints(r.get("documents", 1) for r in rows),  # (2: a preference pair)
        "split": _ints(r.get("split", 0) for r in rows),  # (a pair's first document's tokens)
    }
    for p in ENCODERS:
        out[f"{p.name}.count"] = _ints(len(r[p.items]) for r in rows)
        out[f"{p.name}.sizes"] = _ints(v for r in rows for v in r[p.items])
    for kind, key in SIZES.items():
        width = len(MEDIA[kind].size_types)
        out[f"{key}.count"] = _ints(len(r[key]) for r in rows)
        values = [v for r in rows for s in r[key] for v in s]
        out[f"{key}.values"] = np.asarray(values, size_dtype(kind)).reshape(-1, width)
    return out


def reject_part(rejects: list[dict]) -> dict[str, np.ndarray]:
    """A shard's rejects (in record order) as a part's arrays: each one's JSON line and row."""
    lines = Strings.of(json.dumps(r) for r in rejects)
    return {
        "rejects.offsets": lines.offsets,
        "rejects.bytes": lines.data,
        "rejects.row": _ints(r["row"] for r in rejects),
    }


def _ints(values) -> np.ndarray:
    return np.fromiter(values, np.int64)


def id_hashes(ids) -> np.ndarray:
    """64-bit hashes of record ids (the merge finds duplicates by sorting them)."""
    digest = lambda s: hashlib.blake2b(s.encode("utf-8", "surrogateescape"), digest_size=8)
    return np.fromiter((int.from_bytes(digest(s).digest(), "little") for s in ids), np.uint64)


def save_part(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Writes a part under a temporary name, then renames it into place: a reader sees the
    whole part or none (a shard killed while writing leaves only a temporary file)."""
    tmp = path.with_name(f"{path.stem}.tmp-{secrets.token_hex(6)}.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


def strings(part, key: str) -> Strings:
    """A part's strings `key` (its `key.offsets` and `key.bytes`)."""
    return Strings(part[f"{key}.offsets"], part[f"{key}.bytes"])


# ----------------------------------------------------------------------------- merging


def duplicates(paths: list[Path]) -> list[np.ndarray]:
    """Per part, which of its rows repeat an earlier row's id (by part, then row): the ids'
    64-bit hashes sorted (8 bytes a row in memory), equal hashes' ids compared."""
    hashes = []
    for path in paths:
        with np.load(path) as part:
            hashes.append(part["id.hash"])
    starts = np.cumsum([0, *map(len, hashes)])
    every = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
    order = np.argsort(every, kind="stable")  # (equal hashes keep their order)
    ranked = every[order]
    dup = np.zeros(len(every), bool)
    for r in (np.flatnonzero(ranked[1:] == ranked[:-1]) + 1).tolist():
        first = r
        while first > 0 and ranked[first - 1] == ranked[r]:
            first -= 1
        mine = _id_at(paths, starts, int(order[r]))
        dup[order[r]] = any(_id_at(paths, starts, int(order[j])) == mine for j in range(first, r))
    return [dup[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


def _id_at(paths: list[Path], starts: np.ndarray, k: int) -> str:
    p = int(np.searchsorted(starts, k, "right")) - 1
    with np.load(paths[p]) as part:
        return strings(part, "id")[k - int(starts[p])]


def row_specs(pairs: bool = False) -> list[tuple]:
    """The specs of an index's row columns in a measure part (`pairs`: with `split`, where
    each preference pair splits into its two documents; an index of no pairs has no such
    column, as every index built before it)."""
    names = ("text", "row", "line", "split") if pairs else ("text", "row", "line")
    specs = [("plain", name, name) for name in names]
    specs.append(("strings", "id", "id"))
    specs += [
        ("ragged", name, f"{name}.count", values, values) for name, values, _, _ in ragged_columns()
    ]
    return specs


def stream(folder: Path, paths: list[Path], specs: list[tuple], keep=None) -> dict[str, list]:
    """Writes the columns `specs` name from the parts at `paths` into `folder` (one part in
    memory at a time); returns their column table."""
    keep = keep if keep is not None else [None] * len(paths)
    sizes: dict[str, list] = {}
    for path, k in zip(paths, keep, strict=True):  # pass 1: each file's length (and row shape)
        with np.load(path) as part:
            for spec in specs:
                for file, array, pointer in _pieces(part, spec, k):
                    total = sizes.setdefault(file, [0, array.dtype, array.shape[1:], pointer])
                    total[0] += len(array)
    writers = {}
    for file, (n, dtype, row, pointer) in sizes.items():
        writers[file] = ColumnWriter(folder / file, dtype, (n + pointer, *row))
        if pointer:
            writers[file].write(np.zeros(1, np.int64))
    running = dict.fromkeys(writers, 0)
    for path, k in zip(paths, keep, strict=True):  # pass 2: the values
        with np.load(path) as part:
            for spec in specs:
                for file, array, pointer in _pieces(part, spec, k):
                    if pointer:  # (lengths become ends: running total + cumulative sum)
                        writers[file].write(running[file] + np.cumsum(array))
                        running[file] += int(array.sum())
                    else:
                        writers[file].write(array)
    return {file: w.close() for file, w in writers.items()}


def _pieces(part, spec: tuple, keep):
    """(file, its rows from this part, whether they are lengths to write as a pointer)."""
    kind, name = spec[0], spec[1]
    if kind == "plain":
        yield f"{name}.npy", _kept(part[spec[2]], keep), False
    elif kind == "strings":
        yield from _string_pieces(strings(part, spec[2]), name, keep)
    else:
        _, _, count_key, values_name, values_key = spec
        counts = part[count_key]
        yield f"{name}.ptr.npy", _kept(counts, keep), True
        item_keep = None if keep is None else np.repeat(keep, counts)
        if f"{values_key}.offsets" in part:
            yield from _string_pieces(strings(part, values_key), values_name, item_keep)
        else:
            yield f"{values_name}.npy", _kept(part[values_key], item_keep), False


def _string_pieces(column: Strings, name: str, keep):
    lengths = np.diff(column.offsets)
    data = np.asarray(column.data[int(column.offsets[0]) : int(column.offsets[-1])])
    yield f"{name}.offsets.npy", _kept(lengths, keep), True
    yield f"{name}.bytes.npy", data if keep is None else data[np.repeat(keep, lengths)], False


def _kept(array: np.ndarray, keep) -> np.ndarray:
    return array if keep is None else array[keep]
