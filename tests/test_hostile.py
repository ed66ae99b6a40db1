"""Hostile and broken input (issue 30), the data side: each class built in tmp_path, several
instances each, and its outcome asserted (a counted reject with its reason, within a time
bound), nothing outside the data set read or embedded.

Classes: media paths that escape the data set (.., absolute paths, symlinks, the ArrayRecord
converter); files and lines over the size caps; one record's unbounded work (audio by samples,
an exception, over-long text, chat templates that loop or allocate). The checkpoints, config
values and faults during a run: tests/test_hostile_run.py.

Time bounds here are backstops against a hang (`BACKSTOP_S`, far above any input's run time),
never speed limits.
"""

from __future__ import annotations

import io
import json
import os
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from PIL import Image
from test_fuzz import opened  # noqa: F401  (the fixture recording every path opened)

from jaxmllm.config import ConfigError, load_config
from jaxmllm.data.arrayrecord import convert
from jaxmllm.data.index import build_index
from jaxmllm.data.loader import Loader
from jaxmllm.data.media.audio import Caps, Resampler, load_audio, read_info, resampled_length
from jaxmllm.data.records import open_records
from jaxmllm.data.rejects import DataError, RecordError, read_rejects
from jaxmllm.data.source import open_source

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

ROOT = Path(__file__).resolve().parents[1]
BACKSTOP_S = 60.0  # a hang guard: no input here takes more than a few seconds
SETTINGS = [
    "data.source=jsonl",
    "data.eval.source=none",
    "data.image_min_pixels=256",
    "data.image_max_pixels=1024",
    "data.audio_max_frames=32",
    "data.min_accept=0",
]  # (these data sets are mostly bad on purpose)


def config(path, *extra):
    return load_config("configs/tiny.yaml", [*SETTINGS, f"data.path={path}", *extra])


def index(path, *extra) -> tuple[dict, dict[str, dict]]:
    """Builds the index of the manifest at `path`; (summary, rejects by record id)."""
    cfg = config(path, f"data.index_dir={path}.index", *extra)
    start = time.monotonic()
    summary = build_index(cfg, path, f"{path}.index", progress=False)
    assert time.monotonic() - start < BACKSTOP_S
    rejects = {r["id"]: r for r in read_rejects(f"{path}.index/rejects.jsonl")}
    return summary, rejects


def write_manifest(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def png(path: Path, w: int = 24, h: int = 16) -> Path:
    Image.fromarray(np.full((h, w, 3), 120, np.uint8)).save(path)
    return path


def wav(path: Path, seconds: float = 0.5, rate: int = 16000, channels: int = 1) -> Path:
    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * 440 * t)
    sf.write(path, np.stack([x] * channels, 1) if channels > 1 else x, rate)
    return path


# ----------------------------------------------------------------------------- paths


@pytest.fixture
def tree(tmp_path):
    """A data set (data/: a manifest's folder with img/, clips/, a symlink in and two out) and,
    beside it, a folder it must never reach (outside/: a private image, a secret clip)."""
    data, outside = tmp_path / "data", tmp_path / "outside"
    (data / "img").mkdir(parents=True)
    outside.mkdir()
    png(data / "img" / "ok.png")
    png(outside / "private.png")
    (data / "clips").mkdir()
    wav(data / "clips" / "ok.wav")
    wav(outside / "secret.wav")
    (data / "inside_link.png").symlink_to(data / "img" / "ok.png")
    (data / "out_link.png").symlink_to(outside / "private.png")
    (data / "out_dir").symlink_to(outside)
    return data, outside


OUTSIDE_ENTRIES = {  # record id -> (key, entry), each leading out of data/
    "dotdot": ("images", "../outside/private.png"),
    "dotdot_deep": ("images", "img/../../outside/private.png"),
    "absolute": ("images", "{outside}/private.png"),
    "symlink": ("images", "out_link.png"),
    "symlinked_dir": ("images", "out_dir/private.png"),
    "etc_passwd": ("images", "/etc/passwd"),
    "environ": ("images", "/proc/self/environ"),
    "audio_dotdot": ("audio", "../outside/secret.wav"),
    "audio_absolute": ("audio", "{outside}/secret.wav"),
}


