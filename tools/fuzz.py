"""Fuzzing of the manifest and media decoders: every input must end in a policy outcome.

    python tools/fuzz.py --seconds 300                 # all targets, time split evenly
    python tools/fuzz.py --seconds 60 --targets image,jsonl --findings fuzz-findings/

Each target feeds one kind of hostile input to the functions the index and the loader use:
- `image`, `audio`: random bytes and mutated PNG/JPEG/GIF/WebP/BMP/TIFF/PPM and WAV/FLAC/OGG/AIFF
  files (bit flips, truncation, splices, width/height/length header fields set to huge values,
  decompression bombs) through the header read (the index) and, when it accepts, the full decode
  (the loader);
- `jsonl`: generated and mutated manifest lines (wrong types, missing keys, bad base64, placeholder
  mismatches, deep or huge JSON, lone surrogates, non-UTF-8, media as paths, special files and
  inline data) through the record parser, the index's `measure` and the loader's Sample;
- `arrayrecord`: mutated ArrayRecord records through the same;
- `safetensors`: small checkpoint files of every dtype jaxmllm reads, their header (JSON fields:
  dtypes, shapes, offsets, the length prefix) or bytes mutated, through `SafetensorsFile` with
  the safetensors library as the oracle: each file must be refused by both (a CheckpointError
  here) or read by both to the same bytes.

An input's outcome is `ok`, `index:<reason>` or `load:<reason>` (a reject; reason one of REASONS),
`refused` (a checkpoint both readers refuse), or a bug: `unhandled:<exception type>`, `hang`
(over --hang-s seconds), `invariant:<what>` (the loader's counts differ from the index's for the
same bytes), `oracle:<what>` (the safetensors library disagrees) or `overcap:image|audio` (the
layout or a decoder got an image or clip larger than the header caps allow; sizes are checked,
not time).
The run prints inputs tried and the outcome counts per target, saves each bug's first input under
--findings, and exits 1 on any bug.

A tool, not part of the package (tests/test_fuzz.py imports it as `tools.fuzz`); run as a script
it tests the jaxmllm of the checkout it sits in.
"""

from __future__ import annotations

import argparse
import base64
import functools
import io
import json
import os
import random
import signal
import struct
import sys
import tempfile
import time
import traceback
import warnings
import weakref
import zlib
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's jaxmllm first

from jaxmllm.data.index import measure
from jaxmllm.data.media.audio import read_info
from jaxmllm.data.media.image import ImageCaps, read_size
from jaxmllm.data.preprocess import Params, Preprocessor
from jaxmllm.data.records.arrayrecord import decode_record, encode_record
from jaxmllm.data.records.jsonl import parse_line
from jaxmllm.data.records.record import MediaPaths
from jaxmllm.data.rejects import REASONS, RecordError
from jaxmllm.data.source import ManifestSource
from jaxmllm.data.stored import StoredIndex
from tools.fuzz_checkpoints import OracleMismatch, gen_safetensors, safetensors_outcome
from tools.mutations import mutate

TARGETS = ("image", "audio", "jsonl", "arrayrecord", "safetensors")
IMAGE_SEEDS = (
    "rgb.png",
    "gray.png",
    "pal.png",
    "deep.png",
    "rgb.jpg",
    "prog.jpg",
    "cmyk.jpg",
    "anim.gif",
    "lossy.webp",
    "lossless.webp",
    "rgb.bmp",
    "rgb.tiff",
    "rgb.ppm",
)
AUDIO_SEEDS = ("mono.wav", "stereo.wav", "tone.flac", "tone.ogg", "tone.aiff")
SPECIAL_PATHS = ("dir", "fifo", "missing.png", "/dev/zero", "/dev/null", "rgb.png\x00x", "..")

# ----------------------------------------------------------------------------- seeds


def png_bomb(width: int, height: int) -> bytes:
    """A valid 1-bit PNG of zeros: a few bytes per row compressed, width*height pixels decoded."""
    z, row = zlib.compressobj(1), b"\x00" * (1 + (width + 7) // 8)
    rows = [z.compress(row * min(1000, height - i)) for i in range(0, height, 1000)]
    idat = b"".join(rows) + z.flush()
    return _png(struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0), idat)


