"""Data as people have it: every data.format read into the same samples, `auto`'s detection,
paths as files, folders and globs, the index's console summary and exit codes, keyed index
folders, and records the model has no encoder for."""

import io
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest

from jaxmllm.bench.formats import FORMATS, make_records, write_formats, write_parquet
from jaxmllm.config import ConfigError, load_config
from jaxmllm.data.index import build_index, main
from jaxmllm.data.records import open_records, read_record
from jaxmllm.data.records.formats import FORMATS as READ_FORMATS
from jaxmllm.data.records.webdataset import split_key
from jaxmllm.data.rejects import RecordError, read_rejects
from jaxmllm.data.source import open_source

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

SMALL = ["data.image_min_pixels=256", "data.image_max_pixels=1024", "data.audio_max_frames=32"]
SETTINGS = ["data.source=files", "data.eval.source=none", *SMALL]  # (tiny.yaml: synthetic)


def config(path, *extra, base="configs/tiny.yaml"):
    return load_config(base, [*SETTINGS, f"data.path={path}", *extra])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The same 12 records (captions of one and two images, a clip, text) in every format."""
    root = tmp_path_factory.mktemp("formats")
    records = make_records(root, 12)
    return {"root": root, "records": records, "paths": write_formats(root, records)}


def samples_of(cfg) -> list:
    src = open_source(cfg)
    return [src[i] for i in range(len(src))], src


def assert_same(a, b, what):
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.loss, b.loss), what
    for phase in a.media:
        assert len(a.media[phase]) == len(b.media[phase]), what
        for (x, px), (y, py) in zip(a.media[phase], b.media[phase], strict=True):
            assert np.array_equal(x, y) and np.array_equal(px, py), what


def test_every_format_gives_the_same_ids_and_pixels(data):
    """A record in any format becomes the same sample: token ids, loss mask, pixels, frames."""
    assert set(FORMATS) | {"sharegpt"} >= set(READ_FORMATS)
    ref = None
    for fmt, path in data["paths"].items():
        cfg = config(path)
        summary = build_index(cfg, progress=False)
        assert summary["format"] == (fmt if fmt != "sharegpt" else "llava"), summary["detected"]
        assert summary["accepted"] == 12 and not summary["rejects"], fmt
        samples, src = samples_of(cfg)
        if ref is None:
            ref = samples
            assert sum(len(s.media["vision"]) for s in ref) == 9 and any(
                s.media["audio"] for s in ref
            )
        for k, (a, b) in enumerate(zip(ref, samples, strict=True)):
            assert_same(a, b, f"{fmt} record {k}")
        want = [f"r{k}" for k in range(12)] if fmt != "sharegpt" else None
        assert want is None or [src.record_id(i) for i in range(12)] == want
    # Explicitly named formats read the same as detected ones.
    cfg = config(data["paths"]["sharegpt"], "data.format=sharegpt")
    assert build_index(cfg, progress=False)["accepted"] == 12


def test_auto_says_what_it_detected_and_why(data):
    why = {}
    for fmt, path in data["paths"].items():
        why[fmt] = open_records(path).why
    assert "a JSON list" in why["llava"] and "'conversations'" in why["llava"]
    assert "JSON lines" in why["sharegpt"] and "JSON lines of jaxmllm records" in why["jsonl"]
    assert "2 files ending in .parquet" == why["parquet"] and ".tar" in why["webdataset"]


def test_conversations_and_messages_as_other_tools_write_them(tmp_path):
    """LLaVA's placeholders (or none: media first), ShareGPT's system prompt and roles, an id
    from the record's place, OpenAI's image_url / input_audio parts, struct parts with Nones."""
    (tmp_path / "x.png").write_bytes(b"")
    rows = [
        {
            "id": 7,
            "image": "x.png",
            "conversations": [
                {"from": "human", "value": "What is it?"},
                {"from": "gpt", "value": "a cat"},
            ],
        },
        {
            "system": "be brief",
            "images": ["x.png", "x.png"],
            "conversations": [
                {"from": "human", "value": "<image> and <image>?"},
                {"from": "gpt", "value": "two"},
            ],
        },
        {"conversations": [{"from": "observation", "value": "?"}]},
    ]
    path = tmp_path / "l.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = open_records(path, "llava")
    a, b = read_record(records, 0), read_record(records, 1)
    assert a.id == "7" and a.turns == [("user", "<image>What is it?"), ("assistant", "a cat")]
    assert b.id == "l.jsonl:2" and b.turns[0] == ("system", "be brief") and len(b.media["vision"])
    with pytest.raises(RecordError, match="observation"):
        read_record(records, 2)
    rows = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "x.png"}},
                        {"type": "text", "text": "hi", "image_url": None},
                    ],
                },
                {"role": "assistant", "content": [{"type": "text", "text": "yo"}]},
            ]
        },
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "text": None}, {"type": "text", "text": "hi"}],
                },
                {"role": "assistant", "content": "yo"},
            ],
            "images": [{"bytes": b"\x89", "path": "a.png"}],
        },
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "input_audio",
                            "input_audio": {"data": "UklGRg==", "format": "wav"},
                        }
                    ],
                },
                {"role": "assistant", "content": "a beep"},
            ]
        },
        {"text": "a caption", "image": "https://example.com/a.png"},
    ]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r, default=lambda b: "") + "\n" for r in rows))
    records = open_records(path, "messages")
    a = read_record(records, 0)
    assert a.turns[0] == ("user", "<image>hi") and a.media["vision"] == [tmp_path / "x.png"]
    assert read_record(records, 2).media["audio"] == [b"RIFF"]
    with pytest.raises(RecordError, match="URL") as e:
        read_record(records, 3)
    assert e.value.reason == "missing_media"


def test_parquet_as_hf_datasets_writes_it(data, tmp_path, monkeypatch):
    """The oracle for "as datasets writes it" is datasets itself: Image columns (embedded bytes
    or a path), a messages column whose content parts carry every part's keys."""
    datasets = pytest.importorskip("datasets")
    from datasets import Dataset, Features, List, Value
    from datasets import Image as HFImage

    root, records = data["root"], [r for r in data["records"] if "audio" not in r]
    parts = []
    for r in records:
        user, answer = r["messages"][0]["content"], r["messages"][1]["content"]
        n = user.count("<image>")
        parts.append(
            [
                {
                    "role": "user",
                    "content": [{"type": "image", "text": None}] * n
                    + [{"type": "text", "text": user.replace("<image>", "")}],
                },
                {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            ]
        )
    images = [
        [{"bytes": (root / f).read_bytes(), "path": Path(f).name} for f in r.get("images", [])]
        for r in records
    ]
    features = Features(
        {
            "id": Value("string"),
            "images": List(HFImage()),
            "messages": List(
                {
                    "role": Value("string"),
                    "content": List({"type": Value("string"), "text": Value("string")}),
                }
            ),
        }
    )
    ds = Dataset.from_dict(
        {"id": [r["id"] for r in records], "images": images, "messages": parts}, features=features
    )
    ds.to_parquet(str(tmp_path / "train.parquet"))
    # ... and with image paths (relative to data.media_root), as a local dataset keeps them
    paths = [[{"bytes": None, "path": f} for f in r.get("images", [])] for r in records]
    with monkeypatch.context() as m:  # (datasets sizes a path's file from the working folder)
        m.chdir(root)
        ds = Dataset.from_dict(
            {"id": [r["id"] for r in records], "images": paths, "messages": parts},
            features=features,
        )
        ds.to_parquet(str(tmp_path / "paths" / "train.parquet"))
    assert datasets.__version__
    want, _ = samples_of(config(data["paths"]["jsonl"]))
    want = [s for s, r in zip(want, data["records"], strict=True) if "audio" not in r]
    cases = [(tmp_path / "train.parquet", []), (tmp_path / "paths", [f"data.media_root={root}"])]
    for path, extra in cases:
        cfg = config(path, *extra)
        summary = build_index(cfg, progress=False)
        assert summary["format"] == "parquet" and summary["accepted"] == len(records)
        got, _ = samples_of(cfg)
        for k, (a, b) in enumerate(zip(want, got, strict=True)):
            assert_same(a, b, f"{path} row {k}")


def test_parquet_reads_a_row_group_at_a_time(data, tmp_path):
    path = tmp_path / "p"
    write_parquet(path, data["records"], data["root"], shards=1)
    records = open_records(path)
    reader = records.reader(0)
    assert len(records) == 12 and reader.starts.tolist() == [0, 12]
    assert records.raw(11)[0]["id"] == "r11" and list(reader._groups) == [0]


def test_webdataset_members_by_key_read_at_their_offsets(data, tmp_path):
    """Members grouped by key (the name up to its first dot), media by extension, a caption
    from .txt, the json's id or the key; others left out and counted; nothing extracted."""
    assert split_key("a/b/00012.left.JPG") == ("a/b/00012", "left.jpg")
    png = (data["root"] / data["records"][0]["images"][0]).read_bytes()
    path = tmp_path / "s.tar"
    with tarfile.open(path, "w") as tar:
        for name, body in (
            ("k1.png", png),
            ("k1.txt", b"a red box"),
            ("k1.cls", b"3"),
            ("k2.jpg.png", png),
            (
                "k2.json",
                b'{"id": "two", "conversations": '
                b'[{"from": "human", "value": "<image>?"}, {"from": "gpt", '
                b'"value": "x"}]}',
            ),
            (".hidden", b""),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    before = sorted(tmp_path.iterdir())
    records = open_records(path)
    assert records.format == "webdataset" and len(records) == 2
    assert records.ignored() == {"cls": 1}
    a, b = read_record(records, 0), read_record(records, 1)
    assert a.id == "k1" and a.turns == [("text", "<image>a red box")] and a.media["vision"] == [png]
    assert b.id == "two" and b.media["vision"] == [png]
    assert sorted(tmp_path.iterdir()) == before  # (read by seek: no member written out)
    again = open_records(path, scan=records.scan())  # the index's saved offsets
    assert read_record(again, 1) == b


def test_path_a_folder_or_a_glob(data, tmp_path):
    lines = data["paths"]["jsonl"].read_text().splitlines()
    (tmp_path / "d").mkdir()
    for k in range(3):
        (tmp_path / "d" / f"part-{k}.jsonl").write_text("\n".join(lines[4 * k : 4 * k + 4]))
    for path in (tmp_path / "d", tmp_path / "d" / "part-*.jsonl"):
        records = open_records(path, media_root=data["root"])
        assert len(records) == 12 and read_record(records, 5).id == "r5", path
    with pytest.raises(FileNotFoundError, match="no data file matches"):
        open_records(tmp_path / "d" / "*.parquet")
    (tmp_path / "d" / "x.parquet").write_bytes(b"")
    with pytest.raises(ConfigError, match="several formats"):
        open_records(tmp_path / "d")


def run_index(capsys, cfg, *sets) -> tuple[int, str, str]:
    argv = ["--config", str(cfg), "--workers", "0"]
    for item in sets:
        argv += ["--set", item]
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_index_tells_the_truth(data, tmp_path, capsys):
    """A LLaVA JSON list read as JSON lines rejects every record: exit 1 naming the reason and
    the format to use; read as detected: exit 0, rejects by reason with an example each."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(Path("configs/tiny.yaml").read_text())
    llava = [f"data.path={data['paths']['llava']}", *SETTINGS]
    code, out, err = run_index(capsys, cfg, *llava)
    assert code == 0 and "llava (auto: llava.json: a JSON list" in out and "12 accepted" in out
    code, out, err = run_index(capsys, cfg, *llava, "data.format=jsonl")
    assert code == 1 and re.search(r"accepted 0 of \d+ records", err), err
    assert "malformed_line" in err and "set data.format: llava" in err
    # Some records broken: the summary lists each reason with one example.
    broken = data["records"][:6] + [
        {**r, "images": ["media/gone.png"]} for r in data["records"][6:] if r.get("images")
    ]
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps({**r, "id": f"b{k}"}) + "\n" for k, r in enumerate(broken)))
    base = [f"data.path={path}", f"data.media_root={data['root']}", *SETTINGS]
    code, out, err = run_index(capsys, cfg, *base)
    assert code == 0 and "missing_media" in out and "b6 (b.jsonl line 7)" in out, out
    code, out, err = run_index(capsys, cfg, *base, "data.min_accept=0.9")
    assert code == 1 and "less than data.min_accept=0.9" in err and "missing_media" in err
    # Training refuses that index too, with the real command that rebuilds it.
    with pytest.raises(
        ConfigError, match=r"min_accept(.|\n)*python -m jaxmllm.data.index --config"
    ):
        open_source(load_config(cfg, [*base, "data.min_accept=0.9"]))
    code, out, err = run_index(capsys, cfg, "data.path=/nope.json", *SETTINGS)
    assert code == 2 and "no such data file" in err


def test_index_folder_is_keyed_by_what_decides_it(data, tmp_path):
    """Two configs over one data set keep two indexes; a rebuild hint is the real command."""
    path = data["paths"]["jsonl"]
    a, b = config(path), config(path, "data.image_max_pixels=4096")
    ia, ib = build_index(a, progress=False)["index"], build_index(b, progress=False)["index"]
    assert ia != ib and Path(ia).parent == Path(ib).parent == Path(f"{path}.index")
    assert len(open_source(a)) == len(open_source(b)) == 12  # neither overwrote the other
    yaml = tmp_path / "x.yaml"
    yaml.write_text(Path("configs/tiny.yaml").read_text())
    fresh = load_config(yaml, [*SETTINGS, f"data.path={path}", "data.image_max_pixels=2048"])
    with pytest.raises(ConfigError) as e:
        open_source(fresh)
    rebuild = f"python -m jaxmllm.data.index --config {yaml} --set data.source=files --set"
    assert rebuild in str(e.value)
    assert "<this config>" not in str(e.value)


def test_items_the_model_cannot_encode_are_refused_naming_the_encoder(data):
    cfg = config(data["paths"]["jsonl"], "model.audio.enabled=false")
    summary = build_index(cfg, progress=False)
    assert summary["rejects"] == {"no_encoder": 3}
    rejects = read_rejects(Path(summary["index"]) / "rejects.jsonl")
    assert all("model.audio.enabled" in r["detail"] for r in rejects)


def test_a_mixture_stream_draws_by_weight_deterministically():
    from jaxmllm.data.lengths import Mixture
    from jaxmllm.plan.stream import MixtureStream

    mix = Mixture.of(["a", "b", "c"], [100, 10, 1000], [2.0, 1.0, 1.0])
    assert mix.draws == (555, 278, 277) and sum(mix.draws) == 1110
    got = MixtureStream(mix, 0).take(0, 3 * 1110)
    assert np.array_equal(got, MixtureStream(mix, 0).take(0, 3 * 1110))
    assert not np.array_equal(got, MixtureStream(mix, 1).take(0, 3 * 1110))
    for r in range(3):  # every round draws each source its share exactly
        assert mix.counts(got[r * 1110 : (r + 1) * 1110]) == {"a": 555, "b": 278, "c": 277}
    small = np.bincount(got[(got >= 100) & (got < 110)] - 100, minlength=10)
    assert small.max() - small.min() <= 1  # a source goes through its epochs in turn
    assert np.array_equal(MixtureStream(mix, 0).take(1234, 500), got[1234:1734])
    with pytest.raises(ValueError, match="'b' is drawn 0 times"):
        Mixture.of(["a", "b"], [1000, 10], [1.0, 1e-6])
    assert Mixture.of(["a", "b"], [30, 10], [0, 0]).draws == (30, 10)  # all 0: by size


def test_a_mixture_plans_one_index_and_its_state_restores_exactly(data, tmp_path):
    """Three formats as data.sources: one lengths index, samples from every source in a step's
    plan, per-source counts in the step's info, and a restored pipeline's next steps equal."""
    from jaxmllm.feed.iterator import make_pipeline
    from jaxmllm.resolve.run import resolve_run

    p = data["paths"]
    sources = (
        f"data.sources=[{{path: {p['llava']}, weight: 2}}, {{path: {p['parquet']}, weight: 1}}, "
        f"{{path: {p['webdataset']}, weight: 1, name: tars}}]"
    )
    cfg = load_config("configs/tiny.yaml", [*SETTINGS, sources, f"train.output_dir={tmp_path}"])
    for path in (p["llava"], p["parquet"], p["webdataset"]):
        build_index(cfg, path, progress=False)
    src = open_source(cfg)
    assert len(src) == 36 and src.index.mixture.names == ("llava", "parquet", "tars")
    assert src.index.mixture.draws == (18, 9, 9)
    assert_same(src[12], src[0], "the same record from two sources")
    assert src.record_id(30) == "r6"
    run = resolve_run(cfg, 8)
    it = make_pipeline(run, prefetch=0)
    infos = [next(it)["info"] for _ in range(2)]
    assert all(sum(i.sources.values()) == len(i.samples) for i in infos)
    state = it.get_state()
    want = [next(it) for _ in range(2)]
    again = make_pipeline(run, prefetch=0)
    again.set_state(state)
    for a, b in zip(want, [next(again) for _ in range(2)], strict=True):
        assert np.array_equal(a["info"].samples, b["info"].samples)
        assert a["info"].sources == b["info"].sources
        for key in a["batch"]:
            assert np.array_equal(a["batch"][key], b["batch"][key]), key


def test_a_json_list_with_a_bom_and_unicode_and_one_that_breaks_off(tmp_path):
    recs = [{"id": "é1", "text": "ünïcode"}, {"id": "2", "text": "plain"}]
    path = tmp_path / "a.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(recs, ensure_ascii=False, indent=2).encode())
    records = open_records(path)
    assert records.format == "messages" and records.where(1) == "a.json line 6"
    assert [read_record(records, k).turns for k in range(2)] == [
        [("text", "ünïcode")],
        [("text", "plain")],
    ]
    path.write_text(json.dumps(recs)[:-12])
    with pytest.raises(ConfigError, match=r"a.json: not valid JSON at line 1 column \d+"):
        open_records(path, "messages")


@pytest.mark.parametrize("recipe", ["stage1", "stage2"])
def test_the_llava_recipes_read_llavas_folders_as_downloaded(recipe, tmp_path, monkeypatch):
    """configs/recipes/ name LLaVA's files and image folders as they are downloaded: a JSON list
    beside an image folder (stage 1: LLaVA-Pretrain's numbered subfolders; stage 2: the mix's
    coco/ and gqa/ images and text-only conversations), detected as llava, all accepted."""
    from jaxmllm.bench.data import write_image

    recipe_path = Path(f"configs/recipes/{recipe}.yaml").resolve()
    monkeypatch.chdir(tmp_path)
    cfg = load_config(recipe_path, SETTINGS)
    data_file, media_root = Path(cfg.data.path), Path(cfg.data.media_root)
    rng = np.random.default_rng(0)
    rows = []
    folders = {
        "stage1": ["00453", "00453", "00517"],
        "stage2": ["coco/train2017", "gqa/images", ""],
    }
    for k, folder in enumerate(folders[recipe]):
        turns = [{"from": "human", "value": "What is this?"}, {"from": "gpt", "value": "a box"}]
        row = {"id": f"{k:09d}", "conversations": turns}
        if folder:  # stage 2's mix also has conversations without an image
            row["image"] = f"{folder}/{k:09d}.jpg"
            (media_root / folder).mkdir(parents=True, exist_ok=True)
            write_image(media_root / row["image"], rng, "red", "JPEG")
            turns[0]["value"] = "<image>\n" + turns[0]["value"]
        rows.append(row)
    data_file.parent.mkdir(parents=True, exist_ok=True)
    data_file.write_text(json.dumps(rows, indent=2))
    summary = build_index(cfg, progress=False)
    assert summary["format"] == "llava" and summary["accepted"] == 3, summary
    images = sum(len(s.media["vision"]) for s in samples_of(cfg)[0])
    assert images == len([f for f in folders[recipe] if f])


def _reasons(records) -> dict[str, str]:
    """Each record's outcome: its kinds of media with their counts, or its reject reason."""
    out = {}
    for k in range(len(records)):
        try:
            r = read_record(records, k)
        except RecordError as e:
            out[e.record_id] = e.reason
            continue
        out[r.id] = ",".join(f"{kind}:{len(v)}" for kind, v in r.media.items() if v)
    return out


def test_every_reader_confines_media_caps_sizes_and_carries_videos(tmp_path):
    """Issue 30 and 31 in every format: media paths lead only inside data.media_root (else the
    data file's folder), a .tar member or a JSON record over data.max_media_bytes is never
    read, and videos come as `videos` / `video` keys, `{"type": "video"}` parts, LLaVA-Video's
    `<image>`-marked `video` and `.mp4` members."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jaxmllm.config import DataConfig

    root = tmp_path / "root"
    (root / "img").mkdir(parents=True)
    (root / "img" / "a.png").write_bytes(b"png")
    (root / "v.mp4").write_bytes(b"mp4")
    (tmp_path / "secret.png").write_bytes(b"secret")
    chat = lambda text: [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}]
    llava = [
        {"id": "in", "image": "img/a.png", "conversations": chat("<image>\nwhat?")},
        {"id": "out", "image": "../secret.png", "conversations": chat("<image>\nwhat?")},
        {"id": "abs", "image": str(tmp_path / "secret.png"), "conversations": chat("x")},
        {"id": "vid", "video": "v.mp4", "conversations": chat("<image>\nwhat happens?")},
    ]
    (tmp_path / "llava.json").write_text(json.dumps(llava))
    data = DataConfig(media_root=str(root))
    got = _reasons(open_records(tmp_path / "llava.json", "llava", data.media_root, data=data))
    assert got == {
        "in": "vision:1",
        "out": "path_outside_root",
        "abs": "path_outside_root",
        "vid": "video:1",
    }
    anywhere = DataConfig(media_root=str(root), allow_outside_paths=True)
    opened = open_records(tmp_path / "llava.json", "llava", str(root), data=anywhere)
    assert _reasons(opened)["out"] == "vision:1"

    parts = [{"type": "video", "video": "v.mp4"}, {"type": "text", "text": "?"}]
    messages = [
        {
            "id": "m1",
            "messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "a"}],
        },
        {
            "id": "m2",
            "messages": [
                {"role": "user", "content": "<video>?"},
                {"role": "assistant", "content": "a"},
            ],
            "videos": ["../v.mp4"],
        },
        {
            "id": "m3",
            "messages": [
                {"role": "user", "content": "x" * 300},
                {"role": "assistant", "content": "a"},
            ],
        },
    ]
    path = root / "m.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in messages))
    got = _reasons(open_records(path, "messages", data=DataConfig(max_media_bytes=256)))
    assert got == {"m1": "video:1", "m2": "path_outside_root", "m.jsonl:3": "malformed_line"}

    image = lambda p: [{"bytes": None, "path": p}]  # (HF datasets' Image(): a path only)
    rows = [
        {"id": "p1", "text": "<image> a", "images": image("img/a.png")},
        {"id": "p2", "text": "<image> b", "images": image("../secret.png")},
    ]
    pq.write_table(pa.Table.from_pylist(rows), root / "p.parquet")
    got = _reasons(open_records(root / "p.parquet", "parquet"))
    assert got == {"p1": "vision:1", "p2": "path_outside_root"}

    shard = root / "s.tar"
    out = json.dumps({"text": "<image> c", "images": ["../secret.png"]}).encode()
    with tarfile.open(shard, "w") as tar:
        for name, blob in [
            ("k1.mp4", b"m" * 10),
            ("k1.txt", b"<video> a clip"),
            ("k2.jpg", b"j" * 300),
            ("k2.txt", b"too large"),
            ("k3.json", out),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    records = open_records(shard, "webdataset", data=DataConfig(max_media_bytes=256))
    assert _reasons(records) == {
        "k1": "video:1",
        "k2": "media_too_large",
        "k3": "path_outside_root",
    }