def outside_the_data(path: Path, outside: Path) -> bool:
    real = path.resolve()
    return real.is_relative_to(outside.resolve()) or str(real).startswith(("/etc", "/proc"))


def outside_records(outside: Path) -> list[dict]:
    out = []
    for rid, (key, entry) in OUTSIDE_ENTRIES.items():
        marker = "<image>" if key == "images" else "<audio>"
        out.append({"id": rid, "text": f"{marker} x", key: [entry.format(outside=outside)]})
    return out


def inside_records(data: Path) -> list[dict]:
    return [
        {"id": "relative", "text": "<image> a", "images": ["img/ok.png"]},
        {"id": "absolute_inside", "text": "<image> b", "images": [str(data / "img/ok.png")]},
        {"id": "link_inside", "text": "<image> c", "images": ["inside_link.png"]},
        {"id": "clip", "text": "<audio> d", "audio": ["clips/ok.wav"]},
    ]


def test_a_sibling_media_folder_is_let_in_by_confine_media_to(tree, opened):  # noqa: F811
    """ShareGPT records in data/sharegpt/ whose images are in data/images/ ("../images/0.png",
    a common layout): confined to the folder paths start from, every one is rejected with a
    message naming data.confine_media_to; confined to data/, they load with their relative
    paths unchanged, and whatever leads out of data/ is still rejected, unread."""
    data, outside = tree
    (data / "sharegpt").mkdir()
    (data / "images").mkdir()
    png(data / "images" / "0.png")
    records = [
        {"id": "sibling", "text": "<image> a", "images": ["../images/0.png"]},
        {"id": "beyond", "text": "<image> b", "images": ["../../outside/private.png"]},
    ]
    manifest = write_manifest(data / "sharegpt" / "train.jsonl", records)
    summary, rejects = index(manifest, "data.min_accept=0")
    assert summary["accepted"] == 0 and rejects["sibling"]["reason"] == "path_outside_root"
    detail = rejects["sibling"]["detail"]
    assert "set data.confine_media_to to a folder that holds it" in detail, detail
    assert "0.png" not in detail and str(outside) not in rejects["beyond"]["detail"]  # (unsaid)
    opened.clear()
    summary, rejects = index(manifest, f"data.confine_media_to={data}")
    assert summary["accepted"] == 1 and rejects["beyond"]["reason"] == "path_outside_root"
    assert not [p for p in opened if outside_the_data(p, outside)]
    cfg = config(manifest, f"data.index_dir={manifest}.index", f"data.confine_media_to={data}")
    assert open_source(cfg)[0].loss.any()  # (loaded from data/images/, the path as written)
    # A confinement that does not hold the folder paths start from is a config error.
    with pytest.raises(ConfigError, match="does not hold"):
        open_records(manifest, data=cfg.data, confine=outside)


def test_media_paths_outside_the_data_set_are_rejected_unread(tree, opened):  # noqa: F811
    data, outside = tree
    records = inside_records(data) + outside_records(outside)
    records.append(
        {
            "id": "missing_marker",
            "text": "<image> e",
            "images": [{"missing": str(outside / "private.png")}],
        }
    )
    manifest = write_manifest(data / "m.jsonl", records)
    opened.clear()
    summary, rejects = index(manifest)
    assert summary["accepted"] == 4, rejects
    for rid in OUTSIDE_ENTRIES:
        assert rejects[rid]["reason"] == "path_outside_root", rid
    assert rejects["missing_marker"]["reason"] == "missing_media"  # never taken as a path
    # Nothing outside was opened (their paths are resolved, never read), nor named in output.
    assert not [p for p in opened if outside_the_data(p, outside)]
    out = [p for p in Path(f"{manifest}.index").rglob("*") if p.is_file()]  # (scan.npz too)
    written = "".join(p.read_bytes().decode("latin-1") for p in out)
    for secret in (str(outside), "private.png", "secret.wav", "/etc/passwd", "/proc/self"):
        assert secret not in written, secret
    # The loader reads only what the index accepted; a manifest edited after indexing to lead
    # out is refused at load time for the same reason (parsing resolves every path anew).
    cfg = config(manifest, f"data.index_dir={manifest}.index")
    source = open_source(cfg)
    assert all(source[i].loss.any() for i in range(len(source)))
    records[0]["images"] = ["../outside/private.png"]
    write_manifest(manifest, records)
    source.records = open_records(manifest, data=cfg.data)  # (its lines read again)
    with pytest.raises(RecordError, match="path_outside_root"):
        source[0]