def _png(ihdr: bytes, idat: bytes) -> bytes:
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def make_seeds() -> dict[str, bytes]:
    """Small valid media files of many formats and modes (deterministic), by file name."""
    from PIL import Image

    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 255, (20, 28, 3)).astype(np.uint8))
    deep = Image.fromarray(rng.integers(0, 65535, (12, 9)).astype(np.uint16))
    pal = rgb.convert("P")
    pal.info["transparency"] = 3
    images = {
        "rgb.png": (rgb, "PNG", {}),
        "gray.png": (rgb.convert("L"), "PNG", {}),
        "pal.png": (pal, "PNG", {"transparency": 3}),
        "deep.png": (deep, "PNG", {}),
        "rgb.jpg": (rgb, "JPEG", {"exif": _exif(6)}),
        "prog.jpg": (rgb, "JPEG", {"progressive": True}),
        "cmyk.jpg": (rgb.convert("CMYK"), "JPEG", {}),
        "anim.gif": (pal, "GIF", {"save_all": True, "append_images": [pal.rotate(90)]}),
        "lossy.webp": (rgb, "WEBP", {}),
        "lossless.webp": (rgb.convert("RGBA"), "WEBP", {"lossless": True}),
        "rgb.bmp": (rgb, "BMP", {}),
        "rgb.tiff": (rgb, "TIFF", {"compression": "tiff_deflate"}),
        "rgb.ppm": (rgb, "PPM", {}),
    }
    out = {}
    for name, (img, fmt, kw) in images.items():
        buf = io.BytesIO()
        img.save(buf, format=fmt, **kw)
        out[name] = buf.getvalue()
    out.update(_audio_seeds(rng))
    return out


def _exif(orientation: int):
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


def _audio_seeds(rng: np.random.Generator) -> dict[str, bytes]:
    import soundfile as sf

    t = np.arange(3000) / 16000
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    clips = {
        "mono.wav": (tone, 16000, "WAV", "PCM_16"),
        "stereo.wav": (np.stack([tone, tone[::-1]], 1), 22050, "WAV", "FLOAT"),
        "tone.flac": (tone, 16000, "FLAC", "PCM_16"),
        "tone.ogg": (tone, 16000, "OGG", "VORBIS"),
        "tone.aiff": (tone, 8000, "AIFF", "PCM_24"),
    }
    out = {}
    for name, (x, rate, fmt, subtype) in clips.items():
        buf = io.BytesIO()
        sf.write(buf, x, rate, format=fmt, subtype=subtype)
        out[name] = buf.getvalue()
    return out


# ----------------------------------------------------------------------------- records


def gen_record(rng: random.Random, seeds: dict[str, bytes]) -> object:
    """A manifest object, well-formed or broken in one of the ways real manifests are."""
    n_img, n_aud = rng.choice((0, 0, 1, 1, 2, 3)), rng.choice((0, 0, 1, 2))
    words = lambda: rng.choice(
        ("a cat", "", " ", "x" * rng.randint(1, 300), "\u00e9\u4e2d", "\ud800")
    )
    text = " ".join(
        ["<image>"] * (n_img + rng.choice((0, 0, 0, 1, -1)))
        + ["<audio>"] * (n_aud + rng.choice((0, 0, 0, 1, -1)))
        + [words()]
    )
    odd_ids = (7, "", None, True, 1.5, [1], "\ud800")
    rec: dict = {"id": f"r{rng.randrange(100)}" if rng.random() < 0.8 else rng.choice(odd_ids)}
    if rng.random() < 0.6:
        rec["text"] = text if rng.random() < 0.95 else rng.choice((3, None, [text], {"t": text}))
    else:
        rec["messages"] = _messages(rng, text, words)
    if rng.random() < 0.05:
        rec["text" if "messages" in rec else "messages"] = "both"
    for key, count, names in (("images", n_img, IMAGE_SEEDS), ("audio", n_aud, AUDIO_SEEDS)):
        if count or rng.random() < 0.1:
            entries = [_media(rng, names, seeds) for _ in range(count)]
            rec[key] = entries if rng.random() < 0.95 else rng.choice(("x.png", 3, {"a": 1}))
    if rng.random() < 0.05:
        rec.pop(rng.choice(list(rec)))
    return rec


