"""Fuzzing of the manifest and media decoders (bounded): every input ends in a policy outcome.

A policy outcome is a Sample, a reject whose reason is one of REASONS, or (under data.on_error=fail)
the DataError naming the record and the option; never another exception, a hang or a decoded
decompression bomb. Longer runs: `python tools/fuzz.py --seconds 300`, or raise
JAXMLLM_FUZZ_EXAMPLES here.
"""

import io
import json
import os
import struct
import subprocess
import sys
import time
import warnings
import zlib
from datetime import timedelta

import numpy as np
import pytest
import soundfile as sf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from jaxmllm.config import ConfigError, load_config
from jaxmllm.data.audio import read_info
from jaxmllm.data.image import decode_rgb, read_size
from jaxmllm.data.index import build_index
from jaxmllm.data.loader import Loader
from jaxmllm.data.rejects import REASONS, DataError, RecordError, read_rejects
from jaxmllm.data.source import open_source
from tools import fuzz

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # PIL on the broken files fed

FUZZ = settings(
    max_examples=int(os.environ.get("JAXMLLM_FUZZ_EXAMPLES", "300")),
    deadline=timedelta(seconds=10),  # a backstop: classify() flags an input over 4 s as a hang
    derandomize=True,  # the same inputs on every run; the long run explores
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def h(tmp_path_factory):
    return fuzz.make_harness(tmp_path_factory.mktemp("fuzz"))


def check(fn, h, arg) -> str:
    outcome, tb = fuzz.classify(fn, h, arg, hang_s=4.0)
    assert not fuzz.is_bug(outcome), f"{outcome} on {arg!r:.300}\n{tb}"
    return outcome


# ----------------------------------------------------------------------------- media bytes


@FUZZ
@given(st.binary(max_size=600))
def test_arbitrary_bytes_as_image_or_audio(h, data):
    for fn in (fuzz.image_outcome, fuzz.audio_outcome):
        check(fn, h, data)
    check(lambda hh, d: fuzz.header_only(hh, d, "image"), h, data)
    check(lambda hh, d: fuzz.header_only(hh, d, "audio"), h, data)


@FUZZ
@given(st.sampled_from(fuzz.IMAGE_SEEDS), st.randoms(use_true_random=False))
def test_mutated_images(h, name, rng):
    check(fuzz.image_outcome, h, fuzz.mutate(h.seeds[name], rng, list(h.seeds.values())))


@FUZZ
@given(st.sampled_from(fuzz.AUDIO_SEEDS), st.randoms(use_true_random=False))
def test_mutated_audio(h, name, rng):
    check(fuzz.audio_outcome, h, fuzz.mutate(h.seeds[name], rng, list(h.seeds.values())))


def test_seeds_decode_and_special_files_are_refused_quickly(h):
    for name in fuzz.IMAGE_SEEDS:
        assert check(fuzz.image_outcome, h, h.seeds[name]) == "ok", name
    for name in fuzz.AUDIO_SEEDS:
        assert check(fuzz.audio_outcome, h, h.seeds[name]) == "ok", name
    want = {"dir": "undecodable_media", "fifo": "undecodable_media", "missing.png": "missing_media",
            "/dev/zero": "undecodable_media", "rgb.png\x00x": "missing_media"}  # fmt: skip
    for path, reason in want.items():
        for fn in (fuzz.image_outcome, fuzz.audio_outcome):
            start = time.monotonic()
            assert check(fn, h, h.root / path) == f"index:{reason}", path
            assert time.monotonic() - start < 1.0  # a FIFO used to block open() forever


def test_exif_orientations_match_pil(h):
    rgb = np.random.default_rng(0).integers(0, 255, (6, 10, 3)).astype(np.uint8)
    for k in range(1, 9):
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, "PNG", exif=fuzz._exif(k))
        want = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(buf.getvalue()))))
        assert np.array_equal(decode_rgb(buf.getvalue()), want), k
        assert read_size(buf.getvalue()) == want.shape[:2], k


def test_non_finite_audio_is_rejected(h):
    buf = io.BytesIO()
    sf.write(buf, np.array([0.1, np.nan, np.inf] * 2000, np.float32), 16000, format="WAV",
             subtype="FLOAT")  # fmt: skip
    assert check(fuzz.audio_outcome, h, buf.getvalue()) == "load:undecodable_media"


# ----------------------------------------------------------------------------- bombs

BOMB_CHILD = """
import resource, sys, time
from jaxmllm.data.image import load_image, read_size
from jaxmllm.data.rejects import RecordError
bomb = open(sys.argv[1], "rb").read()
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), hard))  # 256 MB more, no more
start = time.monotonic()
for fn in (lambda: read_size(bomb), lambda: load_image(bomb, 4, 2, 256, 1024)):
    try:
        fn()
        print("decoded")
    except RecordError as e:
        print(e.reason)
print(time.monotonic() - start)
"""


