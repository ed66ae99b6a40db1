"""Fuzzing of the manifest and media decoders and of the safetensors reader (bounded): every input
ends in a policy outcome; a checkpoint file is refused or read exactly as the safetensors library
refuses or reads it.

A policy outcome is a Sample, a reject whose reason is one of REASONS, or (under data.on_error=fail)
the DataError naming the record and the option; never another exception, a hang or a decoded
decompression bomb. Longer runs: `python tools/fuzz.py --seconds 300`, or raise
JAXMLLM_FUZZ_EXAMPLES here.

Nothing here depends on the machine's speed. Work is bounded by sizes: `fuzz.cap_meter` checks
every image and clip that reaches the layout or a decoder against the header caps (so no input can
make the index or the loader do more than the caps allow); the bomb runs under a memory limit with
every decoder forbidden; special files must never be opened. The one clock is a backstop far above
any input's run time, against a call that would never return.
"""

import builtins
import io
import json
import os
import stat
import struct
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from jaxmllm.config import ConfigError, load_config
from jaxmllm.data.index import build_index
from jaxmllm.data.loader import Loader
from jaxmllm.data.media.audio import decode_mono, read_info
from jaxmllm.data.media.image import ImageCaps, decode_rgb, read_size
from jaxmllm.data.rejects import REASONS, DataError, RecordError, read_rejects
from jaxmllm.data.source import open_source
from tools import fuzz

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # PIL on the broken files fed
    pytest.mark.host,  # (conftest.py: the mark, and its check)
]