def _messages(rng, text: str, words) -> object:
    roles = ("user", "assistant", "system", "bot", None, 3)
    msgs = [{"role": "user", "content": text}, {"role": "assistant", "content": words()}]
    for _ in range(rng.randint(0, 3)):
        content = rng.choice(
            (
                words(),
                None,
                5,
                [],
                [{"type": "text", "text": words()}],
                [{"type": "image"}],
                [{"type": "video"}],
                ["raw"],
                {"x": 1},
            )
        )
        msgs.insert(rng.randrange(len(msgs) + 1), {"role": rng.choice(roles), "content": content})
    if rng.random() < 0.05:
        return rng.choice(([], "hi", [1], {"role": "user"}))
    return msgs


def _media(rng, names: tuple[str, ...], seeds: dict[str, bytes]) -> object:
    name = rng.choice(names)
    roll = rng.random()
    if roll < 0.35:
        return name
    if roll < 0.7:
        data = seeds[name] if rng.random() < 0.5 else mutate(seeds[name], rng, list(seeds.values()))
        b64 = base64.b64encode(data).decode()
        if rng.random() < 0.5:
            return {"base64": b64}
        return f"data:application/octet-stream;base64,{b64}"
    return rng.choice(
        SPECIAL_PATHS
        + (
            "data:image/png;base64,***",
            "data:,",
            {"base64": "abc"},
            {"base64": 12},
            {"base64": "é"},
            {"path": name},
            42,
            None,
            "",
            ["x"],
            {"missing": "gone.png"},
        )
    )


ODD_LINES = (
    b'{"id": 1, "text": "x", "n": ' + b"9" * 5000 + b"}",  # over Python's int-digits limit
    b'{"id": 1e999, "text": "NaN"}',
    b"NaN",
    b"\xef\xbb\xbf{}",
    b'{"id": "a", "text": "\xff\xfe"}',
    b'{"id":"a","text":"x"}' * 3,
    b'"just a string"',
    b"[]",
    b"null",
)


def gen_line(rng: random.Random, seeds: dict[str, bytes]) -> bytes:
    """One manifest line: a generated record, serialized and sometimes mutated, or odd JSON."""
    roll = rng.random()
    if roll < 0.08:
        depth = rng.choice((10, 900, 5000, 100_000))
        return b"[" * depth + b"]" * depth if rng.random() < 0.5 else b'{"a":' * depth + b"1"
    if roll < 0.12:
        return rng.choice(ODD_LINES + (bytes(rng.getrandbits(8) for _ in range(64)),))
    line = json.dumps(gen_record(rng, seeds)).encode()
    if rng.random() < 0.25:
        line = mutate(line, rng)
    return line


# ----------------------------------------------------------------------------- targets


class Invariant(Exception):
    """The loader saw other counts than the index for the same bytes (a bug, not a reject)."""


@dataclass
class Harness:
    """The media folder records point to and the preprocessing they go through."""

    root: Path
    seeds: dict[str, bytes]
    pre: Preprocessor


def make_harness(
    root: str | Path, max_image_pixels: int = 1 << 22, max_audio_seconds: float = 30.0
) -> Harness:
    """Writes the seeds and special paths (a folder, a FIFO) under `root`; tiny-config params.

    The caps are lower than the defaults so that accepted inputs decode fast (same code paths).
    """
    root = Path(root)
    seeds = make_seeds()
    for name, data in seeds.items():
        (root / name).write_bytes(data)
    (root / "dir").mkdir(exist_ok=True)
    if hasattr(os, "mkfifo") and not (root / "fifo").exists():
        os.mkfifo(root / "fifo")
    params = Params(
        tokenizer="byte",
        tokenizer_sha256="",
        patch_size=4,
        merge=2,
        image_min_pixels=256,
        image_max_pixels=1024,
        audio_sample_rate=16000,
        audio_max_frames=32,
        subsample=4,
        n_mels=16,
        max_image_pixels=max_image_pixels,
        max_audio_seconds=max_audio_seconds,
    )
    return Harness(root, seeds, Preprocessor(params))


