"""The fuzz target for checkpoints (`python tools/fuzz.py --targets safetensors`): small
safetensors files of every dtype jaxmllm reads, their header (JSON fields: dtypes, shapes,
offsets, the length prefix) or bytes mutated, through `SafetensorsFile`, with the safetensors
library as the oracle: each file must be refused by both (a CheckpointError here) or read by
both to the same bytes. One difference is documented: a tensor of no elements whose other
sizes numpy cannot hold (63-bit) is refused here, read there.
"""

from __future__ import annotations

import json
import random
import struct

import numpy as np

from tools.mutations import mutate


class OracleMismatch(Exception):
    """The safetensors library reads a file otherwise than jaxmllm does (a bug)."""


ST_DTYPES = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL")


def gen_safetensors(rng: random.Random) -> bytes:
    """A small safetensors file (as `write_checkpoint` writes one), often with its header or
    bytes mutated: dtypes, shapes and offsets set to odd or boundary values, keys dropped or
    added, the length prefix changed, the data cut or padded."""
    from jaxmllm.hf.safetensors import DTYPES

    header, blobs, offset = {}, [], 0
    for k in range(rng.randint(0, 4)):
        dtype = rng.choice(ST_DTYPES)
        shape = [rng.randint(0, 3) for _ in range(rng.randint(0, 3))]
        n = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        blobs.append(bytes(rng.getrandbits(8) for _ in range(n)))
        header[f"t{k}"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    if rng.random() < 0.3:
        header["__metadata__"] = rng.choice(({"format": "pt"}, {"a": 1}, [], "x", {}))
    if rng.random() < 0.7 and header:
        _mutate_header(header, rng)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8) if rng.random() < 0.8 else b""
    length = len(raw)
    if rng.random() < 0.1:
        length = rng.choice((0, 1, len(raw) - 1, len(raw) + 1, 1 << 40, 0xFFFFFFFFFFFFFFFF))
    data = struct.pack("<Q", length) + raw + b"".join(blobs)
    if rng.random() < 0.15:
        data = mutate(data, rng)
    return data


def _mutate_header(header: dict, rng: random.Random) -> None:
    name = rng.choice([k for k in header if k != "__metadata__"] or list(header))
    info = header[name]
    odd = (-1, 0, 1, 2, 7, 1 << 31, 1 << 62, 1 << 64, 1.5, "3", None, True, [1], {"a": 1})
    roll = rng.random()
    if not isinstance(info, dict):
        header[name] = rng.choice(odd)
    elif roll < 0.2:
        info["dtype"] = rng.choice(("F8_E4M3", "F4", "Q4", "f32", "", 3, None, ["F32"]))
    elif roll < 0.4 and isinstance(info.get("shape"), list):
        info["shape"] = (
            info["shape"] + [rng.choice(odd)]
            if rng.random() < 0.5
            else [rng.choice(odd) for _ in info["shape"]]
        )
    elif roll < 0.7 and isinstance(info.get("data_offsets"), list):
        i = rng.randrange(2)
        info["data_offsets"][i] = rng.choice(odd + (info["data_offsets"][1 - i],))
    elif roll < 0.8:
        info.pop(rng.choice(("dtype", "shape", "data_offsets")), None)
    elif roll < 0.9:
        info["extra"] = rng.choice(odd)
    else:
        header[name + "_copy"] = dict(info)  # two tensors over the same bytes


def safetensors_outcome(h, data: bytes) -> str:
    """`refused` or `ok`, as jaxmllm's reader and the safetensors library (the oracle) agree;
    OracleMismatch where they do not (one refuses what the other reads, or other bytes)."""
    import safetensors
    import torch

    from jaxmllm.hf.safetensors import DTYPES, CheckpointError, SafetensorsFile

    path = h.root / "fuzz.safetensors"
    path.write_bytes(data)
    try:
        ours, limit = SafetensorsFile(path), False
    except CheckpointError as e:  # (a documented difference: numpy's sizes are 63-bit)
        ours, limit = None, "numpy cannot hold" in str(e)
    try:  # (the header is validated on opening; torch reads the dtypes jaxmllm reads)
        with safetensors.safe_open(str(path), framework="pt") as f:
            theirs = {k: f.get_slice(k).get_dtype() for k in f.keys()}
            theirs = {k: f.get_tensor(k) if d in DTYPES else None for k, d in theirs.items()}
    except Exception:  # noqa: BLE001  (SafetensorError)
        theirs = None
    if (ours is None) != (theirs is None) and not limit:
        who = "jaxmllm refuses" if ours is None else "safetensors refuses"
        raise OracleMismatch(f"{who} a file the other reads")
    if ours is None:
        return "refused"
    if sorted(ours.names()) != sorted(theirs):
        raise OracleMismatch("other tensor names")
    for name, t in theirs.items():
        if t is not None:
            mine = ours.get(name)
            want = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            if mine.shape != tuple(t.shape) or mine.tobytes() != want:
                raise OracleMismatch(f"tensor {name} reads otherwise")
    return "ok"