def test_media_root_and_the_explicit_opt_out(tree):
    data, outside = tree
    images = data.parent / "images"  # LLaVA's layout: an image folder away from the manifest
    images.mkdir()
    png(images / "cat.png")
    records = [
        {"id": "in_root", "text": "<image> a cat", "images": ["cat.png"]},
        {"id": "beside_manifest", "text": "<image> x", "images": ["../data/img/ok.png"]},
    ]
    manifest = write_manifest(data / "llava.jsonl", records)
    summary, rejects = index(manifest, f"data.media_root={images}")
    assert summary["accepted"] == 1 and rejects["beside_manifest"]["reason"] == "path_outside_root"
    # Absolute paths kept on purpose: allowed anywhere, still regular files within the caps.
    manifest = write_manifest(data / "anywhere.jsonl", outside_records(outside))
    summary, rejects = index(manifest, "data.allow_outside_paths=true")
    assert set(rejects) == {"environ", "etc_passwd"}  # (not images: undecodable, not outside)
    assert {r["reason"] for r in rejects.values()} == {"undecodable_media"}


def test_the_arrayrecord_converter_embeds_nothing_from_outside(tree, opened):  # noqa: F811
    data, outside = tree
    secret = b"TOP-SECRET-" + os.urandom(8).hex().encode()
    (outside / "private.png").write_bytes(png(data / "tmp.png").read_bytes() + secret)
    (data / "tmp.png").unlink()
    sparse = data / "huge.png"  # 20 GB of holes: read whole, it was a MemoryError traceback
    with open(sparse, "wb") as f:
        f.truncate(20 << 30)
    os.mkfifo(data / "fifo.png")
    records = inside_records(data) + outside_records(outside)
    records += [
        {"id": "sparse", "text": "<image> s", "images": ["huge.png"]},
        {"id": "fifo", "text": "<image> f", "images": ["fifo.png"]},
        {"id": "shadow", "text": "<image> s", "images": ["/etc/shadow"]},
    ]
    manifest = write_manifest(data / "m.jsonl", records)
    out = data / "m.array_record"
    opened.clear()
    start = time.monotonic()
    assert convert(manifest, out) == len(records)
    assert time.monotonic() - start < BACKSTOP_S
    blob = out.read_bytes()
    for leaked in (
        secret,
        b"root:x:0:0",
        str(outside).encode(),
        b"private",
        b"passwd",
        os.environ["PATH"].encode(),
    ):  # (PATH: in /proc/self/environ)
        assert leaked not in blob, leaked
    refused = {sparse, data / "fifo.png", outside / "private.png", Path("/etc/passwd")}
    assert not refused & {p.resolve() for p in opened}
    summary, rejects = index(out)
    assert summary["accepted"] == 4
    for rid in OUTSIDE_ENTRIES:
        assert rejects[rid]["reason"] == "path_outside_root", rid
    assert rejects["sparse"]["reason"] == "media_too_large"
    assert rejects["fifo"]["reason"] == "undecodable_media"
    # The same reasons as the JSONL manifest's own index.
    _, direct = index(manifest)
    assert {k: v["reason"] for k, v in direct.items()} == {
        k: v["reason"] for k, v in rejects.items()
    }


