"""Data files of issue 50's probe that lost records without a word, each built in tmp_path
and indexed: WebDataset shards written by extension, two JSON members in one sample, shards cut
inside a header, ids made of places that collide across files (two folders' `data.jsonl`,
shards whose keys restart at 000000). Each ends as counted rejects naming the record, or as
every record kept under an id of its own."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from test_hostile import index, png

from jaxmllm.data.records.webdataset import scan_tar

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

WDS = ("data.source=files", "data.format=webdataset")


def add(tar: tarfile.TarFile, name: str, body: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(body)
    tar.addfile(info, io.BytesIO(body))


def test_a_shard_written_by_extension_is_refused_by_key(tmp_path):
    """`tar cf b.tar *.jpg *.txt`: each key's image, then each key's caption. Its captions
    were trained as text-only records without their images (exit 0); each run of a key that
    comes back is now a reject naming the key."""
    image = png(tmp_path / "a.png").read_bytes()
    path = tmp_path / "by_ext.tar"
    with tarfile.open(path, "w") as tar:
        for k in range(5):
            add(tar, f"{k:06d}.png", image)
        for k in range(5):
            add(tar, f"{k:06d}.txt", f"<image> caption {k}".encode())
        add(tar, "whole.png", image)  # (a sample written whole after them: read)
        add(tar, "whole.txt", b"<image> a whole one")
    summary, rejects = index(path, *WDS)
    assert summary["accepted"] == 1 and summary["rejected"] == 10
    assert {r["reason"] for r in rejects.values()} == {"malformed_line"}
    detail = rejects["000003"]["detail"]
    assert "000003: its members are not one after another in the shard" in detail
    assert "tar --sort=name" in detail


def test_two_json_members_of_a_sample_are_refused_naming_both(tmp_path):
    """`k.json` and `k.meta.json`: the second replaced the first without a word."""
    path = tmp_path / "meta.tar"
    with tarfile.open(path, "w") as tar:
        add(tar, "k.json", json.dumps({"text": "the record"}).encode())
        add(tar, "k.meta.json", json.dumps({"source": "crawl", "text": "not it"}).encode())
        add(tar, "c.txt", b"a caption")
        add(tar, "c.caption", b"another caption")
        add(tar, "ok.json", json.dumps({"text": "fine"}).encode())
        add(tar, "ok.meta", b'{"kept": "out"}')  # (an extension nobody reads: counted)
    summary, rejects = index(path, *WDS)
    assert summary["accepted"] == 1 and set(rejects) == {"k", "c"}
    assert "k: two JSON members (the record), k.json and k.meta.json" in rejects["k"]["detail"]
    assert "c: two captions, c.txt and c.caption" in rejects["c"]["detail"]
    assert summary["ignored_members"] == {"meta": 1}


def test_a_shard_cut_inside_a_header_is_a_reject_naming_it(tmp_path):
    """A copy cut 200 bytes into a member's header (not a whole number of 512-byte blocks):
    tarfile ends there without a word, and the shard indexed without a warning."""
    whole = tmp_path / "whole.tar"
    with tarfile.open(whole, "w") as tar:
        for k in range(6):
            add(tar, f"{k:06d}.json", json.dumps({"text": f"record {k}"}).encode())
    raw = whole.read_bytes()
    fourth = raw.index(b"000003.json")  # (its header's first byte: the name field)
    cut = tmp_path / "cut.tar"
    cut.write_bytes(raw[: fourth + 200])
    summary, rejects = index(cut, *WDS)
    assert summary["accepted"] == 3 and summary["rejected"] == 1
    (reject,) = rejects.values()
    assert reject["reason"] == "malformed_line" and reject["where"].startswith("cut.tar sample")
    assert f"the shard ends at byte {fourth + 200}" in reject["detail"]
    assert f"from byte {fourth}" in reject["detail"]
    assert scan_tar(whole)[0]["cut"].tolist() == []  # (its end: zero blocks)
    junk = tmp_path / "junk.tar"  # (whole blocks, but not zeros: no header either)
    junk.write_bytes(raw[:fourth] + b"\x17" * 1024)
    assert index(junk, *WDS)[0]["rejected"] == 1


def test_ids_by_place_are_unique_across_files(tmp_path):
    """Records without an id are named by their place: `data.jsonl:1`, a shard's key. Two
    language folders each with a `data.jsonl` lost half the data as duplicate_id, and shards
    whose keys restart at 000000 kept a third; the place now starts with the file's path
    among the data set's files."""
    data = tmp_path / "chats"
    for lang in ("en", "fr"):
        (data / lang).mkdir(parents=True)
        lines = [
            {
                "conversations": [
                    {"from": "human", "value": f"{lang} {k}"},
                    {"from": "gpt", "value": "ok"},
                ]
            }
            for k in range(4)
        ]
        (data / lang / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary, rejects = index(data, "data.source=files", "data.format=llava")
    assert summary["accepted"] == 8 and not rejects
    ids = load_ids(Path(f"{data}.index"))
    assert ids[:2] == ["en/data.jsonl:1", "en/data.jsonl:2"] and "fr/data.jsonl:4" in ids
    shards = tmp_path / "shards"
    shards.mkdir()
    for s in range(3):
        with tarfile.open(shards / f"{s:03d}.tar", "w") as tar:
            for k in range(4):
                add(tar, f"{k:06d}.txt", f"shard {s} caption {k}".encode())
    summary, rejects = index(shards, *WDS)
    assert summary["accepted"] == 12 and not rejects
    assert "002.tar:000003" in load_ids(Path(f"{shards}.index"))
    one = tmp_path / "one.tar"  # (one shard: its keys, as they were)
    with tarfile.open(one, "w") as tar:
        add(tar, "000000.txt", b"alone")
    index(one, *WDS)
    assert load_ids(Path(f"{one}.index")) == ["000000"]


def load_ids(folder: Path) -> list[str]:
    from jaxmllm.data.columnar import open_strings

    table = json.loads((folder / "summary.json").read_text())["columns"]
    return open_strings(folder, "id", table).tolist()


def test_an_index_of_the_earlier_format_is_refused_naming_the_rebuild(tmp_path):
    """An index built before these rules (and before the WebDataset link/device/sparse
    checks) kept its old scan, where such members were left out without a word: its format
    names the rules it was built with, and training refuses another, naming the command."""
    import pytest
    from test_hostile import config

    from jaxmllm.config import ConfigError
    from jaxmllm.data.source import open_source

    path = tmp_path / "s.tar"
    with tarfile.open(path, "w") as tar:
        add(tar, "000000.txt", b"a caption")
    index(path, *WDS)
    summary_file = Path(f"{path}.index") / "summary.json"
    summary = json.loads(summary_file.read_text())
    summary["index_format"] = "jaxmllm-columnar-1"
    summary_file.write_text(json.dumps(summary))
    cfg = config(path, f"data.index_dir={path}.index", *WDS)
    with pytest.raises(ConfigError) as e:
        open_source(cfg)
    assert "index_format 'jaxmllm-columnar-1'" in str(e.value)
    assert "Rebuild it:\n  python -m jaxmllm.data.index" in str(e.value)


def within(seconds: float, fn):
    """fn()'s value, or a failure when it has not returned in `seconds` (a hang)."""
    import threading

    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"no answer in {seconds} s"
    return out[0]


def test_links_into_a_loop_or_a_sibling_are_walked_once(tmp_path, caplog):
    """Links to a parent in a data folder: the recursive glob walked the loop (no answer in
    60 s); a link to a sibling folder read its files twice, each record then the other's
    duplicate_id. Each folder is read once, by the first path reaching it; the log says."""
    import logging

    from jaxmllm.data.records.formats import data_files

    data = tmp_path / "data"
    for lang in ("en", "fr"):
        (data / lang).mkdir(parents=True)
        (data / lang / "data.jsonl").write_text(json.dumps({"id": lang, "text": "x"}) + "\n")
    (data / "en" / "loop").symlink_to("..")
    (data / "fr" / "up").symlink_to("../..")
    (data / "fr" / "back").symlink_to(data)
    (data / "zz_en_again").symlink_to(data / "en")
    (data / "en" / "same.jsonl").symlink_to(data / "en" / "data.jsonl")
    caplog.set_level(logging.WARNING, logger="jaxmllm")
    want = [data / "en" / "data.jsonl", data / "fr" / "data.jsonl"]
    assert within(20, lambda: data_files(f"{data}/**/*.jsonl")) == want
    assert within(20, lambda: data_files(data)) == want
    assert "lead back into folders already read" in caplog.text
    summary, rejects = index(data, "data.source=files", "data.format=jsonl")
    assert summary["accepted"] == 2 and not rejects