class _Records:
    """In-memory records: raw bytes of JSONL lines or ArrayRecord records, parsed as the real
    sources parse them."""

    def __init__(self, items: list[bytes], base_dir: Path, arrayrecord: bool = False):
        self.items, self.base_dir, self.arrayrecord = items, base_dir, arrayrecord
        self.paths = MediaPaths(base_dir)  # media paths confined to the harness's folder

    def __len__(self) -> int:
        return len(self.items)

    def raw(self, k: int) -> tuple[object, int]:
        if self.arrayrecord:
            return decode_record(self.items[k])
        return parse_line(self.items[k]), k + 1


def record_outcome(h: Harness, records) -> str:
    """Record 0 through the index's measure, then the loader (ManifestSource checks the counts)."""
    row = measure(records, h.pre, 0)
    if not row.pop("ok"):
        if row["reason"] == "record_failed":  # (measure caught an exception: a bug here)
            raise RuntimeError(row["detail"])
        return f"index:{row['reason']}"
    try:
        stored = StoredIndex.of_rows([row])
        ManifestSource(records, h.pre, stored, stored.lengths())[0]
    except RecordError as e:
        if e.reason == "changed_since_index":
            raise Invariant(e.detail) from None
        return f"load:{e.reason}"
    return "ok"


def image_outcome(h: Harness, data: bytes | Path) -> str:
    """An image's header read as the index does, then its decode as the loader does."""
    return record_outcome(h, _Records([_record_with(h, data, "images")], h.root))


def audio_outcome(h: Harness, data: bytes | Path) -> str:
    """A clip's header read as the index does, then its decode as the loader does."""
    return record_outcome(h, _Records([_record_with(h, data, "audio")], h.root))


def _record_with(h: Harness, data: bytes | Path, key: str) -> bytes:
    entry = str(data) if isinstance(data, Path) else {"base64": base64.b64encode(data).decode()}
    marker = "<image>" if key == "images" else "<audio>"
    return json.dumps({"id": "fuzz", "text": f"{marker} caption", key: [entry]}).encode()


def line_outcome(h: Harness, line: bytes) -> str:
    return record_outcome(h, _Records([line], h.root))


def arrayrecord_outcome(h: Harness, arg: tuple[bytes, int]) -> str:
    """A manifest line through the converter (media embedded), the record's bytes mutated when
    the mutation seed is not 0, then through the index and the loader."""
    line, mutation = arg
    data = encode_record(parse_line(line), h.root, 1)
    if mutation:
        data = mutate(data, random.Random(mutation))
    return record_outcome(h, _Records([data], h.root, arrayrecord=True))


def header_only(h: Harness, data: bytes, kind: str) -> str:
    """Only the header read (what the index does without --decode)."""
    try:
        if kind == "image":
            read_size(data, "fuzz", ImageCaps(max_pixels=h.pre.p.max_image_pixels))
        else:
            read_info(data, "fuzz", h.pre.p.max_audio_seconds)
    except RecordError as e:
        return f"index:{e.reason}"
    return "ok"


# ----------------------------------------------------------------------------- resource caps


class OverCap(Exception):
    """Work past a header cap was started: the header check let a bomb through."""