def test_files_and_lines_over_the_byte_cap_are_not_read(tmp_path, opened):  # noqa: F811
    big = tmp_path / "big.png"  # noise: ~11 KB, over a 3000-byte cap
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 60, 3), np.uint8)).save(big)
    png(tmp_path / "small.png", 8, 8)
    inline = {"base64": __import__("base64").b64encode(big.read_bytes()).decode()}
    records = [
        {"id": "big", "text": "<image> b", "images": ["big.png"]},
        {"id": "inline", "text": "<image> i", "images": [inline]},
        {"id": "small", "text": "<image> s", "images": ["small.png"]},
        {"id": "long", "text": "x" * 5000},
        {"id": "after", "text": "still read"},
    ]
    manifest = write_manifest(tmp_path / "m.jsonl", records)
    opened.clear()
    summary, rejects = index(manifest, "data.max_media_bytes=3000")
    assert summary["accepted"] == 2  # small, after
    assert rejects["big"]["reason"] == "media_too_large" and big not in opened
    assert rejects["m.jsonl:2"]["reason"] == "malformed_line"  # the inline line is over the cap
    assert "data.max_media_bytes=3000" in rejects["m.jsonl:4"]["detail"]
    assert rejects["m.jsonl:4"]["line"] == 4  # later lines keep their numbers
    with pytest.raises(ConfigError, match="max_media_bytes"):
        config(manifest, "data.max_media_bytes=0")


# ----------------------------------------------------------------------------- bounded work


def flac_with_header(tmp_path: Path, name: str, rate: int, frames: int) -> Path:
    """A small FLAC whose STREAMINFO claims `rate` Hz and `frames` samples (1.4 MB in the
    issue: silence compresses; here a few KB, the header is what is read)."""
    buf = io.BytesIO()
    sf.write(buf, np.zeros(4000, np.float32), 16000, format="FLAC")
    b = bytearray(buf.getvalue())
    # STREAMINFO after "fLaC" + 4-byte block header: 20-bit rate, 3 bits channels-1, 5 bits
    # bits-1, 36 bits total samples, starting at byte 18.
    bits = int.from_bytes(b[18:26], "big")
    keep = bits >> 36 & 0xFF  # channels and bits per sample
    bits = rate << 44 | keep << 36 | frames
    b[18:26] = bits.to_bytes(8, "big")
    path = tmp_path / name
    path.write_bytes(bytes(b))
    return path


def test_audio_cost_is_bounded_before_decoding(tmp_path):
    hi_rate = flac_with_header(tmp_path, "hirate.flac", 655_350, 590 * 655_350)
    assert read_info(hi_rate, caps=Caps(samples=1 << 40)) == (590 * 655_350, 655_350)
    with pytest.raises(RecordError, match=r"audio_too_long.*max_audio_samples"):
        read_info(hi_rate)  # 590 s < 600 s, 655 kHz < the rate cap: 386 M samples is not
    many = io.BytesIO()  # 2 s of 400 channels: 12.8 M samples of work, a short clip
    sf.write(many, np.zeros((32000, 400), np.int16), 16000, format="WAV", subtype="PCM_16")
    (tmp_path / "many.wav").write_bytes(many.getvalue())
    records = [
        {"id": "hirate", "text": "<audio> x", "audio": ["hirate.flac"]},
        {"id": "channels", "text": "<audio> x", "audio": ["many.wav"]},
        {"id": "long", "text": "<audio> x", "audio": ["long.flac"]},
        {"id": "ok", "text": "<audio> x", "audio": ["ok.wav"]},
    ]
    flac_with_header(tmp_path, "long.flac", 16000, 3600 * 16000)
    wav(tmp_path / "ok.wav", 1.0, 48000, channels=2)
    manifest = write_manifest(tmp_path / "m.jsonl", records)
    summary, rejects = index(manifest, "data.max_audio_samples=10000000")
    assert summary["accepted"] == 1
    assert rejects["hirate"]["reason"] == rejects["channels"]["reason"] == "audio_too_long"
    assert "max_audio_samples" in rejects["channels"]["detail"]
    assert "max_audio_seconds" in rejects["long"]["detail"]