FUZZ = settings(
    max_examples=int(os.environ.get("JAXMLLM_FUZZ_EXAMPLES", "300")),
    deadline=None,  # no clock: check() bounds the work by the caps, not by time
    derandomize=True,  # the same inputs on every run; the long run explores
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def h(tmp_path_factory):
    return fuzz.make_harness(tmp_path_factory.mktemp("fuzz"))


ROOT = Path(__file__).resolve().parents[1]
# Not a speed limit: at the harness's caps (4 Mpx, 30 s) the slowest of 13,000 inputs took 0.3 s
# on a 2-core box at load 10. Only a call that never returns (a blocking open, a decoder that
# loops) should ever reach this.
BACKSTOP_S = 60.0


def check(fn, h, arg) -> str:
    """fn(h, arg)'s policy outcome; fails on an unhandled exception, index and loader counts that
    differ, an image or clip past the header caps in the layout or a decoder (fuzz.cap_meter), or
    a call still blocked after BACKSTOP_S."""
    outcome, tb = fuzz.classify(fn, h, arg, hang_s=BACKSTOP_S)
    assert outcome != "hang", (
        f"no outcome after {BACKSTOP_S} s, a backstop far above any input's run time: "
        f"a real infinite block on {arg!r:.300}\n{tb}"
    )
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


@pytest.fixture
def opened(monkeypatch):
    """The paths opened from here on, by Python (PIL, file reads) or by libsndfile. Opening one
    that is not a regular file or a folder fails here instead of blocking (a FIFO) or reading
    forever (/dev/zero), so a regression fails the test cleanly."""
    paths = []

    def record(file):
        if not isinstance(file, (str, bytes, os.PathLike)):  # file objects, descriptors
            return
        paths.append(Path(os.fsdecode(file)))
        try:
            mode = os.stat(file).st_mode
        except (OSError, ValueError):
            return  # missing: the real open raises
        # (a folder: the index build's own staging folder, which shutil.rmtree opens)
        if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
            raise OSError(f"test_fuzz refuses to open {paths[-1]}: not a regular file")

    def recording(real):
        def opener(file, *args, **kwargs):
            record(file)
            return real(file, *args, **kwargs)

        return opener

    def soundfile_init(f, file, *args, **kwargs):
        f._file = None  # what SoundFile.__del__ needs, should record() raise
        record(file)
        real_soundfile_init(f, file, *args, **kwargs)

    real_soundfile_init = sf.SoundFile.__init__
    for module in (builtins, io):
        monkeypatch.setattr(module, "open", recording(module.open))
    monkeypatch.setattr(os, "open", recording(os.open))
    monkeypatch.setattr(sf.SoundFile, "__init__", soundfile_init)
    return paths


def test_seeds_decode_and_special_files_are_refused_unopened(h, opened):
    for name in fuzz.IMAGE_SEEDS:
        assert check(fuzz.image_outcome, h, h.seeds[name]) == "ok", name
    for name in fuzz.AUDIO_SEEDS:
        assert check(fuzz.audio_outcome, h, h.seeds[name]) == "ok", name
    want = {
        "dir": "undecodable_media",
        "fifo": "undecodable_media",
        "missing.png": "missing_media",
        "/dev/zero": "path_outside_root",
        "rgb.png\x00x": "missing_media",
    }
    arrayrecord = lambda hh, path: fuzz.arrayrecord_outcome(  # the converter reads paths too
        hh, (fuzz._record_with(hh, path, "images"), 0)
    )
    for path, reason in want.items():
        for fn in (fuzz.image_outcome, fuzz.audio_outcome, arrayrecord):
            assert check(fn, h, h.root / path) == f"index:{reason}", path
    # A FIFO used to block open() forever, /dev/zero to read forever: the checks refuse them by
    # stat() before any open, so there is nothing to time. The recorder sees PIL's and
    # libsndfile's opens:
    assert check(fuzz.image_outcome, h, h.root / "rgb.png") == "ok"
    assert check(fuzz.audio_outcome, h, h.root / "tone.flac") == "ok"
    assert {h.root / "rgb.png", h.root / "tone.flac"} <= set(opened)
    refused = {h.root / "dir", h.root / "fifo", Path("/dev/zero")}
    assert not refused & set(opened), sorted(map(str, refused & set(opened)))


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
    sf.write(
        buf,
        np.array([0.1, np.nan, np.inf] * 2000, np.float32),
        16000,
        format="WAV",
        subtype="FLOAT",
    )
    assert check(fuzz.audio_outcome, h, buf.getvalue()) == "load:undecodable_media"


# ----------------------------------------------------------------------------- bombs

BOMB_CHILD = """
import resource, sys
from jaxmllm.data.media.image import load_image, read_size
from jaxmllm.data.rejects import RecordError
from tools.fuzz import cap_meter
bomb = open(sys.argv[1], "rb").read()
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), hard))  # 256 MB more, no more
with cap_meter(max_pixels=0, max_seconds=0) as used:  # any decode at all is recorded
    for fn in (lambda: read_size(bomb), lambda: load_image(bomb, 4, 2, 256, 1024)):
        try:
            fn()
            print("accepted")
        except RecordError as e:
            print(e.reason)
print(used["pixels"], used["over"])
"""


def test_png_bomb_is_refused_before_decoding(tmp_path):
    """Refused from the header: no decoder is entered (the meter records any image load), and the
    child could not hold the decoded image anyway (256 MB of address space left, 400 MB needed
    for the 1-bit pixels alone)."""
    bomb = fuzz.png_bomb(20000, 20000)  # 400 Mpx (1.2 GB as RGB) in a few hundred KB
    assert len(bomb) < 1 << 20
    path = tmp_path / "bomb.png"
    path.write_bytes(bomb)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = [sys.executable, "-c", BOMB_CHILD, str(path)]
    out = subprocess.run(child, capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.stdout.split() == ["image_too_large", "image_too_large", "0", "None"], (
        out.stdout + out.stderr
    )


RAISED = ImageCaps(max_pixels=1 << 40)  # an image's own cap out of the way


def test_the_cap_meter_catches_a_cap_bypassed(h):
    """check()'s bound on work is not vacuous: layouts and decodes past the caps, asked for
    directly with the header checks' own caps raised, are recorded as over."""
    for layout in (lambda: h.pre.grid(3000, 3000), lambda: h.pre.clip_chunks(16000 * 31, 16000)):
        with fuzz.cap_meter(max_pixels=1 << 22, max_seconds=30.0) as used:
            with pytest.raises(fuzz.OverCap):
                layout()
        assert used["over"].split(":")[0] in ("image", "audio") and "layout" in used["over"]
    with fuzz.cap_meter(max_pixels=1 << 22, max_seconds=30.0) as used:
        with pytest.raises(RecordError, match="undecodable_media.*OverCap"):
            decode_rgb(fuzz.png_bomb(3000, 3000), caps=RAISED)  # 9 Mpx > 4 Mpx
    assert used["over"].startswith("image:") and used["pixels"] == 9_000_000
    clip = io.BytesIO()
    sf.write(clip, np.zeros(8000 * 31, np.float32), 8000, format="WAV")
    with fuzz.cap_meter(max_pixels=1 << 22, max_seconds=30.0) as used:
        with pytest.raises(RecordError, match="undecodable_media.*OverCap"):
            decode_mono(clip.getvalue(), max_seconds=60.0)  # 31 s > 30 s
    assert used["over"].startswith("audio:") and used["seconds"] <= 30.0
    with fuzz.cap_meter(max_pixels=1 << 22, max_seconds=30.0) as used:
        assert decode_rgb(fuzz.png_bomb(2000, 2000)).shape == (2000, 2000, 3)  # 4 Mpx: allowed
    assert used["over"] is None and used["pixels"] == 4_000_000


def test_caps_apply_in_the_index_and_the_loader(h, tmp_path):
    bomb = fuzz.png_bomb(3000, 3000)  # 9 Mpx > the harness's 4 Mpx cap
    assert check(fuzz.image_outcome, h, bomb) == "index:image_too_large"
    assert check(lambda hh, d: fuzz.header_only(hh, d, "image"), h, bomb) == "index:image_too_large"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PIL's own limit: neither a warning nor a traceback
        header = struct.pack(">IIBBBBB", 20000, 20000, 1, 0, 0, 0, 0)  # 400 Mpx, no data
        lying = fuzz._png(header, zlib.compress(b"\0" * 64))
        with pytest.raises(RecordError, match="image_too_large.*MAX_IMAGE_PIXELS"):
            read_size(lying, caps=RAISED)  # over PIL's limit (2 x Image.MAX_IMAGE_PIXELS)
        with pytest.raises(RecordError, match="image_too_large.*data.max_image_pixels"):
            decode_rgb(fuzz.png_bomb(9000, 8000))  # 72 Mpx: under PIL's limits, over our 64
        assert read_size(fuzz.png_bomb(10000, 10000), caps=RAISED) == (10000, 10000)
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
    over = [
        f"data.path={path}",
        f"data.index_dir={tmp_path / 'ix'}",
        "data.source=jsonl",
        "data.image_min_pixels=256",
        "data.image_max_pixels=1024",
        "data.audio_max_frames=32",
        f"train.output_dir={tmp_path / 'run'}",
        "data.max_image_pixels=4194304",
        "data.eval.source=none",
        "data.min_accept=0",
    ]
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


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.torch  # (the oracle reads the files with safetensors' torch framework)
@FUZZ
@given(st.randoms(use_true_random=False))
def test_safetensors_files_are_read_as_the_library_reads_them(h, rng):
    check(fuzz.safetensors_outcome, h, fuzz.gen_safetensors(rng))


@pytest.mark.torch  # (the oracle reads the files with safetensors' torch framework)
@FUZZ
@given(st.binary(max_size=300))
def test_arbitrary_bytes_as_a_safetensors_file(h, data):
    assert check(fuzz.safetensors_outcome, h, data) in ("refused", "ok")
