"""safetensors files, read tensor by tensor from a memory map and written in shards.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length,
a JSON header `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the raw little-endian bytes. A checkpoint is one `model.safetensors` or several files named
by `model.safetensors.index.json`'s `weight_map`. Reading maps the file and returns views, so a
tensor's bytes are read when (and as far as) they are used; bfloat16 comes from ml_dtypes (what
JAX uses), so nothing needs torch.

Checkpoints come from strangers, so a file is validated as the safetensors library validates it
before anything is read or allocated from it: a header of at most 100 MB inside the file, a JSON
object of tensors, each with a known dtype, a shape of non-negative integers and data offsets
whose byte count is the shape's, the tensors tiling the data exactly (in order, no gap, no
overlap, to the end of the file); and a `weight_map` names files inside the directory only. Any
failure is a CheckpointError naming the file and the tensor.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxmllm.config.checks import UserError

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
# Bits per element of every dtype the format has (the header is validated with all of them;
# jaxmllm reads the ones in DTYPES).
BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "F64": 64,
    "I64": 64,
    "U64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}
MAX_HEADER = 100_000_000  # bytes (the safetensors library's limit)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(UserError):
    """A checkpoint directory or file that cannot be read; the message names it and why."""


# A float's exponent bits all set: Inf or NaN (read on the stored bits, in slices, so a
# bfloat16 table of a billion entries is scanned without a float copy of it).
EXPONENT = {"F64": 0x7FF0000000000000, "F32": 0x7F800000, "F16": 0x7C00, "BF16": 0x7F80}
SCAN = 1 << 24  # elements a slice


def first_nonfinite(array: np.ndarray, dtype: str) -> tuple[int, int]:
    """(how many elements of `array`, stored as safetensors `dtype`, are NaN or Inf, the flat
    index of the first); (0, -1) for a finite or integer tensor."""
    mask = EXPONENT.get(dtype)
    if mask is None:
        return 0, -1
    bits = np.dtype(f"<u{array.dtype.itemsize}")
    flat = array.reshape(-1).view(bits)
    count, first = 0, -1
    for begin in range(0, flat.size, SCAN):
        bad = (flat[begin : begin + SCAN] & bits.type(mask)) == bits.type(mask)
        n = int(np.count_nonzero(bad))
        if n and first < 0:
            first = begin + int(np.argmax(bad))
        count += n
    return count, first


class SafetensorsFile:
    """One .safetensors file: its header (validated), each tensor a read-only view of a map."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:  # (ValueError: an empty file cannot be mapped)
            raise CheckpointError(f"cannot read {self.path}: {e}") from None
        size = len(self._map)
        (length,) = struct.unpack("<Q", self._map[:8]) if size >= 8 else (-1,)
        if not 0 < length <= min(MAX_HEADER, size - 8):
            raise CheckpointError(
                f"{self.path}: not a safetensors file (a header of {length} bytes in a file of "
                f"{size}; at most {MAX_HEADER})"
            )
        try:
            header = json.loads(bytes(self._map[8 : 8 + length]).decode("utf-8"))
        except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
            raise CheckpointError(f"{self.path}: not a safetensors file ({e})"[:500]) from None
        self._start = 8 + length
        self.header = validate_header(header, size - self._start, self.path)
        self.metadata = header.get("__metadata__") or {}  # (validated: a dict or null)

    def names(self) -> list[str]:
        return list(self.header)

    def dtype(self, name: str) -> str:
        """The stored dtype's safetensors name (F32, BF16, ...)."""
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only view of the file (no copy until it is used)."""
        info = self.header[name]
        if info["dtype"] not in DTYPES:
            raise CheckpointError(
                f"{self.path}: tensor {name} has dtype {info['dtype']}, which jaxmllm does not "
                f"read ({', '.join(DTYPES)})"
            )
        begin, _ = info["data_offsets"]
        shape = tuple(info["shape"])
        flat = np.frombuffer(
            self._map, DTYPES[info["dtype"]], count=math.prod(shape), offset=self._start + begin
        )
        return flat.reshape(shape)


def validate_header(header: object, data_bytes: int, path: Path) -> dict[str, dict]:
    """The tensors of a parsed header ({name: {"dtype", "shape", "data_offsets"}}), checked as
    the safetensors library checks them against `data_bytes` bytes of data (see the module
    docstring); raises CheckpointError naming the file and the tensor."""
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is a {type(header).__name__}, not an object")
    meta = header.get("__metadata__")
    meta = {} if meta is None else meta  # (null: none, as the library reads it)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{path}: __metadata__ must map names to strings")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, info in tensors.items():
        _check_tensor(name, info, path)
    end = 0
    for name, info in sorted(tensors.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, stop = info["data_offsets"]
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else "leaves a gap before it"
            raise CheckpointError(f"{path}: tensor {name}'s data (bytes {begin}..{stop}) {what}")
        end = stop
    if end != data_bytes:
        raise CheckpointError(
            f"{path}: the tensors' data ends at byte {end}, the file's at {data_bytes} (a "
            "truncated or padded file)"
        )
    return tensors


USIZE = (1 << 64) - 1  # the library's sizes and offsets are 64-bit; numpy's arrays 63-bit


def _check_tensor(name: str, info: object, path: Path) -> None:
    where = f"{path}: tensor {name}"
    is_int = lambda x: isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= USIZE
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise CheckpointError(f"{where}: needs a dtype, a shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in BITS:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r:.40}")
    if not isinstance(shape, list) or not all(is_int(d) for d in shape):
        raise CheckpointError(f"{where}: the shape {shape!r:.80} is not a list of sizes >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_int, offsets))):
        raise CheckpointError(f"{where}: data_offsets {offsets!r:.80} are not [begin, end]")
    count = 1
    for d in shape:  # (as the library multiplies: an overflow of 64 bits is refused)
        count *= d
        if count > USIZE:
            raise CheckpointError(f"{where}: the shape {shape} overflows 64 bits")
    nonzero = math.prod(d for d in shape if d) * BITS[dtype] // 8
    if nonzero >= 1 << 63:  # a tensor of no elements whose other sizes numpy cannot hold
        raise CheckpointError(f"{where}: numpy cannot hold an array of shape {shape}")
    bits = count * BITS[dtype]
    if bits > USIZE or bits % 8 or offsets[1] - offsets[0] != bits // 8:
        raise CheckpointError(
            f"{where}: shape {shape} of {dtype} is {bits / 8:g} bytes, its data_offsets "
            f"{offsets} hold {offsets[1] - offsets[0]}"
        )


class Checkpoint:
    """The tensors of a HF checkpoint directory (one file or an index of shards), by name."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        index, single = self.dir / INDEX, self.dir / SINGLE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})"[:500]) from None
            if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) and f for f in weight_map.values()
            ):
                raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
            files = {f: SafetensorsFile(self._inside(f, index)) for f in set(weight_map.values())}
            self._where = {name: files[f] for name, f in weight_map.items()}
            for name, file in self._where.items():
                if name not in file.header:
                    raise CheckpointError(
                        f"{index}: weight_map puts {name} in {file.path}, which has no such tensor"
                    )
        elif single.is_file():
            file = SafetensorsFile(single)
            self._where = dict.fromkeys(file.names(), file)
        else:
            pickles = sorted(p.name for p in self.dir.glob("pytorch_model*.bin"))
            if pickles:
                raise CheckpointError(
                    f"{self.dir}: holds {pickles[0]} (a pickle, which jaxmllm never loads: "
                    f"it can run code) and no {SINGLE} or {INDEX}; convert it once with "
                    "transformers: AutoModel.from_pretrained(DIR).save_pretrained(DIR, "
                    "safe_serialization=True), or download the checkpoint's safetensors"
                )
            raise CheckpointError(
                f"{self.dir}: no {SINGLE} or {INDEX} (jaxmllm reads safetensors checkpoints; "
                "convert a pytorch_model.bin with transformers' save_pretrained first)"
            )

    def _inside(self, name: str, index: Path) -> Path:
        """A shard's path; refused unless it resolves (symlinks too) inside the directory."""
        path = self.dir / name
        try:
            inside = Path(os.path.realpath(path)).is_relative_to(os.path.realpath(self.dir))
        except ValueError:  # a NUL byte
            inside = False
        if not inside:
            raise CheckpointError(
                f"{index}: weight_map names a file outside {self.dir} ({name!r:.80}); a "
                "checkpoint's shards must be files in its own directory"
            )
        return path

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, from its file's header (nothing read)."""
        return self._where[name].shape(name)

    def file(self, name: str) -> Path:
        return self._where[name].path

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"{self.dir}: no tensor {name}")
        return self._where[name].get(name)

    def dtype(self, name: str) -> str:
        return self._where[name].dtype(name)

    def check_finite(self, name: str, array: np.ndarray | None = None) -> None:
        """Refuses a tensor holding NaN or Inf (`array`: the tensor, when already read).

        Raises:
          CheckpointError: naming the tensor, its file, how many entries and the first.
        """
        array = self.get(name) if array is None else array
        count, first = first_nonfinite(array, self.dtype(name))
        if count:
            where = np.unravel_index(first, array.shape) if array.shape else ()
            raise CheckpointError(
                f"{self.file(name)}: tensor {name} holds {count} NaN or Inf "
                f"value{'s' * (count > 1)} of {array.size} (the first at "
                f"{list(map(int, where))}): the checkpoint itself is broken, no setting of "
                "the run will train from it; use an intact copy of it"
            )


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