def reference_resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """The whole-clip resampling decoding used before it went block by block."""
    if target < rate:
        cutoff = 0.5 * target / rate
        t = np.arange(-31, 32)
        taps = 2 * cutoff * np.sinc(2 * cutoff * t) * np.hamming(len(t))
        x = np.convolve(x, taps / taps.sum(), mode="same")
    pos = np.arange(resampled_length(len(x), rate, target)) * (rate / target)
    return np.interp(pos, np.arange(len(x)), x).astype(np.float32)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 96000])
def test_block_resampling_is_the_whole_clip_resampling_to_the_bit(rate):
    x = np.random.default_rng(rate).standard_normal(3 * rate + 17).astype(np.float32)
    want = reference_resample(x, rate, 16000)
    for block in (1, 333, 4096, 1 << 18):
        r = Resampler(rate, 16000)
        for a in range(0, len(x), block):
            r.feed(x[a : a + block])
        np.testing.assert_array_equal(r.finish(len(x)), want)
    short = Resampler(rate, 16000)  # a clip that decodes short of its header: zeros pad it
    short.feed(x[:-100])
    padded = reference_resample(np.pad(x[:-100], (0, 100)), rate, 16000)
    np.testing.assert_array_equal(short.finish(len(x)), padded)


def test_decoding_memory_follows_the_target_rate_not_the_file(tmp_path):
    """The same 20 s decoded from 16 kHz and from 192 kHz stereo (24x the samples) peaks at
    about the same memory: the source rate's samples are held a block at a time."""
    peaks = {}
    for rate, channels in ((16000, 1), (192000, 2)):
        path = wav(tmp_path / f"{rate}.wav", 20.0, rate, channels)
        tracemalloc.start()
        load_audio(path, 16000, 16, 4, 3000)
        peaks[rate] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    source_bytes = 20 * 192000 * 2 * 4  # the 192 kHz clip as float32: 30 MB
    assert peaks[192000] < peaks[16000] + source_bytes / 4, peaks


def test_an_exception_on_one_record_is_its_reject(tmp_path, monkeypatch):
    from jaxmllm.data.media import kinds

    png(tmp_path / "a.png")
    png(tmp_path / "boom.png")
    records = [{"id": f"r{k}", "text": "<image> x", "images": ["a.png"]} for k in range(3)]
    records.insert(1, {"id": "boom", "text": "<image> x", "images": ["boom.png"]})
    manifest = write_manifest(tmp_path / "m.jsonl", records)
    real = kinds.read_size

    def read_size(src, *args, **kwargs):
        if Path(src).name == "boom.png":
            raise MemoryError("out of memory while reading the header")
        return real(src, *args, **kwargs)

    monkeypatch.setattr(kinds, "read_size", read_size)
    summary, rejects = index(manifest)  # (in-process: the patch applies)
    assert summary["accepted"] == 3 and rejects["boom"]["reason"] == "record_failed"
    assert "MemoryError" in rejects["boom"]["detail"]
    monkeypatch.setattr(kinds, "read_size", real)
    # At load time: the loader counts it, names the record, and loads the others.
    cfg = config(
        manifest, f"data.index_dir={manifest}.index", f"train.output_dir={tmp_path / 'run'}"
    )
    source = open_source(cfg)
    real_load = kinds.load_image

    def load_image(src, *args, **kwargs):
        if "r2" in args:  # (the record id)
            raise MemoryError("out of memory while decoding")
        return real_load(src, *args, **kwargs)

    monkeypatch.setattr(kinds, "load_image", load_image)
    got = Loader(cfg, source).load(np.arange(3), step=0)  # rows: r0, r1, r2 (boom: rejected)
    assert [s is None for s in got.values()] == [False, False, True]
    logged = read_rejects(tmp_path / "run" / "rejects.jsonl")
    assert [(r["id"], r["reason"]) for r in logged] == [("r2", "record_failed")]
    with pytest.raises(DataError, match=r"record 'r2': record_failed.*MemoryError"):
        Loader(replace(cfg, data=replace(cfg.data, on_error="fail")), source).load(
            np.arange(3), step=0
        )