@contextmanager
def cap_meter(max_pixels: int, max_seconds: float):
    """Holds the work done on an input to the header caps, measured on sizes, not on a clock.

    Within, the places whose work grows with an image's pixels or a clip's length check that size
    before working: the layout (`Preprocessor.grid` and `.clip_chunks`, behind the index's counts
    and the loader's sequence), PIL's decoders (any `load` of an image file class) and soundfile's
    reads. An image over `max_pixels` pixels or a clip over `max_seconds` seconds there is refused
    with OverCap and recorded (callers may catch the exception): the header checks must refuse such
    input before, so a record is a bug. Yields {"pixels": the largest image decoded, "seconds":
    the longest clip read, "over": None or what went over}.
    """
    import soundfile as sf

    used: dict = {"pixels": 0, "seconds": 0.0, "over": None}
    read_so_far: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # frames, by open file
    real = {"grid": Preprocessor.grid, "clip_chunks": Preprocessor.clip_chunks}
    real["read"] = sf.SoundFile.read

    def over(what: str):
        used["over"] = used["over"] or what
        raise OverCap(what)

    def check_image(w: int, h: int, where: str) -> None:
        if w * h > max_pixels:
            over(f"image: {where} of {w}x{h} = {w * h} pixels > max_image_pixels={max_pixels}")

    def check_clip(frames: int, rate: int, where: str) -> None:
        if rate > 0 and frames > max_seconds * rate:
            over(f"audio: {where} of {frames / rate:.1f} s > max_audio_seconds={max_seconds}")

    def grid(pre, h, w, *args, **kwargs):
        check_image(w, h, "layout")
        return real["grid"](pre, h, w, *args, **kwargs)

    def clip_chunks(pre, samples, rate):
        check_clip(samples, rate, "layout")
        return real["clip_chunks"](pre, samples, rate)

    def capped_load(load):
        def wrapper(img, *args, **kwargs):
            w, h = img.size
            used["pixels"] = max(used["pixels"], w * h)
            check_image(w, h, "decode")
            return load(img, *args, **kwargs)

        return wrapper

    def read(f, *args, **kwargs):
        check_clip(f.frames, f.samplerate, "decode")
        x = real["read"](f, *args, **kwargs)
        read_so_far[f] = done = read_so_far.get(f, 0) + len(x)
        used["seconds"] = max(used["seconds"], done / f.samplerate)
        check_clip(done, f.samplerate, "read")  # more samples than the header said
        return x

    patches = [
        (Preprocessor, "grid", grid),
        (Preprocessor, "clip_chunks", clip_chunks),
        (sf.SoundFile, "read", read),
    ]
    patches += [(c, "load", capped_load(c.__dict__["load"])) for c in _image_classes()]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, fn in patches:
        setattr(owner, name, fn)
    try:
        yield used
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


@functools.cache
def _image_classes() -> tuple[type, ...]:
    """PIL's image file classes that define their own `load` (decoding starts in one of them)."""
    from PIL import Image, ImageFile

    Image.init()
    out, todo = [], [ImageFile.ImageFile]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if "load" in cls.__dict__:
            out.append(cls)
    return tuple(out)


# ----------------------------------------------------------------------------- running


class Hang(Exception):
    """An input took longer than the time limit."""


@contextmanager
def time_limit(seconds: float):
    """Raises Hang in the main thread after `seconds` (SIGALRM; a no-op elsewhere)."""
    if seconds <= 0 or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        raise Hang(f"over {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def classify(fn, h: Harness, arg, hang_s: float = 10.0) -> tuple[str, str]:
    """(outcome, traceback or detail) of fn(h, arg): a policy outcome, or a bug's name.

    Bugs: `overcap:image|audio` (work past the harness's header caps, see cap_meter),
    `hang` (no outcome after `hang_s` seconds; 0 = no limit), `invariant:...`, `unhandled:...`.
    """
    p = h.pre.p
    try:
        with cap_meter(p.max_image_pixels, p.max_audio_seconds) as used, time_limit(hang_s):
            out = fn(h, arg)
    except Hang:
        return "hang", traceback.format_exc()
    except Invariant as e:
        out, detail = "invariant:changed_since_index", str(e)
    except OracleMismatch as e:
        out, detail = f"oracle:{e.args[0]}", str(e)
    except Exception as e:
        out, detail = f"unhandled:{type(e).__name__}", traceback.format_exc()
    else:
        detail = ""
    if used["over"]:  # first: the decoder's caller may have turned OverCap into a reject
        return f"overcap:{used['over'].partition(':')[0]}", used["over"]
    kind, _, reason = out.partition(":")
    if kind in ("index", "load") and reason not in REASONS:
        return f"unhandled:unknown_reason:{reason}", ""
    if out not in ("ok", "refused") and kind not in ("index", "load") and not is_bug(out):
        return f"unhandled:unknown_outcome:{out}", ""
    if reason == "record_failed":  # an exception the index or the loader caught: still a bug
        return "unhandled:record_failed", detail
    return out, detail


def is_bug(outcome: str) -> bool:
    return outcome.startswith(("unhandled:", "hang", "invariant:", "overcap:", "oracle:"))


def gen_input(target: str, h: Harness, rng: random.Random) -> tuple:
    """(function, argument) of one random input for `target`."""
    pool = list(h.seeds.values())
    if target in ("image", "audio"):
        names = IMAGE_SEEDS if target == "image" else AUDIO_SEEDS
        fn = image_outcome if target == "image" else audio_outcome
        roll = rng.random()
        if roll < 0.05:
            return fn, bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 256)))
        if roll < 0.08 and target == "image":
            return fn, _bomb(rng)
        data = mutate(h.seeds[rng.choice(names)], rng, pool)
        if roll < 0.2:
            return (lambda hh, d, k=target: header_only(hh, d, k)), data
        return fn, data
    if target == "jsonl":
        return line_outcome, gen_line(rng, h.seeds)
    if target == "safetensors":
        return safetensors_outcome, gen_safetensors(rng)
    line = json.dumps(gen_record(rng, h.seeds)).encode()
    return arrayrecord_outcome, (line, rng.choice((0, rng.getrandbits(32))))


