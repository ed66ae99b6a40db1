"""Memory bounded by what the config says (issue 50): data.worker_memory, the memory one record
may cost a process reading it, held by image decoding (decoded smaller where a library call
does it), JSON lines, Parquet row groups and audio clips, each over it a counted reject naming
the key; and the JPEG classes of the first probe: a frame header claiming more than its data
holds, MJPEG video frames bypassing the scan bound."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from fractions import Fraction

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from test_hostile import index, png, wav, write_manifest
from test_hostile_input import progressive_jpeg, repeated_scans

from jaxmllm.data import budget
from jaxmllm.data.media.image import (
    ImageCaps,
    image_memory,
    jpeg_data,
    read_size,
    target_of,
)

MIB = 1 << 20


def rgba_bomb(path, side: int = 8192):
    """The probe's file: a 64 Mpx RGBA PNG of a few hundred KB (flat, half transparent)."""
    Image.new("RGBA", (side, side), (200, 30, 30, 128)).save(path)
    return path


PEAK = """
import resource, sys
from jaxmllm.data.media.image import ImageCaps, load_image
from jaxmllm.data.rejects import RecordError
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    caps = ImageCaps(max_memory=int(sys.argv[2]))
    patches, _ = load_image(sys.argv[1], 14, 2, 3136, 1003520, "bomb", caps)
    got = len(patches)
except RecordError as e:
    got = e.reason
print(got, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def decode_peak(path, memory: int) -> tuple[str, int]:
    """(patches or the reject's reason, the process's peak memory growth in bytes) of
    loading `path` under a budget of `memory` bytes, in a process of its own."""
    out = subprocess.run(
        [sys.executable, "-c", PEAK, str(path), str(memory)],
        capture_output=True,
        text=True,
        check=True,
    )
    got, peak = out.stdout.split()
    return got, int(peak)


def test_a_64_mpx_rgba_png_decodes_within_its_budget(tmp_path):
    """The probe's 249 KB PNG took 1.6 GB to decode (25 bytes a pixel of copies). Under a
    budget it cannot decode whole in, it is reduced before its copies are made; under one
    it cannot decode in at all, it is a reject naming the key, never an OOM."""
    path = rgba_bomb(tmp_path / "bomb.png")
    assert path.stat().st_size < 1 * MIB
    target = target_of(8192, 8192, (14, 2, 3136, 1003520))
    estimate = image_memory(8192, 8192, "RGBA", "PNG", target, True)
    got, peak = decode_peak(path, 1 << 30)
    assert got.isdigit() and int(got) == (target[0] // 14) * (target[1] // 14)
    assert peak <= estimate < 1 << 30, (peak, estimate)  # (the estimate bounds what it took)
    got, _ = decode_peak(path, 512 * MIB)
    assert got == "over_memory_budget"
    whole = image_memory(8192, 8192, "RGBA", "PNG", target, False)
    assert whole > 1.5 * (1 << 30)  # (decoded whole: ~28 bytes a pixel)


def test_within_the_budget_an_image_decodes_whole_to_the_same_pixels(tmp_path):
    from jaxmllm.data.media.image import load_image

    rgb = np.random.default_rng(0).integers(0, 256, (400, 700, 3), np.uint8)
    Image.fromarray(rgb).save(tmp_path / "a.png")
    plain = load_image(tmp_path / "a.png", 14, 2, 3136, 50176)
    roomy = load_image(tmp_path / "a.png", 14, 2, 3136, 50176, caps=ImageCaps(max_memory=1 << 30))
    target = target_of(400, 700, (14, 2, 3136, 50176))
    between = sum(image_memory(700, 400, "RGB", "PNG", target, s) for s in (True, False)) // 2
    tight = load_image(tmp_path / "a.png", 14, 2, 3136, 50176, caps=ImageCaps(max_memory=between))
    assert np.array_equal(plain[0], roomy[0])  # (decoded whole, as ever)
    assert tight[0].shape == plain[0].shape and not np.array_equal(plain[0], tight[0])
    assert np.abs(tight[0].astype(int) - plain[0].astype(int)).mean() < 40  # (reduced first)


def test_records_over_the_budget_are_counted_rejects_naming_the_key(tmp_path):
    """A JSON line costs up to about 10 times its size parsed, a Parquet row group about 5
    times its decompressed size, a clip 64 bytes a sample resampled to 16 kHz (measured
    below): each over data.worker_memory is a reject naming the key, not read."""
    png(tmp_path / "ok.png")
    wav(tmp_path / "long.wav", seconds=4.0)
    records = [
        {"id": "short", "text": "<image> a box", "images": ["ok.png"]},
        {"id": "long_line", "text": "x" * (2 * MIB)},
        {"id": "long_clip", "text": "<audio> a tone", "audio": ["long.wav"]},
    ]
    limit = f"data.worker_memory={MIB}"
    summary, rejects = index(write_manifest(tmp_path / "m.jsonl", records), limit)
    assert summary["accepted"] == 1 and set(rejects) == {"m.jsonl:2", "long_clip"}
    for r in rejects.values():
        assert r["reason"] == "over_memory_budget" and f"data.worker_memory={MIB}" in r["detail"]
    table = pa.table({"text": ["small"] * 10 + ["y" * MIB] * 10})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=10)
    summary, rejects = index(
        tmp_path / "t.parquet", "data.source=files", "data.format=parquet", limit
    )
    assert summary["accepted"] == 10 and len(rejects) == 10
    assert {r["reason"] for r in rejects.values()} == {"over_memory_budget"}
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w") as tar:
        for name, body in [("a.json", {"text": "fine"}), ("b.json", {"text": "z" * (2 * MIB)})]:
            data = json.dumps(body).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    summary, rejects = index(shard, "data.source=files", "data.format=webdataset", limit)
    assert summary["accepted"] == 1 and rejects["b"]["reason"] == "over_memory_budget"


READ_PEAK = """
import sys
from pathlib import Path
from jaxmllm.data.records.jsonl import JsonRecords
from jaxmllm.data.records.parquet import ParquetRecords
def resident(field):
    line = next(x for x in open("/proc/self/status") if x.startswith(field))
    return int(line.split()[1]) * 1024