@pytest.mark.parametrize("policy", ["shrink", "truncate", "skip", "fail"])
def test_over_long_text_goes_through_the_oversize_policy(tmp_path, policy):
    records = [{"id": f"t{k}", "text": "hello world " * 5} for k in range(20)]
    records.append({"id": "huge", "text": "x" * 10_000_000})  # 10 MB of text
    manifest = write_manifest(tmp_path / "m.jsonl", records)
    summary, _ = index(manifest)
    assert summary["accepted"] == 21
    cfg = config(manifest, f"data.index_dir={manifest}.index", f"data.on_oversize={policy}")
    if policy == "fail":
        with pytest.raises(DataError, match=r"record 'huge': oversize.*data\.on_oversize"):
            open_source(cfg)
        return
    source = open_source(cfg)
    action = {"shrink": "shrink", "truncate": "truncate", "skip": "skip"}[policy]
    assert [(r["id"], r["action"]) for r in source.startup_rejects] == [("huge", action)]
    assert len(source) == (20 if policy == "skip" else 21)


def test_the_capacity_ladder_has_no_end_to_fall_off():
    from jaxmllm.resolve.capacity import ladder_nearest, ladder_up

    for x in (5_000_000, 3 << 22, 10**9):  # past 2^22, where it raised IndexError
        assert ladder_up(x) >= x and ladder_up(x) % 32 == 0
        assert ladder_nearest(x) > 0
    assert ladder_up(4096) == 4096  # (below 2^22, unchanged)


HOSTILE_TEMPLATES = {
    "nested_loops": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}"
    "{% endfor %}{{ messages[0].content }}",
    "huge_multiply": "{{ 'x' * 3000000000 }}",
    "list_multiply": "{{ messages * 1000000000 }}",
    "power": "{{ 10 ** 1000000000 }}",
    "center_filter": "{{ 'x'|center(3000000000) }}",
    "format_width": "{{ '%999999999s' % 'x' }}",
    "str_format_width": "{{ '{:>999999999}'.format('x') }}",
    "doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s"
    " %}{% endfor %}{{ ns.s }}",
    "join_bomb": "{{ range(100000)|join('y' * 100000) }}",
    "recursion": "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('x') }}",
    "output_flood": "{% for a in range(100000) %}{% for b in range(1000) %}yy{% endfor %}"
    "{% endfor %}",
    "deep_nesting": "{% if 1 %}" * 3000 + "{% endif %}" * 3000,
}


def test_hostile_chat_templates_end_as_template_errors(tmp_path, monkeypatch):
    from test_chat import CHAT, build_dir

    from jaxmllm.data.records.record import parse_record
    from jaxmllm.data.text import chat_template
    from jaxmllm.data.text.tokenizer import make_tokenizer

    # (the limit a render is stopped at: the nested loops reach it three times, 2 s each at
    # the default; the watchdog's path is the same at any limit)
    monkeypatch.setattr(chat_template, "SECONDS", 0.5)

    records = [{"id": f"c{k}", "messages": CHAT} for k in range(2)]
    manifest = write_manifest(tmp_path / "m.jsonl", records)
    prompt = parse_record({"id": "prompt", "messages": CHAT[:3]}, tmp_path, 0)
    for name, template in HOSTILE_TEMPLATES.items():
        directory = build_dir(tmp_path / name, "qwen", None, chat_template=template)
        if name == "deep_nesting":  # refused where the directory is opened: a config error
            with pytest.raises(ConfigError, match=f"{name}.*does not compile"):
                make_tokenizer(str(directory))
            continue
        tk = make_tokenizer(str(directory))
        start = time.monotonic()
        summary, rejects = index(
            manifest, f"data.tokenizer={directory}", f"model.llm.vocab_size={tk.vocab_size}"
        )
        assert time.monotonic() - start < BACKSTOP_S, name
        assert summary["accepted"] == 0, name
        assert {r["reason"] for r in rejects.values()} == {"template_error"}, name
        assert str(directory) in rejects["c0"]["detail"], name
        with pytest.raises(RecordError, match="template_error"):  # generation's prompt too
            tk.pieces(prompt, generation=True)
