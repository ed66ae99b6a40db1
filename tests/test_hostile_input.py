"""Hostile input, the classes of issue 40 on the data and import side: each built in tmp_path,
in several instances, and its outcome asserted (a counted reject naming the record, or an
error naming the file and the limit to change), within a time backstop.

Classes: record ids and member names that would act on the terminal; progressive JPEGs whose
scans make decoding cost minutes; WebDataset member names of any length; thousands of data
files open at once; HF checkpoint directories whose config claims what their tensors do not
hold; a JSON list, a Parquet row group or a tar header claiming more than the caps allow.
"""

from __future__ import annotations

import io
import tarfile
import time

import numpy as np
import pytest
from PIL import Image
from test_hostile import config, index, png, write_manifest

from jaxmllm.config import printable
from jaxmllm.data.index import report
from jaxmllm.data.media.image import jpeg_scans
from jaxmllm.data.preprocess import Images, Params, Preprocessor
from jaxmllm.data.rejects import RecordError

# ----------------------------------------------------------------------------- the terminal

HOSTILE_NAMES = [
    "fake\n  rejected, by reason: none",  # a forged summary line
    "\x1b[8mconcealed\x1b[0m",  # SGR conceal
    "\x1b]0;pwned title\x07",  # the window's title (OSC)
    "\x1b[2J\x1b[H",  # clear the screen
    "\x9b2J",  # C1 CSI on its own
    "abc\u202egnp.exe",  # a bidirectional override
    "tab\there\rcarriage",
]


def controls(text: str) -> list[str]:
    """The characters of `text` that act on a terminal (newlines aside)."""
    return [c for c in text if c != "\n" and printable(c) != c]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_printable_escapes_what_acts_on_a_terminal(name):
    out = printable(name)
    assert "\n" not in out and not controls(out)
    assert printable("café 東京 😀 plain-id_1.jpg") == "café 東京 😀 plain-id_1.jpg"


def test_record_ids_and_names_reach_the_terminal_escaped(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    png(data / "ok.png")
    records = [
        {"id": name, "text": "<image> hi", "images": [f"{name}.png"]} for name in HOSTILE_NAMES
    ]
    records.append({"id": "good", "text": "<image> fine", "images": ["ok.png"]})
    summary, rejects = index(write_manifest(data / "m.jsonl", records))
    assert summary["rejected"] == len(HOSTILE_NAMES)
    lines = report(summary)
    for line in lines:
        assert not controls(line), line
    assert not any("\n" in line for line in lines)
    assert not any(line.lstrip().startswith("rejected, by reason: none") for line in lines)
    for r in rejects.values():  # each named, escaped, in the log and in its message
        assert r["reason"] == "missing_media" and not controls(r["id"] + r["detail"])
        assert "\n" not in r["id"] + r["detail"]
    err = RecordError("missing_media", "\x1b[2Jx.png", "\x1b]0;t\x07")
    assert not controls(str(err)) and "\\x1b" in str(err)


def test_webdataset_member_names_reach_the_terminal_escaped(tmp_path):
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w") as tar:
        for i, name in enumerate(HOSTILE_NAMES):
            body = b"not json {"
            info = tarfile.TarInfo(f"{name.replace('/', '_')}{i}.json")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
            odd = tarfile.TarInfo(f"k{i}.\x1b[2J{i}")  # an extension nobody reads, reported
            odd.size = 1
            tar.addfile(odd, io.BytesIO(b"x"))
    summary, rejects = index(shard, "data.source=files", "data.format=webdataset")
    assert summary["rejected"] == len(HOSTILE_NAMES)
    for line in report(summary):
        assert not controls(line), line
    assert all(not controls(r["id"] + r["detail"] + r["where"]) for r in rejects.values())


# ----------------------------------------------------------------------------- decoding time


def progressive_jpeg(w: int, h: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, w * h * 3).reshape(h, w, 3) + rng.normal(0, 8, (h, w, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).save(
        buf, "JPEG", progressive=True, quality=90
    )
    return buf.getvalue()


def repeated_scans(jpeg: bytes, copies: int) -> bytes:
    """`jpeg` with its last scan repeated `copies` times: a valid stream (libjpeg warns, then
    decodes every scan over the whole image), as the probe's 528 KB file was."""
    last = jpeg.rfind(b"\xff\xda")
    return jpeg[:-2] + jpeg[last:-2] * copies + b"\xff\xd9"


@pytest.mark.parametrize(("w", "h", "copies"), [(640, 480, 3000), (96, 1200, 400), (256, 256, 120)])
def test_a_jpeg_of_repeated_scans_is_refused_before_decoding(tmp_path, w, h, copies):
    good = progressive_jpeg(w, h)
    (tmp_path / "ok.jpg").write_bytes(good)
    (tmp_path / "bomb.jpg").write_bytes(repeated_scans(good, copies))
    comment = b"\xff\xfe\x00\x10" + b"\xff\xda" * 6 + b"\x00\x00"  # SOS bytes in a COM segment
    (tmp_path / "com.jpg").write_bytes(good[:2] + comment * 200 + good[2:])
    records = [
        {"id": name, "text": "<image> x", "images": [f"{name}.jpg"]}
        for name in ("ok", "bomb", "com")
    ]
    start = time.monotonic()
    summary, rejects = index(write_manifest(tmp_path / "m.jsonl", records))
    assert time.monotonic() - start < 20  # (decoding the bomb alone would take far longer)
    assert summary["accepted"] == 2 and set(rejects) == {"bomb"}
    assert rejects["bomb"]["reason"] == "image_too_costly"
    assert "data.max_image_scans=100" in rejects["bomb"]["detail"]
    cfg = config(tmp_path / "m.jsonl", "data.max_image_scans=5")  # (Pillow writes 10)
    pre = Preprocessor(Params.from_config(cfg))
    with pytest.raises(RecordError, match="image_too_costly"):
        Images().read_size(pre, str(tmp_path / "ok.jpg"), "ok")
    assert jpeg_scans(good, 1000) == 10 and jpeg_scans(repeated_scans(good, 7), 1000) == 17
