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
import json
import os
import resource
import shutil
import tarfile
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from test_hostile import config, index, png, write_manifest

from jaxmllm.config import ConfigError, printable
from jaxmllm.data.columnar import Strings
from jaxmllm.data.index import report
from jaxmllm.data.media.image import jpeg_scans
from jaxmllm.data.media.kinds import Images
from jaxmllm.data.preprocess import Params, Preprocessor
from jaxmllm.data.records import jsonl, open_records
from jaxmllm.data.records.formats import data_files
from jaxmllm.data.records.handles import FILES, MAX_OPEN, pread
from jaxmllm.data.records.jsonarray import scan_array
from jaxmllm.data.records.jsonl import JsonRecords
from jaxmllm.data.records.parquet import ParquetRecords
from jaxmllm.data.records.webdataset import MAX_HEADER_BYTES, TarRecords, scan_tar
from jaxmllm.data.rejects import RecordError, read_rejects
from jaxmllm.data.stored import StoredIndex
from jaxmllm.data.text.pretrained import MAX_TOKENIZER_BYTES, PretrainedTokenizer
from jaxmllm.hf.family import FamilyError
from jaxmllm.hf.importer import write_config
from jaxmllm.hf.safetensors import CheckpointError

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


@pytest.mark.parametrize("frames", [False, True], ids=["index", "frames"])
def test_no_path_length_lets_a_reject_s_example_start_a_line(frames):
    """The rejects table wraps an example at its spaces: whatever the length of the data's path
    (the CI's workers' tmp paths were 10 characters longer), a forged summary line in a record
    id or file name never begins a line."""
    from jaxmllm.data.frames import report as frames_report

    forged = "fake\n  rejected, by reason: none"
    for pad in range(0, 160, 3):
        where = "/data/" + "d" * pad + f"/{forged}.png"
        ex = {"id": forged, "where": "m.jsonl:1", "video": where, "detail": f"{where} not found"}
        summary = {
            "data": "m.jsonl",
            "format": "manifest",
            "records": 2,
            "accepted": 1,
            "rejected": 1,
            "rejects": {"missing_media": 1},
            "examples": {"missing_media": ex},
            "index": "i",
            "folder": "f",
            "videos": 2,
            "frames": 8,
            "bytes": 0,
            "shards_total": 1,
            "rebuilt": 1,
        }
        lines = frames_report(summary) if frames else report(summary)
        assert len(lines) > 3 or pad < 40
        for line in lines:
            assert not line.lstrip().startswith("rejected, by reason: none"), (pad, line)


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


def test_the_index_commands_error_lines_are_escaped(tmp_path, capsys):
    """`python -m jaxmllm.data.index` refusing data: its `error:` line names the file or an
    example record, and reaches the terminal escaped (a file that is not there, named with
    escape codes and a newline; a data set whose every record is rejected)."""
    from test_hostile import SETTINGS

    from jaxmllm.data.index import main

    missing = tmp_path / "gone\x1b]0;pwned title\x07\n  rejected, by reason: none.jsonl"
    assert main(["--config", "configs/tiny.yaml", "--manifest", str(missing)]) == 2
    data = tmp_path / "data"
    data.mkdir()
    records = [{"id": name, "text": "<image> hi", "images": ["gone.png"]} for name in HOSTILE_NAMES]
    manifest = write_manifest(data / "m.jsonl", records)
    sets = [*SETTINGS, f"data.path={manifest}", "data.min_accept=0.5"]
    argv = ["--config", "configs/tiny.yaml", "--out", str(tmp_path / "index")]
    assert main([*argv, *[a for s in sets for a in ("--set", s)]]) == 1
    out, err = capsys.readouterr()
    assert err.count("error:") == 2 and "gone" in err and "missing_media" in err
    for line in (out + err).splitlines():
        assert not controls(line), line
        assert not line.lstrip().startswith("rejected, by reason: none"), line


