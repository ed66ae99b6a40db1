"""Parquet files as HuggingFace `datasets` writes them, read at random a row group at a time.

    {"id": "7", "image": {"bytes": b"\\x89PNG...", "path": "7.png"}, "conversations": [...]}
    {"images": [{"bytes": ..., "path": ...}], "messages": [{"role": "user", "content": ...}]}

A row is a dict of its columns (pyarrow's `to_pylist`): an `Image()` or `Audio()` column is a
`{"bytes", "path"}` struct (bytes embedded, or only a path, relative to data.media_root), a
list of them for a `Sequence(Image())`; a messages column is a list of `{"role", "content"}`
structs, where content parts carry every part's keys, None where a part has none
(`jaxmllm.data.records.schemas` reads such rows). Parquet cannot read one row alone: record k
reads its row group (columns of up to ~100 rows where `datasets` wrote images) and keeps the
last few groups read, so the index, which reads rows in order, decodes each group once. A row
group whose metadata says it decompresses to more than data.max_media_bytes is not read: each
of its rows is a reject (a few KB of Parquet can claim GBs of zeros). Dictionary-encoded text
and bytes columns are read as dictionaries (`read_dictionary`), never expanded whole: their
metadata counts each distinct value once, and 40 KB of Parquet repeating one 600 KB string in
2,000 rows expanded to 1.2 GB in 5 s. The group's expanded size is measured from the
dictionaries' value lengths instead, and a group over data.max_media_bytes is rejected the
same way; a row read expands only its own values. The file is held open in `handles.FILES`
(bounded: thousands of files never exhaust the handles).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np

from jaxmllm.config import ConfigError
from jaxmllm.data import budget
from jaxmllm.data.records.handles import FILES
from jaxmllm.data.rejects import MAX_MEDIA_BYTES

KEEP_GROUPS = 2  # row groups kept per process (a group of images is tens of MB)


class ParquetRecords:
    """Random access to the rows of a Parquet file, a row group at a time."""

    def __init__(
        self,
        path: str | Path,
        scan: dict[str, np.ndarray] | None = None,
        max_bytes: int = MAX_MEDIA_BYTES,
        max_memory: int = 0,
    ):
        self.path = Path(path)
        self.max_bytes = max_bytes  # data.max_media_bytes: a row group decompressing to more
        self.max_memory = max_memory  # data.worker_memory (budget.PARQUET_FACTOR x a group)
        if scan is None:
            with self._open() as f:
                meta = f.metadata
                rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            scan = {"starts": np.cumsum([0, *rows]).astype(np.int64)}
        self.starts = scan["starts"]  # [groups + 1]: the first row of each row group
        self._groups: OrderedDict[int, object] = OrderedDict()

    def scan(self) -> dict[str, np.ndarray]:
        return {"starts": self.starts}

    def _open(self):
        """The file (a context: held open in `handles.FILES`, closed when others push it out)."""
        return FILES.use(("parquet", str(self.path)), self._parquet_file, lambda f: f.close())

    def _parquet_file(self):
        import pyarrow.parquet as pq

        try:
            f = pq.ParquetFile(self.path, memory_map=True)
            coded = _dictionary_columns(f.metadata)
            if not coded:
                return f
            meta = f.metadata
            f.close()  # (reopened to read them as dictionaries, the footer already parsed)
            return pq.ParquetFile(self.path, memory_map=True, read_dictionary=coded, metadata=meta)
        except Exception as e:  # noqa: BLE001  pyarrow raises several kinds on a bad file
            raise ConfigError(f"{self.path}: not a readable Parquet file ({e})") from None

    def columns(self) -> list[str]:
        """The file's column names."""
        with self._open() as f:
            return list(f.schema_arrow.names)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def raw(self, k: int) -> tuple[object, int]:
        """(row k as a dict of its columns, k)."""
        g = int(np.searchsorted(self.starts, k, "right")) - 1
        table = self._group(g)
        if isinstance(table, dict):  # (the row group's reject)
            return table, int(k)
        return table.slice(int(k - self.starts[g]), 1).to_pylist()[0], int(k)

    def _group(self, g: int):
        if g in self._groups:
            self._groups.move_to_end(g)
            return self._groups[g]
        with self._open() as f:
            size = f.metadata.row_group(g).total_byte_size  # (uncompressed, from the metadata)
            if size > self.max_bytes:  # (the row group's reject, for each of its rows)
                table = _reject(
                    f"row group {g} decompresses to {size} bytes > data.max_media_bytes="
                    f"{self.max_bytes} (not read); raise it for rows of large inline media"
                )
            elif self.max_memory and budget.PARQUET_FACTOR * size > self.max_memory:
                what = f"reading row group {g} ({size} bytes decompressed)"
                cost = (
                    budget.PARQUET_FACTOR * size
                )  # (its pages, mapped and decompressed, and table)
                table = _reject(budget.over(cost, self.max_memory, what), "over_memory_budget")
            else:
                table = f.read_row_group(g, use_threads=False)
                size = sum(dense_bytes(chunk) for c in table.columns for chunk in c.chunks)
                if size > self.max_bytes:  # (dictionaries repeating a few values many times)
                    table = _reject(
                        f"row group {g} expands to {size} bytes (its dictionaries' values as "
                        f"its rows repeat them) > data.max_media_bytes={self.max_bytes}"
                    )
        self._groups[g] = table
        while len(self._groups) > KEEP_GROUPS:
            self._groups.popitem(last=False)
        return table

    def where(self, k: int) -> str:
        return f"{self.path.name} row {int(k)}"

    def fallback_id(self, k: int) -> str:
        return f"{self.path.name}:{int(k)}"

    def close(self) -> None:
        """Drops the cached row groups (the file itself is held in `handles.FILES`)."""
        self._groups = OrderedDict()

    def __getstate__(self):
        return {**self.__dict__, "_groups": OrderedDict()}


def _dictionary_columns(meta) -> list[str]:
    """The paths of the text and bytes columns some row group stores dictionary-encoded."""
    schema = meta.schema
    return [
        schema.column(i).path
        for i in range(meta.num_columns)
        if schema.column(i).physical_type == "BYTE_ARRAY"
        and any(meta.row_group(g).column(i).has_dictionary_page for g in range(meta.num_row_groups))
    ]


def dense_bytes(arr) -> int:
    """The bytes `arr` takes with its dictionaries' values written out once per use (what
    `to_pylist` makes of it), measured from the values' lengths without writing them out."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = arr.type
    if pa.types.is_dictionary(kind):
        values = kind.value_type
        if (
            pa.types.is_binary(values)
            or pa.types.is_string(values)
            or pa.types.is_large_binary(values)
            or pa.types.is_large_string(values)
        ):
            used = pc.take(pc.binary_length(arr.dictionary), arr.indices)
            return int(pc.sum(used).as_py() or 0) + arr.indices.nbytes
        return dense_bytes(arr.dictionary.take(arr.indices))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return dense_bytes(arr.flatten()) + 8 * len(arr)
    if pa.types.is_struct(kind):
        return sum(dense_bytes(field) for field in arr.flatten())
    return arr.nbytes


def _reject(detail: str, reason: str = "malformed_line") -> dict:
    """A row group's reject, as each of its rows reads: a marker the parser raises."""
    return {"__malformed__": detail, "__reason__": reason}
