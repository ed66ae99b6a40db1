"""safetensors files, read tensor by tensor from a memory map and written in shards.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length,
a JSON header `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the raw little-endian bytes. A checkpoint is one `model.safetensors` or several files named
by `model.safetensors.index.json`'s `weight_map`. Reading maps the file and returns views, so a
tensor's bytes are read when (and as far as) they are used; bfloat16 comes from ml_dtypes (what
JAX uses), so nothing needs torch.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint directory or file that cannot be read; the message names it and why."""


class SafetensorsFile:
    """One .safetensors file: its header, and each tensor as a read-only view of a map."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {self.path}: {e}") from None
        try:
            (length,) = struct.unpack("<Q", self._map[:8])
            self.header = json.loads(self._map[8 : 8 + length])
        except (struct.error, ValueError) as e:
            raise CheckpointError(f"{self.path}: not a safetensors file ({e})") from None
        self.metadata = self.header.pop("__metadata__", None) or {}
        self._start = 8 + length

    def names(self) -> list[str]:
        return list(self.header)

    def dtype(self, name: str) -> str:
        """The stored dtype's safetensors name (F32, BF16, ...)."""
        return self.header[name]["dtype"]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only view of the file (no copy until it is used)."""
        info = self.header[name]
        if info["dtype"] not in DTYPES:
            raise CheckpointError(
                f"{self.path}: tensor {name} has dtype {info['dtype']}, which jaxmllm does not "
                f"read ({', '.join(DTYPES)})"
            )
        begin, end = info["data_offsets"]
        dtype = DTYPES[info["dtype"]]
        shape = tuple(info["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != dtype.itemsize * count:
            raise CheckpointError(
                f"{self.path}: tensor {name}'s byte range does not match its shape "
                f"{list(shape)} and dtype {info['dtype']}"
            )
        flat = np.frombuffer(self._map, dtype, count=count, offset=self._start + begin)
        return flat.reshape(shape)


class Checkpoint:
    """The tensors of a HF checkpoint directory (one file or an index of shards), by name."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        index, single = self.dir / INDEX, self.dir / SINGLE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
            files = {f: SafetensorsFile(self.dir / f) for f in sorted(set(weight_map.values()))}
            self._where = {name: files[f] for name, f in weight_map.items()}
        elif single.is_file():
            file = SafetensorsFile(single)
            self._where = dict.fromkeys(file.names(), file)
        else:
            raise CheckpointError(
                f"{self.dir}: no {SINGLE} or {INDEX} (jaxmllm reads safetensors checkpoints; "
                "convert a pytorch_model.bin with transformers' save_pretrained first)"
            )

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"{self.dir}: no tensor {name}")
        return self._where[name].get(name)

    def dtype(self, name: str) -> str:
        return self._where[name].dtype(name)


def write_checkpoint(
    directory: str | Path, tensors: Iterable[tuple[str, np.ndarray]], max_shard_bytes: int = 4 << 30
) -> list[Path]:
    """Writes tensors as HF does: one model.safetensors, or shards of at most `max_shard_bytes`
    (a tensor larger than that gets a shard of its own) with model.safetensors.index.json.

    Returns:
      The files written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple[str, np.ndarray]]] = [[]]
    size = total = 0
    for name, array in tensors:
        n = array.nbytes
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, array))
        size += n
        total += n
    if len(shards) == 1:
        write_file(directory / SINGLE, shards[0])
        (directory / INDEX).unlink(missing_ok=True)
        return [directory / SINGLE]
    files, weight_map = [], {}
    for k, shard in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        write_file(directory / name, shard)
        files.append(directory / name)
        weight_map.update(dict.fromkeys((n for n, _ in shard), name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (directory / SINGLE).unlink(missing_ok=True)
    return files


def write_file(path: Path, tensors: list[tuple[str, np.ndarray]]) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, array in tensors:
        if array.dtype not in NAMES:
            raise CheckpointError(f"tensor {name}: dtype {array.dtype} has no safetensors name")
        header[name] = {
            "dtype": NAMES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, array in _contiguous(tensors):
            f.write(array.tobytes())
    tmp.replace(path)


def _contiguous(tensors: list[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    for name, array in tensors:
        yield name, np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False)