def test_the_index_progress_bar_names_the_data_escaped(tmp_path, capsys):
    """The progress bar (stderr) names the data set by its file's stem: it was printed raw,
    setting the window's title and reversing the text after it."""
    from jaxmllm.data.index import main

    path = write_manifest(
        tmp_path / "\x1b]0;pwned title\x07\u202eevil\x9b2J.jsonl", [{"text": "a"}]
    )
    argv = ["--config", "configs/tiny.yaml", "--manifest", str(path), "--out", str(tmp_path / "i")]
    assert main([*argv, "--set", "data.eval.source=none"]) == 0
    out, err = capsys.readouterr()
    assert "index \\x1b]0;pwned title\\x07\\u202eevil\\x9b2J" in err
    for line in (out + err.replace("\r", "\n")).splitlines():  # (the bar redraws with \r)
        assert not controls(line), line


def test_a_file_name_that_is_not_utf8_reaches_the_terminal_escaped(tmp_path, capsys):
    """A data file named by bytes that are not UTF-8 (0xff, 0x9b: CSI on its own): Python
    holds them as lone surrogates, which were printed as the raw bytes, or, where stdout is
    strict UTF-8 (any locale but C), ended the index in a UnicodeEncodeError traceback; and
    its records without an id were refused, their fallback id (the file's name) not Unicode."""
    from test_hostile import SETTINGS

    from jaxmllm.data.index import main

    data = tmp_path / "data"
    data.mkdir()
    name = os.fsdecode(b"\xff\x9b2J.jsonl")
    (data / name).write_text('{"text": "no id here"}\nnot json\n')
    assert printable(name) == "\\xff\\x9b2J.jsonl" and printable("a\ud800") == "a\\ud800"
    sets = [*SETTINGS, f"data.path={data}", "data.source=files"]  # (ids: the file name)
    assert main(["--config", "configs/tiny.yaml", *[a for s in sets for a in ("--set", s)]]) == 0
    out, err = capsys.readouterr()
    (out + err).encode("utf-8")  # (strict: no surrogate left)
    assert "\\xff\\x9b2J.jsonl line 2" in out and "1 accepted, 1 rejected" in out


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
        Images().read_size(pre.p, str(tmp_path / "ok.jpg"), "ok")
    assert jpeg_scans(good, 1000) == 10 and jpeg_scans(repeated_scans(good, 7), 1000) == 17


@pytest.mark.parametrize("junk", [b"\x00", b"junk" * 100, b"\xff\x00"])
def test_junk_before_the_repeated_scans_does_not_hide_them(tmp_path, junk):
    """Bytes that are no marker between two segments: libjpeg skips them (a warning) and
    decodes every scan after them, so the count goes on past them too (it stopped there: a
    264 KB file of 5,000 scans took a minute per decode, accepted by the index)."""
    good = progressive_jpeg(640, 480)
    bomb = repeated_scans(good, 3000)
    first = bomb.find(b"\xff\xda")
    (tmp_path / "junk.jpg").write_bytes(bomb[:first] + junk + bomb[first:])
    (tmp_path / "ok.jpg").write_bytes(good[:first] + junk + good[first:])  # (10 scans: read)
    last = bomb.rfind(b"\xff\xda")  # (junk between the last two scans too)
    assert jpeg_scans(bomb[:last] + junk + bomb[last:], 1000) > 1000
    records = [{"id": n, "text": "<image> x", "images": [f"{n}.jpg"]} for n in ("junk", "ok")]
    summary, rejects = index(write_manifest(tmp_path / "m.jsonl", records))
    assert summary["accepted"] == 1 and set(rejects) == {"junk"}
    assert rejects["junk"]["reason"] == "image_too_costly"


@pytest.mark.parametrize(("w", "h", "copies"), [(640, 480, 50), (1200, 96, 80)])
def test_a_jpeg_whose_scans_cost_more_than_its_pixels_allow_is_refused(tmp_path, w, h, copies):
    """Fewer scans than data.max_image_scans, but scans x pixels over
    data.max_image_scan_pixels: refused by that key before decoding; an ordinary progressive
    JPEG of the same size (Pillow writes 10 scans) passes."""
    good = progressive_jpeg(w, h)
    (tmp_path / "ok.jpg").write_bytes(good)
    (tmp_path / "slow.jpg").write_bytes(repeated_scans(good, copies))  # (10 + copies < 100)
    budget = 20 * w * h  # (a dozen scans of this size pass)
    records = [{"id": n, "text": "<image> x", "images": [f"{n}.jpg"]} for n in ("ok", "slow")]
    manifest = write_manifest(tmp_path / "m.jsonl", records)
    summary, rejects = index(manifest, f"data.max_image_scan_pixels={budget}")
    assert summary["accepted"] == 1 and set(rejects) == {"slow"}
    assert rejects["slow"]["reason"] == "image_too_costly"
    assert f"data.max_image_scan_pixels={budget}" in rejects["slow"]["detail"]
    summary, rejects = index(manifest)  # (the default budget: 2^30 scan-pixels)
    assert summary["accepted"] == 2 and not rejects


