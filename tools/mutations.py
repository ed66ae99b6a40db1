"""The byte mutations every fuzz target shares (tools/fuzz.py and its checkpoint target,
tools/fuzz_checkpoints.py): bit flips, boundary integers, truncations, deletions, duplicated
and inserted runs, splices of another seed, and a known format's size fields set to boundary
or huge values (a valid PNG CRC kept, so the decoder believes them)."""

from __future__ import annotations

import random
import struct
import zlib

INTERESTING = (
    0,
    1,
    2,
    0x7F,
    0x80,
    0xFF,
    0x100,
    0x7FFF,
    0x8000,
    0xFFFF,
    0x10000,
    0x7FFFFFFF,
    0x80000000,
    0xFFFFFFFF,
)
DIMS = (0, 1, 3, 255, 0x7FFF, 0xFFFF, 0x10000, 100_000, 1 << 24, 0x7FFFFFFF, 0xFFFFFFFF)


def mutate(data: bytes, rng: random.Random, others: list[bytes] = (), max_ops: int = 4) -> bytes:
    """`data` with 1..max_ops random edits (splices take a piece of one of `others`)."""
    b = bytearray(data)
    for _ in range(rng.randint(1, max_ops)):
        op = rng.choice(_OPS)
        b = op(b, rng, others) if op is _splice else op(b, rng)
    return bytes(b)


def _flip_bits(b: bytearray, rng) -> bytearray:
    for _ in range(rng.randint(1, 8)):
        if b:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    return b


def _set_int(b: bytearray, rng) -> bytearray:
    width = rng.choice((1, 2, 4))
    if len(b) >= width:
        i = rng.randrange(len(b) - width + 1)
        v = rng.choice(INTERESTING) & ((1 << 8 * width) - 1)
        b[i : i + width] = v.to_bytes(width, rng.choice(("little", "big")))
    return b


def _truncate(b: bytearray, rng) -> bytearray:
    return b[: rng.randrange(len(b) + 1)]


def _delete(b: bytearray, rng) -> bytearray:
    i = rng.randrange(len(b) + 1)
    return b[:i] + b[i + rng.randint(1, 64) :]


def _duplicate(b: bytearray, rng) -> bytearray:
    i = rng.randrange(len(b) + 1)
    j, k = sorted(rng.randrange(len(b) + 1) for _ in range(2))
    return b[:i] + b[j:k] * rng.randint(1, 4) + b[i:]


def _insert(b: bytearray, rng) -> bytearray:
    i = rng.randrange(len(b) + 1)
    return b[:i] + bytearray(rng.getrandbits(8) for _ in range(rng.randint(1, 32))) + b[i:]


def _splice(b: bytearray, rng, others) -> bytearray:
    if not others:
        return b
    other = rng.choice(others)
    i, j = rng.randrange(len(b) + 1), rng.randrange(len(other) + 1)
    return b[:i] + other[j:]


def _header_field(b: bytearray, rng) -> bytearray:
    """Sets a width/height or length field of a known format to a boundary or huge value."""
    w, h = rng.choice(DIMS), rng.choice(DIMS)
    if b[:8] == b"\x89PNG\r\n\x1a\n" and len(b) >= 33:
        b[16:24] = struct.pack(">II", w, h)
        if rng.random() < 0.9:  # a valid CRC, so the decoder believes it
            b[29:33] = struct.pack(">I", zlib.crc32(bytes(b[12:29])))
    elif b[:3] == b"GIF" and len(b) >= 10:
        b[6:10] = struct.pack("<HH", w & 0xFFFF, h & 0xFFFF)
    elif b[:2] == b"\xff\xd8":
        for marker in (b"\xff\xc0", b"\xff\xc2"):
            i = bytes(b).find(marker)
            if 0 < i < len(b) - 9:
                b[i + 5 : i + 9] = struct.pack(">HH", h & 0xFFFF, w & 0xFFFF)
    elif b[:2] == b"BM" and len(b) >= 26:
        b[18:26] = struct.pack("<II", w, h)
    elif b[:4] == b"RIFF" and b[8:12] == b"WAVE" and len(b) >= 44:
        field = rng.choice(((22, "<H"), (24, "<I"), (34, "<H")))  # channels, rate, bits
        b[field[0] : field[0] + struct.calcsize(field[1])] = struct.pack(
            field[1], w & (0xFFFF if field[1] == "<H" else 0xFFFFFFFF)
        )
        i = bytes(b).find(b"data")
        if i > 0 and rng.random() < 0.5:
            b[i + 4 : i + 8] = struct.pack("<I", h)
    elif b[:4] == b"fLaC" and len(b) >= 26:  # STREAMINFO: 20-bit rate .. 36-bit sample count
        if rng.random() < 0.5:
            b[18:20] = struct.pack(">H", w & 0xFFFF)
        b[21] = (b[21] & 0xF0) | (h >> 32 & 0x0F) | rng.choice((0, 0x0F))
        b[22:26] = struct.pack(">I", h & 0xFFFFFFFF)
    elif b[:4] == b"FORM" and len(b) >= 30:  # AIFF COMM: channels, frames
        i = bytes(b).find(b"COMM")
        if 0 < i < len(b) - 16:
            b[i + 8 : i + 14] = struct.pack(">HI", w & 0xFFFF, h)
    return b


_OPS = (
    _flip_bits,
    _flip_bits,
    _set_int,
    _truncate,
    _delete,
    _duplicate,
    _insert,
    _splice,
    _header_field,
    _header_field,
)