kind = JsonRecords if sys.argv[1] == "json" else ParquetRecords
records = kind(Path(sys.argv[2]), max_bytes=1 << 34)
open("/proc/self/clear_refs", "w").write("5")  # (the peak, VmHWM, from here)
before = resident("VmRSS")
value, _ = records.raw(0)
assert not (isinstance(value, dict) and "__malformed__" in value), str(value)[:300]
print(resident("VmHWM") - before)
"""


def read_peak(kind: str, path) -> int:
    """The peak resident memory growth (bytes) of reading record 0 of the `kind` ("json" or
    "parquet") file at `path` through its reader, in a process of its own (Linux)."""
    out = subprocess.run(
        [sys.executable, "-c", READ_PEAK, kind, str(path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


def test_a_long_json_line_reads_within_its_estimate(tmp_path):
    """budget.JSON_FACTOR bounds what parsing a line took, measured as the image's decoding
    is: an 18 MB line of short chat turns took 9.2 times its bytes and a 22 MB one of token
    ids 7.5 times (the first over the 8 the estimate said before); a long text 3."""
    ids = np.random.default_rng(0).integers(0, 150_000, 3_000_000).tolist()
    turns = [
        {"role": "user", "content": "a short turn"},
        {"role": "assistant", "content": "an answer"},
    ]
    for name, body in [("turns", {"messages": turns * 200_000}), ("ids", {"tokens": ids})]:
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps({"id": name, "text": "t", **body}) + "\n")
        size = path.stat().st_size
        peak = read_peak("json", path)
        assert 5 * size < peak <= budget.JSON_FACTOR * size, (name, size, peak)


def test_a_parquet_row_group_reads_within_its_estimate(tmp_path):
    """budget.PARQUET_FACTOR bounds what reading a row group took, against its decompressed
    size from the metadata: 80 MB of image bytes (incompressible) took 4.5 times it (its
    pages mapped and decompressed, the arrays), over the twice the estimate said before."""
    rng = np.random.default_rng(0)
    images = [rng.bytes(40_000) for _ in range(2000)]  # (each its own: nothing compresses)
    table = pa.table({"id": [str(i) for i in range(2000)], "image": images})
    path = tmp_path / "images.parquet"
    pq.write_table(table, path, row_group_size=len(table))
    size = pq.ParquetFile(path).metadata.row_group(0).total_byte_size
    peak = read_peak("parquet", path)
    assert 3 * size < peak <= budget.PARQUET_FACTOR * size, (size, peak)


def test_the_automatic_budget_shares_the_machine_among_its_readers(monkeypatch):
    monkeypatch.setattr(budget, "machine_memory", lambda: 64 << 30)
    assert budget.resolve(0, 8) == 4 << 30 and budget.resolve(0, 0) == 32 << 30
    assert budget.resolve(3 << 30, 8) == 3 << 30  # (given: as given)
    monkeypatch.setattr(budget, "machine_memory", lambda: 1 << 30)
    assert budget.resolve(0, 64) == budget.MIN_BUDGET


def jpeg_claiming(w: int, h: int) -> bytes:
    """A tiny valid JPEG whose frame header (SOF0) is rewritten to claim w x h: the probe's
    691 bytes claiming 8000 x 8000, which decoded to 646 MB of grey."""
    buf = io.BytesIO()
    Image.new("L", (16, 16), 128).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = h.to_bytes(2, "big") + w.to_bytes(2, "big")
    return bytes(data)


def test_a_jpeg_whose_header_claims_more_than_its_data_holds_is_refused(tmp_path):
    forged = jpeg_claiming(8000, 8000)
    assert len(forged) < 1000
    (tmp_path / "forged.jpg").write_bytes(forged)
    flat = io.BytesIO()  # (a real flat image: a bit or two a block, passes)
    Image.new("RGB", (2000, 2000), (90, 90, 90)).save(flat, "JPEG", optimize=True, quality=5)
    (tmp_path / "flat.jpg").write_bytes(flat.getvalue())
    records = [{"id": n, "text": "<image> x", "images": [f"{n}.jpg"]} for n in ("forged", "flat")]
    summary, rejects = index(write_manifest(tmp_path / "m.jsonl", records))
    assert summary["accepted"] == 1 and set(rejects) == {"forged"}
    assert rejects["forged"]["reason"] == "undecodable_media"
    assert "its frame header claims 8000x8000 pixels" in rejects["forged"]["detail"]
    assert jpeg_data(flat.getvalue(), 2000, 2000) is None
    assert read_size(flat.getvalue()) == (2000, 2000)


def mjpeg(path, frames: list[bytes], w: int, h: int):
    """An MJPEG video (Matroska) whose frames are these JPEGs, stored as they are."""
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("mjpeg", rate=4)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuvj420p"
        for i, frame in enumerate(frames):
            packet = av.Packet(frame)
            packet.stream, packet.pts, packet.dts = stream, i, i
            packet.time_base, packet.is_keyframe = Fraction(1, 4), True
            out.mux(packet)
    return path


def test_mjpeg_frames_are_held_to_the_jpeg_bounds(tmp_path):
    """Each frame of an MJPEG video is a JPEG, decoded by FFmpeg past the progressive-scan
    bound images are held to: one frame of repeated scans cost what the image would, every
    time the video was read."""
    good = progressive_jpeg(64, 48)
    mjpeg(tmp_path / "ok.mkv", [good] * 8, 64, 48)
    mjpeg(tmp_path / "scans.mkv", [good] * 3 + [repeated_scans(good, 400)] + [good] * 4, 64, 48)
    records = [{"id": n, "text": "<video> x", "videos": [f"{n}.mkv"]} for n in ("ok", "scans")]
    summary, rejects = index(
        write_manifest(tmp_path / "m.jsonl", records),
        "model.vision.video=true",
        "data.video_min_frames=2",
    )
    assert set(rejects) == {"scans"} and rejects["scans"]["reason"] == "image_too_costly"
    assert "MJPEG frame at 0.75 s" in rejects["scans"]["detail"]
    assert "data.max_image_scans=100" in rejects["scans"]["detail"]


@pytest.mark.parametrize("side", [4096])
def test_the_estimate_of_a_reduced_jpeg_counts_its_dct_scaling(side):
    whole = image_memory(side, side, "RGB", "JPEG", (512, 512), False)
    small = image_memory(side, side, "RGB", "JPEG", (512, 512), True)
    assert small < whole / 20  # (drafted to 1/8 a side: 512 x 512 decoded)


CLIP_PEAK = """
import sys
from jaxmllm.data.media.audio import load_audio
def resident(field):
    line = next(x for x in open("/proc/self/status") if x.startswith(field))
    return int(line.split()[1]) * 1024