_BOMBS: dict[tuple, bytes] = {}


def _bomb(rng: random.Random) -> bytes:
    side = rng.choice(((3000, 3000), (9000, 9000), (1, 200_000_000), (100_000, 100_000)))
    if side not in _BOMBS:
        w, h = side
        _BOMBS[side] = (
            png_bomb(w, h)
            if w * h <= 1e8
            else _png(struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0), zlib.compress(b"\0" * 64))
        )
    return _BOMBS[side]


def fuzz(
    targets: list[str],
    seconds: float,
    seed: int = 0,
    hang_s: float = 10.0,
    findings: Path | None = None,
    root: Path | None = None,
) -> dict:
    """Runs each target for seconds / len(targets); returns {target: {"inputs", "outcomes",
    "bugs", "slowest_s"}}."""
    with tempfile.TemporaryDirectory() as tmp:
        h = make_harness(root or tmp)
        report = {}
        for t in targets:
            rng = random.Random(f"{seed}-{t}")
            counts: Counter[str] = Counter()
            slowest, end = 0.0, time.monotonic() + seconds / len(targets)
            while time.monotonic() < end:
                fn, arg = gen_input(t, h, rng)
                start = time.monotonic()
                outcome, tb = classify(fn, h, arg, hang_s=hang_s)
                slowest = max(slowest, time.monotonic() - start)
                if is_bug(outcome) and counts[outcome] == 0 and findings is not None:
                    _save(findings, t, outcome, arg, tb)
                counts[outcome] += 1
            report[t] = {
                "inputs": sum(counts.values()),
                "outcomes": dict(counts.most_common()),
                "bugs": sum(v for k, v in counts.items() if is_bug(k)),
                "slowest_s": round(slowest, 3),
            }
    return report


def _save(findings: Path, target: str, outcome: str, arg: bytes, tb: str) -> None:
    findings.mkdir(parents=True, exist_ok=True)
    stem = findings / f"{target}-{outcome.replace(':', '-')}"
    stem.with_suffix(".bin").write_bytes(arg if isinstance(arg, bytes) else repr(arg).encode())
    stem.with_suffix(".txt").write_text(tb)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python tools/fuzz.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seconds", type=float, default=60.0, help="total run time, split by target")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma list of {TARGETS}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hang-s", type=float, default=10.0, help="an input slower than this hangs")
    p.add_argument("--findings", type=Path, help="folder for the inputs of bugs found")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        p.error(f"unknown targets {sorted(unknown)}; choose from {TARGETS}")
    warnings.simplefilter("ignore")  # decoders warn about the broken files they are fed
    report = fuzz(targets, args.seconds, args.seed, args.hang_s, args.findings)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for t, r in report.items():
            print(f"{t}: {r['inputs']} inputs, {r['bugs']} bugs, slowest {r['slowest_s']} s")
            for outcome, n in r["outcomes"].items():
                print(f"  {n:8d}  {outcome}")
    bugs = sum(r["bugs"] for r in report.values())
    print(f"total: {sum(r['inputs'] for r in report.values())} inputs, {bugs} unhandled/hangs")
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