def test_png_bomb_is_refused_before_decoding(tmp_path):
    bomb = fuzz.png_bomb(20000, 20000)  # 400 Mpx (1.2 GB as RGB) in a few hundred KB
    assert len(bomb) < 1 << 20
    path = tmp_path / "bomb.png"
    path.write_bytes(bomb)
    out = subprocess.run([sys.executable, "-c", BOMB_CHILD, str(path)], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip
    lines = out.stdout.split()
    assert lines[:2] == ["image_too_large", "image_too_large"], out.stdout + out.stderr
    assert float(lines[2]) < 1.0


def test_caps_apply_in_the_index_and_the_loader(h, tmp_path):
    bomb = fuzz.png_bomb(3000, 3000)  # 9 Mpx > the harness's 4 Mpx cap
    assert check(fuzz.image_outcome, h, bomb) == "index:image_too_large"
    assert check(lambda hh, d: fuzz.header_only(hh, d, "image"), h, bomb) == "index:image_too_large"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PIL's own limit: neither a warning nor a traceback
        header = struct.pack(">IIBBBBB", 20000, 20000, 1, 0, 0, 0, 0)  # 400 Mpx, no data
        lying = fuzz._png(header, zlib.compress(b"\0" * 64))
        with pytest.raises(RecordError, match="image_too_large.*MAX_IMAGE_PIXELS"):
            read_size(lying, max_pixels=1 << 40)  # over PIL's limit (2 x Image.MAX_IMAGE_PIXELS)
        with pytest.raises(RecordError, match="image_too_large.*data.max_image_pixels"):
            decode_rgb(fuzz.png_bomb(9000, 8000))  # 72 Mpx: under PIL's limits, over our 64
        assert read_size(fuzz.png_bomb(10000, 10000), max_pixels=1 << 40) == (10000, 10000)
    flac = bytearray(h.seeds["tone.flac"])  # STREAMINFO: 2**36 - 1 samples
    flac[21] |= 0x0F
    flac[22:26] = b"\xff\xff\xff\xff"
    assert check(fuzz.audio_outcome, h, bytes(flac)) == "index:audio_too_long"
    long = io.BytesIO()
    sf.write(long, np.zeros(8000 * 31, np.float32), 8000, format="FLAC")
    assert check(fuzz.audio_outcome, h, long.getvalue()) == "index:audio_too_long"
    with pytest.raises(RecordError, match="audio_too_long"):
        read_info(long.getvalue(), max_seconds=30.0)
    assert read_info(long.getvalue(), max_seconds=31.0) == (8000 * 31, 8000)
    for bad in ("data.max_image_pixels=0", "data.max_audio_seconds=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].split(".")[1]):
            load_config("configs/tiny.yaml", [bad])


# ----------------------------------------------------------------------------- manifests


@FUZZ
@given(st.randoms(use_true_random=False))
def test_generated_manifest_lines(h, rng):
    check(fuzz.line_outcome, h, fuzz.gen_line(rng, h.seeds))


@FUZZ
@given(st.binary(max_size=300))
def test_arbitrary_bytes_as_a_manifest_line(h, line):
    check(fuzz.line_outcome, h, line)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(st.characters(codec=None)),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@FUZZ
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "id": JSON,
            "text": JSON
            | st.lists(st.sampled_from(["<image>", "<audio>", "a", " ", "\ud800"])).map("".join),
            "messages": JSON,
            "images": st.lists(JSON | st.sampled_from(fuzz.IMAGE_SEEDS + fuzz.SPECIAL_PATHS)),
            "audio": st.lists(JSON | st.sampled_from(fuzz.AUDIO_SEEDS + fuzz.SPECIAL_PATHS)),
        },
    )
)
def test_records_of_any_json_types(h, record):
    check(fuzz.line_outcome, h, json.dumps(record).encode())


@pytest.mark.parametrize("line", fuzz.ODD_LINES + (b"[" * 100_000, b'{"a":' * 5000 + b"1"))
def test_odd_lines(h, line):
    assert check(fuzz.line_outcome, h, line) == "index:malformed_line"


@FUZZ
@given(st.randoms(use_true_random=False), st.booleans())
def test_arrayrecord_records(h, rng, mutated):
    line = json.dumps(fuzz.gen_record(rng, h.seeds)).encode()
    check(fuzz.arrayrecord_outcome, h, (line, rng.getrandbits(32) if mutated else 0))


def test_fuzzed_manifest_under_skip_and_fail(h, tmp_path):
    """The real index and loader on a manifest of fuzzed lines: under skip every record is a
    Sample or a reject with a reason; under fail the run stops with a DataError naming both."""
    import random

    rng = random.Random(0)
    path = h.root / "fuzzed.jsonl"
    path.write_bytes(b"\n".join(fuzz.gen_line(rng, h.seeds) for _ in range(60)) + b"\n")
    over = [f"data.path={path}", f"data.index_dir={tmp_path / 'ix'}", "data.source=jsonl",
            "data.image_min_pixels=256", "data.image_max_pixels=1024", "data.audio_max_frames=32",
            f"train.output_dir={tmp_path / 'run'}", "data.max_image_pixels=4194304"]  # fmt: skip
    cfg = load_config("configs/tiny.yaml", over)
    summary = build_index(cfg, path, tmp_path / "ix", progress=False)
    rejects = read_rejects(tmp_path / "ix" / "rejects.jsonl")
    assert summary["accepted"] > 0 and len(rejects) > 0
    assert {r["reason"] for r in rejects} <= set(REASONS)
    loader = Loader(cfg, open_source(cfg))
    got = loader.load(np.arange(summary["accepted"]), step=0)
    skipped = sum(s is None for s in got.values())  # header fine, data not: rejected at load
    assert skipped == sum(v for k, v in loader.log.counts.items() if k.startswith("load_"))
    assert all(k[5:] in REASONS for k in loader.log.counts if k.startswith("load_"))
    fail = load_config("configs/tiny.yaml", [*over, "data.on_error=fail"])
    with pytest.raises(DataError, match=r"record '.*'.*data\.on_error"):
        open_source(fail)
    if skipped:
        with pytest.raises(DataError, match=r"record '.*'.*data\.on_error"):
            Loader(fail, open_source(cfg)).load(np.arange(summary["accepted"]), step=0)