load_audio(sys.argv[1], 16000, 80, 2, 3000, max_seconds=1e9)  # (the imports, the tables)
open("/proc/self/clear_refs", "w").write("5")  # (the peak, VmHWM, from here)
before = resident("VmRSS")
load_audio(sys.argv[1], 16000, 80, 2, 3000, max_seconds=1e9)
print(resident("VmHWM") - before)
"""


@pytest.mark.parametrize("rate,channels", [(8000, 1), (48000, 2)])
def test_a_clip_decodes_within_its_estimate(tmp_path, rate, channels):
    """audio.decode_bytes bounds what decoding a clip to its log-mel took, measured as the
    image's decoding is: 120 s at 8 kHz (the estimate of 8 float32 copies of the source's
    samples said a third of it) and at 48 kHz stereo."""
    from jaxmllm.data.media.audio import decode_bytes

    path = wav(tmp_path / "clip.wav", seconds=120.0, rate=rate, channels=channels)
    out = subprocess.run(
        [sys.executable, "-c", CLIP_PEAK, str(path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    peak, frames = int(out.stdout.split()[-1]), 120 * rate
    assert peak <= decode_bytes(frames, rate, 16000), (peak, decode_bytes(frames, rate, 16000))
    assert peak > decode_bytes(frames, rate, 16000) / 2, peak  # (the estimate is not loose)