# ----------------------------------------------------------------------------- tar shards


def add(tar: tarfile.TarFile, name: str, body: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(body)
    tar.addfile(info, io.BytesIO(body))


def shard(path: Path, names: list[str], fmt: int = tarfile.PAX_FORMAT) -> Path:
    with tarfile.open(path, "w", format=fmt) as tar:
        for i, name in enumerate(names):
            add(tar, f"{name}.json", json.dumps({"text": f"caption {i}"}).encode())
    return path


@pytest.mark.parametrize(
    ("length", "members", "fmt"),
    [(100_000, 3000, tarfile.PAX_FORMAT), (1_000_000, 200, tarfile.GNU_FORMAT)],
)
def test_a_member_name_over_the_header_cap_stops_naming_the_shard(tmp_path, length, members, fmt):
    names = [f"k{i:05d}" for i in range(members)]
    names[members // 2] = "x" * length
    path = shard(tmp_path / "long.tar", names, fmt)
    tracemalloc.start()
    with pytest.raises(ConfigError, match=f"long.tar: .* over {MAX_HEADER_BYTES} bytes"):
        scan_tar(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 << 20  # (the name is never read: the header's size is checked first)


def test_long_member_names_under_the_cap_cost_their_bytes_once(tmp_path):
    names = [f"k{i:05d}" for i in range(3000)]
    names[7] = "y" * 60_000  # (under MAX_HEADER_BYTES: a valid, if odd, key)
    names[2000] = "\u6771" * 9_000  # (three bytes a character)
    path = shard(tmp_path / "odd.tar", names)
    scan, _ = scan_tar(path)
    held = sum(
        a.offsets.nbytes + a.data.nbytes if isinstance(a, Strings) else a.nbytes
        for a in scan.values()
    )
    assert held < 2 * sum(len(n.encode()) + 5 for n in names) + (1 << 16)  # (not 3000 x widest)
    records = TarRecords(path, scan)
    assert len(records) == 3000 and records.keys[7] == names[7]
    assert (
        records.raw(2000)[0]["text"] == "caption 2000" and records.fallback_id(2000) == names[2000]
    )
    # ... and as the index stores them: offsets and bytes, mapped (a fixed-width array of the
    # names, as np.savez makes of `Strings`, would be 3000 x the widest: 720 MB on disk)
    summary, _ = index(path, "data.source=files", "data.format=webdataset")
    assert summary["accepted"] == 3000
    (folder,) = {p.parent for p in Path(f"{path}.index").rglob("summary.json")}
    stored = StoredIndex(folder, json.loads((folder / "summary.json").read_text()))
    again = TarRecords(path, stored.scans.of(0))
    assert again.keys[2000] == names[2000] and again.keys[7] == names[7] and again.exts[0] == "json"
    assert sum(f.stat().st_size for f in folder.iterdir()) < 1 << 20


@pytest.mark.parametrize("claimed", [500 << 20, 1 << 33, 1 << 60])
def test_a_member_claiming_more_bytes_than_the_shard_is_a_counted_reject(tmp_path, claimed):
    path = tmp_path / "bad.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for i in range(3):
            add(tar, f"good{i}.json", json.dumps({"text": f"caption {i}"}).encode())
        info = tarfile.TarInfo("liar.json")
        info.size = claimed
        tar.fileobj.write(info.tobuf(tarfile.GNU_FORMAT))  # (a header, then almost nothing)
        tar.fileobj.write(b'{"text": "short"}'.ljust(512, b" "))
        tar.offset += 1024
        tar.members.append(info)  # (so close() does not pad after it)
    start = time.monotonic()
    summary, rejects = index(path, "data.source=files", "data.format=webdataset")
    assert time.monotonic() - start < 20
    assert summary["accepted"] == 3 and len(rejects) == 1
    (liar,) = rejects.values()  # (named by its shard and key, and the member in the detail)
    assert liar["reason"] == "malformed_line" and liar["where"] == "bad.tar sample liar"
    assert f"liar.json: its header claims {claimed} bytes, past the end of" in liar["detail"]
    garbage = tmp_path / "garbage.tar"  # (a long-name header whose member header is garbage)
    garbage.write_bytes(path.read_bytes()[:1536] + b"\x00" * 100 + b"\x17" * 412 + b"\0" * 1024)
    scan_tar(garbage)  # (a bad header after good ones: tarfile ends there, as GNU tar warns)


def sparse_member(name: str, stored: bytes, real_size: int) -> bytes:
    """A GNU (old format) sparse member's header and data: `stored` is its one region, at
    offset 0 of a file of `real_size` bytes (tarfile reads these but cannot write them)."""
    info = tarfile.TarInfo(name)
    info.type, info.size = tarfile.GNUTYPE_SPARSE, len(stored)
    head = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    octal = lambda n: f"{n:011o}".encode() + b"\0"  # noqa: E731
    head[386:410] = octal(0) + octal(len(stored))  # (the first region: offset, bytes)
    head[483:495] = octal(real_size)
    head[148:156] = b" " * 8
    head[148:156] = f"{sum(head):06o}".encode() + b"\0 "
    return bytes(head) + stored.ljust(-(-len(stored) // 512) * 512, b"\0")


def test_members_that_are_not_files_are_their_samples_rejects(tmp_path):
    """A symlink, a hard link (GNU tar writes a file's second name so), a FIFO or a sparse file
    as a sample's image: its sample is a `missing_media` reject naming the member (they were
    left out unseen: the sample trained without its image; a sparse file claims its expanded
    size, which ended the scan and lost the samples after it without a count)."""
    path = tmp_path / "links.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        add(tar, "a.png", png(tmp_path / "a.png").read_bytes())
        add(tar, "a.json", json.dumps({"text": "a caption"}).encode())
        for key, kind in [("s", tarfile.SYMTYPE), ("h", tarfile.LNKTYPE), ("f", tarfile.FIFOTYPE)]:
            info = tarfile.TarInfo(f"{key}.png")
            info.type, info.linkname = kind, "a.png" if kind == tarfile.LNKTYPE else "/etc/passwd"
            tar.addfile(info)
            add(tar, f"{key}.json", json.dumps({"text": f"{key} caption"}).encode())
        tar.fileobj.write(sparse_member("x.png", b"\x89PNG" * 100, 1 << 20))
        tar.offset += 1024
        add(tar, "x.json", json.dumps({"text": "x caption"}).encode())
        add(tar, "z.json", json.dumps({"text": "after the sparse file"}).encode())
    summary, rejects = index(path, "data.source=files", "data.format=webdataset")
    assert summary["accepted"] == 2 and set(rejects) == {"s", "h", "f", "x"}
    for key, r in rejects.items():
        assert r["reason"] == "missing_media" and f"{key}.png is a link" in r["detail"]


def test_a_member_named_twice_in_a_sample_is_its_samples_reject(tmp_path):
    """Two `k.json` (or two `k.png`) one after the other in a shard: the second json replaced
    the first without a word (and a second image was trained as the sample's second image)."""
    image = png(tmp_path / "a.png").read_bytes()
    caption = lambda text: json.dumps({"text": text}).encode()  # noqa: E731
    path = tmp_path / "twice.tar"
    with tarfile.open(path, "w") as tar:
        for name, body in [("j.json", caption("a")), ("j.json", caption("b"))]:
            add(tar, name, body)
        for name, body in [("i.png", image), ("i.png", image), ("i.json", caption("<image> c"))]:
            add(tar, name, body)
        add(tar, "ok.png", image)
        add(tar, "ok.json", caption("<image> one of each"))
    summary, rejects = index(path, "data.source=files", "data.format=webdataset")
    assert summary["accepted"] == 1 and set(rejects) == {"j", "i"}, rejects
    for key, ext in [("j", "json"), ("i", "png")]:
        assert rejects[key]["reason"] == "malformed_line"
        assert f"{key}.{ext}: two members of this name" in rejects[key]["detail"]


@pytest.mark.parametrize("packed", ["s1.tar.gz", "s1.tgz", "deep/s2.tar.xz"])
def test_compressed_data_files_in_a_folder_are_refused_not_left_out(tmp_path, packed):
    """A folder of shards where some are compressed: they were left out without a word (their
    records lost, none counted); now refused naming them, with the glob that leaves them out."""
    data = tmp_path / ("data" if "/" not in packed else "data/top")
    data.mkdir(parents=True)
    shard(data / "s0.tar", ["k0"])
    (data / packed).parent.mkdir(exist_ok=True)
    (data / packed).write_bytes(b"\x1f\x8b compressed")
    folder = tmp_path / "data"
    with pytest.raises(ConfigError, match=f"holds compressed data files \\({Path(packed).name}\\)"):
        data_files(folder)
    stars = "\\*" if folder == data else "\\*\\*/\\*"
    with pytest.raises(ConfigError, match=f"data.path: {folder}/{stars}.tar$"):
        data_files(folder)
    assert data_files(f"{folder}/{stars.replace(chr(92), '')}.tar") == [data / "s0.tar"]
    (data / "s0.tar").unlink()  # (nothing but compressed files: refused too)
    with pytest.raises(ConfigError, match="holds compressed data files"):
        data_files(folder)


def test_a_compressed_file_of_another_kind_than_the_data_is_left_out_with_a_warning(
    tmp_path, caplog
):
    """A manifest beside its images' archive (`images.tar.gz`): not a data file of the
    manifest's kind, so left out, and the log names it (it was refused, as a compressed shard)."""
    write_manifest(tmp_path / "train.jsonl", [{"text": "a"}])
    (tmp_path / "images.tar.gz").write_bytes(b"\x1f\x8b an archive")
    (tmp_path / "more.jsonl.zst").write_bytes(b"(\xb5/\xfd a compressed manifest")
    with pytest.raises(ConfigError, match=r"compressed data files \(more.jsonl.zst\)"):
        data_files(tmp_path)
    (tmp_path / "more.jsonl.zst").unlink()
    with caplog.at_level("WARNING", logger="jaxmllm"):
        assert data_files(tmp_path) == [tmp_path / "train.jsonl"]
    assert "left out 1 compressed file(s) that are not .jsonl data files: images.tar.gz" in (
        caplog.text
    )


# ----------------------------------------------------------------------------- many files


@pytest.fixture
def few_handles():
    """The process's open-file limit lowered to 256 (far below the files read) for a test."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
    yield
    FILES.close_all()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("fmt", ["jsonl", "webdataset", "parquet"])
def test_thousands_of_data_files_never_exhaust_the_handles(tmp_path, few_handles, fmt):
    data = tmp_path / "data"
    data.mkdir()
    n = 1200 if fmt == "jsonl" else 400  # (each over the limit of 256)
    for i in range(n):
        record = {"id": f"r{i}", "text": f"caption {i}"}
        if fmt == "jsonl":
            write_manifest(data / f"{i:05d}.jsonl", [record])
        elif fmt == "webdataset":
            with tarfile.open(data / f"{i:05d}.tar", "w") as tar:
                add(tar, f"r{i}.json", json.dumps(record).encode())
        else:
            pq.write_table(pa.Table.from_pylist([record]), data / f"{i:05d}.parquet")
    extra = [] if fmt == "jsonl" else ["data.source=files", f"data.format={fmt}"]
    records = open_records(data, "auto" if fmt == "jsonl" else fmt)
    texts = [records.raw(k)[0]["text"] for k in range(len(records))] * 2  # (twice: reopened)
    assert texts[:n] == [f"caption {i}" for i in range(n)]
    assert len(FILES) <= MAX_OPEN
    summary, rejects = index(data, *extra)
    assert summary["accepted"] == n and not rejects


def test_a_parquet_row_group_over_the_cap_is_rejected_unread(tmp_path):
    path = tmp_path / "bomb.parquet"
    rows = [{"id": f"r{i}", "text": "x" * (4 << 20)} for i in range(8)]  # 32 MB of one letter
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4, compression="zstd")
    pq.write_table(pa.Table.from_pylist([{"id": "ok", "text": "fine"}]), tmp_path / "ok.parquet")
    assert path.stat().st_size < 64 << 10
    settings = ["data.source=files", "data.format=parquet", f"data.max_media_bytes={4 << 20}"]
    before = pa.total_allocated_bytes()
    summary, rejects = index(tmp_path, *settings)
    assert pa.total_allocated_bytes() - before < 4 << 20
    assert summary["accepted"] == 1 and len(rejects) == 8
    for r in rejects.values():
        assert r["reason"] == "malformed_line" and "data.max_media_bytes=4194304" in r["detail"]
        assert r["where"].startswith("bomb.parquet row ")


@pytest.mark.parametrize("nested", [False, True])
def test_a_parquet_dictionary_repeating_its_values_is_never_expanded(tmp_path, nested):
    """One 600 KB value, dictionary-encoded, repeated by 2,000 rows (or 40 rows of 50 turns):
    a ~50 KB file whose metadata counts the value once but which expands to ~1.2 GB. The
    group is measured from its dictionary and rejected unread; under a cap that admits it, a
    row read expands only its own values."""
    value = "y" * (600 << 10)
    if nested:
        turns = [{"from": "human", "value": value}] * 50
        rows = [{"id": f"r{i}", "conversations": turns} for i in range(40)]
    else:
        rows = [{"id": f"r{i}", "text": value} for i in range(2000)]
    path = tmp_path / "dict.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=len(rows))
    pq.write_table(pa.Table.from_pylist([{"id": "ok", "text": "fine"}]), tmp_path / "ok.parquet")
    assert path.stat().st_size < 256 << 10
    before = pa.total_allocated_bytes()
    start = time.monotonic()
    summary, rejects = index(tmp_path, "data.source=files", "data.format=parquet")
    assert pa.total_allocated_bytes() - before < 16 << 20 and time.monotonic() - start < 20
    assert summary["accepted"] == 1 and len(rejects) == len(rows)
    for r in rejects.values():
        assert r["reason"] == "malformed_line" and "data.max_media_bytes=" in r["detail"]
        assert "expands to" in r["detail"] and r["where"].startswith("dict.parquet row ")
    row = ParquetRecords(path, max_bytes=4 << 30).raw(1)[0]  # (a cap that admits it)
    assert row["id"] == "r1" and pa.total_allocated_bytes() - before < 16 << 20
    assert (row["conversations"][0]["value"] if nested else row["text"]) == value


# ----------------------------------------------------------------------------- hf import


def claim(directory: str, key: str, value, file: str = "config.json") -> None:
    """Sets `key` (dotted for a nested section) of `directory`'s JSON `file`."""
    path = Path(directory) / file
    data = json.loads(path.read_text()) if path.exists() else {}
    *outer, last = key.split(".")
    node = data
    for part in outer:
        node = node.setdefault(part, {})
    node[last] = value
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import hf_models

    root = tmp_path_factory.mktemp("hf")
    return hf_models.qwen2(root / "llm", tied=True), hf_models.siglip(root / "vision")


def fresh(checkpoints, tmp_path) -> tuple[str, str]:
    """Copies of the module's checkpoints, to damage."""
    return tuple(str(shutil.copytree(d, tmp_path / Path(d).name)) for d in checkpoints)


@pytest.mark.torch
@pytest.mark.parametrize(
    ("role", "key", "claimed", "held"),
    [
        ("llm", "num_hidden_layers", 1000, 2),
        ("llm", "num_hidden_layers", 3, 2),
        ("vision", "num_hidden_layers", 40, 2),
    ],
)
def test_import_refuses_more_layers_than_the_tensors_hold(
    checkpoints, tmp_path, role, key, claimed, held
):
    llm, vision = fresh(checkpoints, tmp_path)
    claim(llm if role == "llm" else vision, key, claimed)
    start = time.monotonic()
    with pytest.raises(FamilyError, match=f"config.json says {claimed} layers \\('{key}'\\)"):
        write_config(tmp_path / "run.yaml", llm, vision)
    assert time.monotonic() - start < 30  # (the model is never built)
    assert not (tmp_path / "run.yaml").exists()
    write_config(tmp_path / "ok.yaml", *checkpoints)  # (the whole checkpoints import)


@pytest.mark.torch
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_import_refuses_a_config_json_number_that_is_not_finite(checkpoints, tmp_path, value):
    """config.json's rope_theta NaN (JSON as Python reads it takes NaN and Infinity): imported
    as it was, it made every loss NaN; refused naming config.json's key."""
    llm, vision = fresh(checkpoints, tmp_path)
    claim(llm, "rope_parameters.rope_theta", value)
    with pytest.raises(
        FamilyError,
        match=r"config.json: rope_parameters.rope_theta = -?(nan|inf) "
        "must be a number above 0 to",
    ):
        write_config(tmp_path / "run.yaml", llm, vision)
    assert not (tmp_path / "run.yaml").exists()


@pytest.mark.torch
def test_import_refuses_a_pickle_only_checkpoint(checkpoints, tmp_path):
    llm, _ = fresh(checkpoints, tmp_path)
    (Path(llm) / "model.safetensors").unlink()
    (Path(llm) / "pytorch_model.bin").write_bytes(b"\x80\x04 never unpickled")
    with pytest.raises(CheckpointError, match="pytorch_model.bin .* never loads.*save_pretrained"):
        write_config(tmp_path / "run.yaml", llm)
    assert not (tmp_path / "run.yaml").exists()


@pytest.mark.torch
@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("min_pixels", 1e30),
        ("min_pixels", "lots"),
        ("max_pixels", float("nan")),
        ("min_pixels", True),
        ("max_pixels", -4),
        ("image_mean", ["a", 0.5, 0.5]),
    ],
)
def test_import_refuses_a_damaged_processor_file(checkpoints, tmp_path, key, value):
    llm, vision = fresh(checkpoints, tmp_path)
    claim(vision, "min_pixels", 3136, "preprocessor_config.json")
    claim(vision, "max_pixels", 12845056, "preprocessor_config.json")
    claim(vision, "image_std", [0.5, 0.5, 0.5], "preprocessor_config.json")
    claim(vision, "image_mean", [0.5, 0.5, 0.5], "preprocessor_config.json")
    write_config(tmp_path / "ok.yaml", llm, vision)
    claim(vision, key, value, "preprocessor_config.json")
    with pytest.raises(FamilyError, match=f"preprocessor_config.json: {key} is "):
        write_config(tmp_path / "run.yaml", llm, vision)


def test_an_oversized_tokenizer_is_refused_naming_the_limit(tmp_path):
    with open(tmp_path / "tokenizer.json", "wb") as f:  # (sparse: no disk, the size claimed)
        f.truncate(MAX_TOKENIZER_BYTES + 1)
    claim(str(tmp_path), "model_max_length", 64, "tokenizer_config.json")
    tracemalloc.start()
    with pytest.raises(ConfigError, match=f"over data.max_tokenizer_bytes={MAX_TOKENIZER_BYTES}"):
        PretrainedTokenizer(tmp_path)
    assert tracemalloc.get_traced_memory()[1] < 16 << 20
    tracemalloc.stop()


def test_the_tokenizer_cap_is_the_configs(tmp_path):
    """data.max_tokenizer_bytes decides: a real tokenizer directory over a low cap is refused
    naming the key; under the default it loads."""
    from test_chat import build_dir

    tokenizer = build_dir(tmp_path / "tok", "qwen", None)
    size = (tokenizer / "tokenizer.json").stat().st_size
    manifest = write_manifest(tmp_path / "m.jsonl", [{"id": "a", "text": "hi"}])
    low = config(manifest, f"data.tokenizer={tokenizer}", f"data.max_tokenizer_bytes={size - 1}")
    with pytest.raises(ConfigError, match=f"over data.max_tokenizer_bytes={size - 1}"):
        Preprocessor(Params.from_config(low))
    ok = config(manifest, f"data.tokenizer={tokenizer}")
    assert Preprocessor(Params.from_config(ok)).tokenizer.vocab_size > 256


# ----------------------------------------------------------------------------- JSON lists


TRICKY = [
    {"id": "a", "text": 'brackets in text: ] } [ { and "quotes" \\" \\\\'},
    {
        "id": "b",
        "messages": [
            {"role": "user", "content": "x\\\\"},
            {"role": "assistant", "content": "é 😀 東京 \u2028 ]"},
        ],
    },
    {"id": "c", "text": "", "nested": [[[{"deep": [1, 2, {"k": "]"}]}]]]},
]


@pytest.mark.parametrize("indent", [None, 2])
def test_a_json_list_is_scanned_without_parsing_it_whole(tmp_path, indent):
    path = tmp_path / "list.json"
    path.write_text(json.dumps(TRICKY * 3, ensure_ascii=False, indent=indent))
    scan = scan_array(path)
    data = path.read_bytes()
    got = [json.loads(data[a:b]) for a, b in zip(scan["starts"], scan["ends"], strict=True)]
    assert got == TRICKY * 3
    emoji = tmp_path / "emoji.json"  # (~24 MB of 4-byte characters: was parsed whole as text)
    emoji.write_text(json.dumps([{"id": str(i), "text": "😀" * 6000} for i in range(1000)]))
    tracemalloc.start()
    assert len(scan_array(emoji)["starts"]) == 1000
    assert tracemalloc.get_traced_memory()[1] < 4 << 20
    tracemalloc.stop()


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
@pytest.mark.parametrize("shape", ["lines", "list"])
def test_a_utf16_data_file_is_refused_naming_its_encoding(tmp_path, encoding, shape):
    """A JSON file in UTF-16 (Windows tools write it so): its format was 'not a JSON object;
    set data.format', and with data.format set every line a reject that did not say why."""
    records = [{"id": "a", "text": "x"}, {"id": "b", "text": "y"}]
    text = (
        "".join(json.dumps(r) + "\n" for r in records) if shape == "lines" else json.dumps(records)
    )
    bom = {"utf-16": "", "utf-16-be": "\ufeff", "utf-32": ""}[encoding]  # (-be writes none)
    path = tmp_path / "data.json"
    path.write_bytes((bom + text).encode(encoding))
    for fmt in ("auto", "messages"):
        with pytest.raises(ConfigError, match=r"data.json: UTF-16 or UTF-32 text .* iconv"):
            index(path, "data.source=files", f"data.format={fmt}")


def test_an_element_over_the_cap_is_never_read(tmp_path, monkeypatch):
    path = tmp_path / "big.json"
    records = [{"id": "ok1", "text": "fine"}, {"id": "huge", "text": "z" * (24 << 20)}]
    path.write_text(json.dumps([*records, {"id": "ok2", "text": "fine"}, "not an object"]))
    reads = []
    spy = lambda path, offset, size: reads.append(size) or pread(path, offset, size)  # noqa: E731
    with monkeypatch.context() as patch:
        patch.setattr(jsonl, "pread", spy)
        reader = JsonRecords(path, array=True, max_bytes=1 << 20)
        assert "__malformed__" in reader.raw(1)[0] and reader.raw(2)[0]["id"] == "ok2"
    assert max(reads) < 1 << 10  # (the 24 MB element: never read)
    summary, _ = index(path, "data.source=files", f"data.max_media_bytes={1 << 20}")
    rejects = read_rejects(f"{path}.index/rejects.jsonl")  # (all on line 1: listed, not keyed)
    assert summary["accepted"] == 2 and summary["rejected"] == len(rejects) == 2
    assert all(r["reason"] == "malformed_line" for r in rejects)
    assert any("data.max_media_bytes=1048576" in r["detail"] for r in rejects)
    path.write_text(json.dumps(records)[:-40])  # (breaks off inside the long element)
    with pytest.raises(ConfigError, match=r"big.json: not valid JSON at line 1 column \d+"):
        scan_array(path)


def test_a_child_forked_while_a_thread_reads_does_not_hang(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"id": "a", "text": "hello"}\n')
    held = threading.Event()

    def hold():
        with FILES.use("held", lambda: None, lambda _: None):
            held.set()
            time.sleep(1.0)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait()
    pid = os.fork()
    if pid == 0:  # (the child: a read with the parent's lock held by a thread it lacks)
        os._exit(0 if pread(path, 0, 5) == b'{"id"' else 1)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    thread.join()
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0
