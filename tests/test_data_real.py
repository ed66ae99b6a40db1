"""Real data: manifest and ArrayRecord sources, decoding, the index, the bad-input policy."""

import base64
import io
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from jaxmllm.bench.data import write_dataset
from jaxmllm.config import ConfigError, load_config
from jaxmllm.data.arrayrecord import convert
from jaxmllm.data.index import build_index
from jaxmllm.data.loader import Loader
from jaxmllm.data.media.audio import clip_frames
from jaxmllm.data.media.image import image_grid
from jaxmllm.data.rejects import DataError, read_rejects
from jaxmllm.data.source import open_source
from jaxmllm.data.text import tokenizer as tok
from jaxmllm.resolve.run import resolve_run

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

IMAGE, AUDIO = tok.RESERVED.media["vision"], tok.RESERVED.media["audio"]  # the placeholders

SETTINGS = [
    "data.source=jsonl",
    "data.eval.source=none",  # (tiny.yaml's is a held-out share of its synthetic data)
    "data.image_min_pixels=256",
    "data.image_max_pixels=1024",
    "data.audio_max_frames=32",
]


def config(path, *extra):
    return load_config("configs/tiny.yaml", [*SETTINGS, f"data.path={path}", *extra])


def save_image(path, arr, fmt, mode=None, **kw):
    img = Image.fromarray(arr)
    img = img.convert(mode) if mode else img
    img.save(path, format=fmt, **kw)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A manifest over many formats and modes, plus one bad record of each kind."""
    root = tmp_path_factory.mktemp("real")
    rng = np.random.default_rng(0)
    rgb = lambda h, w: rng.integers(0, 255, (h, w, 3)).astype(np.uint8)
    m = root / "m"
    m.mkdir()
    save_image(m / "a.png", rgb(30, 40), "PNG")
    save_image(m / "b.jpg", rgb(48, 64), "JPEG")
    save_image(m / "c.webp", rgb(50, 50), "WEBP")
    frames = [Image.fromarray(rgb(21, 33)).convert("P") for _ in range(2)]
    frames[0].save(m / "d.gif", save_all=True, append_images=frames[1:])
    save_image(m / "gray.png", rgb(20, 90), "PNG", "L")
    save_image(m / "rgba.png", rgb(64, 16), "PNG", "RGBA")
    save_image(m / "cmyk.jpg", rgb(40, 40), "JPEG", "CMYK")
    Image.fromarray((rng.integers(0, 65535, (24, 24))).astype(np.uint16)).save(m / "deep.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 80 wide x 16 high, displayed rotated: 16 wide x 80 high
    Image.fromarray(rgb(16, 80)).save(m / "rot.jpg", exif=exif)
    t = np.arange(int(44100 * 1.1)) / 44100
    stereo = np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)], 1) * 0.3
    sf.write(m / "stereo.flac", stereo, 44100)
    sf.write(m / "mono.wav", rng.standard_normal(8000).astype(np.float32) * 0.1, 16000)
    sf.write(m / "tone.ogg", stereo[:30000, 0], 22050)
    sf.write(m / "short.wav", np.zeros(100, np.float32), 16000)
    jpg = (m / "b.jpg").read_bytes()
    (m / "trunc.jpg").write_bytes(jpg[: len(jpg) // 2])
    (m / "zero.png").write_bytes(b"")
    (m / "noise.png").write_bytes(rng.bytes(200))
    buf = io.BytesIO()
    save_image(buf, rgb(12, 12), "PNG")
    inline = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    good = [
        {"id": "png", "text": "<image> a png", "images": ["m/a.png"]},
        {"id": "two", "text": "<image> and <image>", "images": ["m/b.jpg", "m/c.webp"]},
        {"id": "gif", "text": "<image>gif", "images": ["m/d.gif"]},
        {
            "id": "modes",
            "text": "<image><image><image><image>",
            "images": ["m/gray.png", "m/rgba.png", "m/cmyk.jpg", "m/deep.png"],
        },
        {"id": "rot", "text": "<image>rotated", "images": ["m/rot.jpg"]},
        {"id": "inline", "text": "<image>inline", "images": [inline]},
        {"id": "stereo", "text": "<audio> two tones", "audio": ["m/stereo.flac"]},
        {"id": "av", "text": "<audio><image>both", "audio": ["m/mono.wav"], "images": ["m/a.png"]},
        {"id": "ogg", "text": "<audio>", "audio": ["m/tone.ogg"]},
        {"id": "text", "text": "just some text"},
        {
            "id": "chat",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "<image>what is it?"},
                {"role": "assistant", "content": "noise"},
                {"role": "user", "content": "sure?"},
                {"role": "assistant", "content": [{"type": "text", "text": "yes"}]},
            ],
            "images": ["m/a.png"],
        },
    ]
    bad = {
        "trunc": ({"text": "<image>", "images": ["m/trunc.jpg"]}, "undecodable_media"),
        "zero": ({"text": "<image>", "images": ["m/zero.png"]}, "undecodable_media"),
        "noise": ({"text": "<image>", "images": ["m/noise.png"]}, "undecodable_media"),
        "gone": ({"text": "<image>", "images": ["m/gone.png"]}, "missing_media"),
        "mismatch": ({"text": "<image>", "images": ["m/a.png", "m/a.png"]}, "placeholder_mismatch"),
        "empty": ({"text": "  "}, "empty_sample"),
        "no_answer": ({"messages": [{"role": "user", "content": "hi"}]}, "empty_sample"),
        "short": ({"text": "<audio>", "audio": ["m/short.wav"]}, "audio_too_short"),
        "png": ({"text": "again"}, "duplicate_id"),
    }
    lines = [json.dumps(r) for r in good]
    lines += [json.dumps({"id": k, **r}) for k, (r, _) in bad.items()]
    lines += ['{"id": "broken", "text": ', '{"text": "no id"}', ""]
    path = root / "manifest.jsonl"
    path.write_text("\n".join(lines) + "\n")
    expect = {k: why for k, (_, why) in bad.items()}
    expect.update(
        {  # (no id: named by their place)
            f"manifest.jsonl:{len(lines) - 2}": "malformed_line",
            f"manifest.jsonl:{len(lines) - 1}": "malformed_line",
        }
    )
    cfg = config(path)
    summary = build_index(cfg, path, progress=False)
    return {"path": path, "cfg": cfg, "summary": summary, "good": good, "expect": expect}


def counts_of(sample):
    text = int(((sample.tokens != IMAGE) & (sample.tokens != AUDIO)).sum())
    return {
        "text": text,
        "images": [len(p) for p, _ in sample.media["vision"]],
        "audio": [len(f) for f, _ in sample.media["audio"]],
    }


def test_index_counts_equal_preprocessed_counts(data):
    src = open_source(data["cfg"])
    assert [r["id"] for r in src.rows] == [r["id"] for r in data["good"]]
    for i in range(len(src)):
        s = src[i]
        assert counts_of(s) == src.index.record(i), src.rows[i]["id"]
        for patches, pos in s.media["vision"]:
            assert patches.shape[1] == 4 * 4 * 3 and patches.dtype == np.uint8  # pixels
            assert (pos.reshape(-1, 4, 2) // 2 == pos.reshape(-1, 4, 2)[:, :1] // 2).all()
            assert len(patches) * 16 <= 1024
        for frames, _ in s.media["audio"]:
            assert frames.shape[1] == 16 and len(frames) % 4 == 0 and len(frames) <= 32
        assert (s.tokens == IMAGE).sum() == sum(len(p) for p, _ in s.media["vision"]) // 4
        assert (s.tokens == AUDIO).sum() == sum(len(f) for f, _ in s.media["audio"]) // 4


def test_decoded_shapes_orientation_and_audio_chunks(data):
    src = open_source(data["cfg"])
    by_id = {src.rows[i]["id"]: i for i in range(len(src))}
    rot = src[by_id["rot"]].media["vision"][0][1]
    assert rot[:, 0].max() > rot[:, 1].max()  # taller than wide after the EXIF rotation
    assert src.rows[by_id["rot"]]["image_sizes"] == [[80, 16]]
    stereo = src[by_id["stereo"]].media["audio"]
    frames = clip_frames(int(44100 * 1.1), 44100, 16000, 4)
    assert frames == 108 and [len(c) for c, _ in stereo] == [32, 32, 32, 12]
    assert len(src[by_id["modes"]].media["vision"]) == 4


def test_loading_some_media_decodes_only_those(data, monkeypatch):
    """On several hosts each decodes only the images / clips its devices encode."""
    import jaxmllm.data.media.kinds as pre

    src = open_source(data["cfg"])
    by_id = {src.rows[i]["id"]: i for i in range(len(src))}
    decoded = []
    for name in ("load_image", "load_audio"):
        real = getattr(pre, name)
        monkeypatch.setattr(
            pre, name, lambda *a, _real=real, _n=name, **k: decoded.append(_n) or _real(*a, **k)
        )
    full = src[by_id["modes"]]
    decoded.clear()
    part = src.load(by_id["modes"], {"vision": (2,), "audio": ()})
    assert decoded == ["load_image"]
    np.testing.assert_array_equal(part.tokens, full.tokens)  # text laid out from the index
    assert [m is None for m in part.media["vision"]] == [True, True, False, True]
    np.testing.assert_array_equal(part.media["vision"][2][0], full.media["vision"][2][0])
    stereo = src[by_id["stereo"]].media["audio"]
    decoded.clear()
    part = src.load(by_id["stereo"], {"vision": (), "audio": (3,)})
    assert decoded == ["load_audio"] and [m is None for m in part.media["audio"]] == [True] * 3 + [
        False
    ]
    np.testing.assert_array_equal(part.media["audio"][3][0], stereo[3][0])
    decoded.clear()
    text_only = src.load(by_id["stereo"], {"vision": (), "audio": ()})
    assert decoded == [] and np.array_equal(text_only.tokens, src[by_id["stereo"]].tokens)


def test_every_bad_record_is_counted_with_its_reason(data):
    rejects = read_rejects(Path(data["summary"]["index"]) / "rejects.jsonl")
    assert {r["id"]: r["reason"] for r in rejects} == data["expect"]
    assert data["summary"]["rejected"] == len(data["expect"])
    assert data["summary"]["accepted"] == len(data["good"])
    with pytest.raises(DataError, match=r"record '.+'.*data\.on_error.*rejected records"):
        open_source(config(data["path"], "data.on_error=fail"))


def test_chat_loss_only_on_assistant_turns(data):
    src = open_source(data["cfg"])
    s = src[[r["id"] for r in src.rows].index("chat")]
    text = tok.ByteTokenizer().decode(s.tokens[s.loss])
    assert text == "noise</s>yes</s>"
    assert (s.tokens == tok.USER).sum() == 3 and (s.tokens == tok.ASSISTANT).sum() == 2


def test_jsonl_and_arrayrecord_give_identical_samples(data, tmp_path):
    ar = tmp_path / "data.array_record"
    assert convert(data["path"], ar) == len(data["good"]) + len(data["expect"])
    cfg = config(ar, "data.source=arrayrecord")
    summary = build_index(cfg, ar, progress=False)
    assert summary["rejects"] == data["summary"]["rejects"]
    a, b = open_source(data["cfg"]), open_source(cfg)
    assert list(a.rows) == list(b.rows)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert np.array_equal(x.tokens, y.tokens) and np.array_equal(x.loss, y.loss)
        for (p, q), (r, s) in zip(x.media["vision"], y.media["vision"], strict=True):
            assert np.array_equal(p, r) and np.array_equal(q, s)
        for (f, _), (g, _) in zip(x.media["audio"], y.media["audio"], strict=True):
            assert np.array_equal(f, g)


def test_load_time_failure_skip_logs_and_fail_names_the_record(data, tmp_path):
    root = tmp_path / "copy"
    root.mkdir()
    (root / "m").symlink_to(data["path"].parent / "m")
    (root / "own").mkdir()
    (root / "own" / "x.png").write_bytes((data["path"].parent / "m" / "a.png").read_bytes())
    path = root / "manifest.jsonl"
    path.write_text(
        json.dumps({"id": "will-go", "text": "<image>", "images": ["own/x.png"]}) + "\n"
    )
    cfg = config(path, f"train.output_dir={tmp_path / 'run'}")
    build_index(cfg, path, progress=False)
    (root / "own" / "x.png").unlink()  # removed after indexing
    loader = Loader(cfg, open_source(cfg))
    assert loader.load(np.array([0]), step=3) == {0: None}
    assert loader.counts()["rejects/load_missing_media"] == 1
    (entry,) = read_rejects(tmp_path / "run" / "rejects.jsonl")
    assert entry["id"] == "will-go" and entry["reason"] == "missing_media" and entry["step"] == 3
    fail = replace(cfg, data=replace(cfg.data, on_error="fail"))
    with pytest.raises(DataError, match=r"will-go.*data\.on_error"):
        Loader(fail, open_source(fail)).load(np.array([0]), step=0)


@pytest.mark.parametrize("policy", ["shrink", "truncate", "skip", "fail"])
def test_oversize_policy(data, policy):
    cfg = config(
        data["path"],
        "batch.capacity=fixed",
        "batch.llm_row_len=48",
        "batch.attention_block=16",
        f"data.on_oversize={policy}",
    )
    if policy == "fail":
        with pytest.raises(DataError, match=r"record '\w+'.*data\.on_oversize"):
            open_source(cfg)
        return
    src = open_source(cfg)
    llm = src.index.llm_tokens({"vision": 4, "audio": 4})
    assert llm.max() <= 48
    assert {e["action"] for e in src.startup_rejects} <= {policy, "skip"}
    assert len(src) + sum(e["action"] == "skip" for e in src.startup_rejects) == len(data["good"])
    for i in src.limits:  # repaired samples load with exactly the repaired counts
        assert counts_of(src[i]) == src.index.record(i)
    if policy == "shrink":
        assert any("max_pixels" in e["limits"] for e in src.startup_rejects)


def test_index_must_exist_and_match_the_config(data, tmp_path):
    path = tmp_path / "new.jsonl"
    path.write_text(json.dumps({"id": 1, "text": "hi"}) + "\n")
    with pytest.raises(ConfigError, match="python -m jaxmllm.data.index"):
        open_source(config(path))
    with pytest.raises(ConfigError, match="image_max_pixels"):
        open_source(config(data["path"], "data.image_max_pixels=4096"))


def test_hf_tokenizer_json(data, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("a png and gif rotated".split())}}
    vocab.update({f"w{i}": 300 + i for i in range(20)})  # ids past 256 are shifted by 8
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(tmp_path / "tokenizer.json"))
    tj = f"data.tokenizer={tmp_path / 'tokenizer.json'}"
    with pytest.raises(ConfigError, match="vocab_size to at least 328"):
        open_source(config(data["path"], tj, f"data.index_dir={tmp_path / 'ix'}"))
    cfg = config(data["path"], tj, "model.llm.vocab_size=328", f"data.index_dir={tmp_path / 'i'}")
    build_index(cfg, data["path"], tmp_path / "i", progress=False)
    src = open_source(cfg)
    s = src[0]  # "<image> a png"
    assert s.tokens[s.loss].tolist() == [1, 2, tok.EOS]
    assert src.pre.tokenizer.encode("w3").tolist() == [311]


@given(st.integers(1, 4000), st.integers(1, 4000), st.integers(64, 5000))
def test_image_grid_stays_in_budget(h, w, max_pixels):
    gh, gw = image_grid(h, w, 4, 2, 64, max_pixels)
    assert gh % 2 == 0 and gw % 2 == 0 and gh >= 2 and gw >= 2
    assert gh * gw * 16 <= max(max_pixels, 64)


@pytest.mark.slow  # ~60 s: a whole training run on a manifest
def test_training_on_a_manifest_reports_rejects(tmp_path, capsys, caplog):
    """Media deleted after indexing: the run goes on, and says so on the terminal (a line
    per logging window with rejects, the index's rejects at start-up) and in its summary."""
    import logging

    from jaxmllm.loop.metrics import read_metrics
    from jaxmllm.train import main

    manifest = write_dataset(tmp_path / "ds", images=160, audio=80, broken=1)
    out = tmp_path / "run"
    cfg = load_config(
        "configs/manifest_example.yaml",
        [
            f"data.path={manifest}",
            f"train.output_dir={out}",
            "train.steps=3",
            "train.log_every=1",
            "train.progress_bar=false",
            "data.workers=2",
            "data.max_load_rejects=0.5",  # (a sixth of the records lose their media)
        ],
    )
    index = Path(build_index(cfg, manifest, workers=2, progress=False)["index"])
    lines = np.load(index / "line.npy").tolist()
    for line in lines[:40]:  # removed after indexing: fail at load time, skipped and logged
        rec = json.loads(manifest.read_text().splitlines()[line - 1])
        for p in rec.get("images", []) + rec.get("audio", []):
            (manifest.parent / p).unlink(missing_ok=True)
    caplog.set_level(logging.INFO, logger="jaxmllm")
    main(cfg)
    metrics = read_metrics(out)
    assert len(metrics) == 3 and all(np.isfinite(m["loss"]) for m in metrics)
    assert metrics[-1]["rejects/index_total"] == 6
    assert metrics[-1]["rejects/load_total"] >= 1
    told = " ".join(line.strip() for line in caplog.text.splitlines())  # (wrapped lines joined)
    assert "the index accepted 240 of 246 records; 6 rejected (" in told, told
    assert "load-time rejects in steps " in told and "(missing_media " in told, told
    assert "the first: record " in told and "no such file: " in told, told
    summary = capsys.readouterr().out.split("done: 3 steps")[1]
    loads = int(metrics[-1]["rejects/load_total"])
    assert f"{loads} at load time (missing_media {loads})" in summary, summary
    assert "6 at indexing (" in summary, summary
    assert str(out / "rejects.jsonl") in summary and f"checkpoint: {out}/checkpoints/3" in summary
    logged = [r for r in read_rejects(out / "rejects.jsonl") if r["stage"] == "load"]
    assert len(logged) == loads  # (the steps loaded ahead and never trained: in no log)
    assert all(r["reason"] == "missing_media" and r["step"] < 3 for r in logged)


def test_load_time_reject_counts_carry_across_a_restore(data, tmp_path):
    from jaxmllm.feed.iterator import make_pipeline

    root = tmp_path / "copy"
    (root / "own").mkdir(parents=True)
    png = (data["path"].parent / "m" / "a.png").read_bytes()
    lines = []
    for k in range(6):
        (root / "own" / f"x{k}.png").write_bytes(png)
        lines.append(json.dumps({"id": f"r{k}", "text": "<image>a", "images": [f"own/x{k}.png"]}))
    path = root / "manifest.jsonl"
    path.write_text("\n".join(lines) + "\n")
    cfg = config(path, f"train.output_dir={tmp_path / 'run'}")
    build_index(cfg, path, progress=False)
    (root / "own" / "x0.png").unlink()  # one record breaks after indexing

    run = resolve_run(cfg, 8)
    it = make_pipeline(run, prefetch=0)
    for _ in range(2):
        next(it)
    state = it.get_state()
    want = [next(it)["info"].rejects for _ in range(2)]
    restored = make_pipeline(run, prefetch=0)
    restored.set_state(state)
    got = [next(restored)["info"].rejects for _ in range(2)]
    assert got == want and want[-1]["rejects/load_total"] > 0


def test_a_record_that_no_longer_matches_its_index_row_is_refused(data, tmp_path):
    path = tmp_path / "manifest.jsonl"
    path.write_text(json.dumps({"id": "t1", "text": "hello there"}) + "\n")
    cfg = config(path, f"train.output_dir={tmp_path / 'run'}")
    index = Path(build_index(cfg, path, progress=False)["index"])
    # The manifest keeps its size (so the index looks fresh) but its tokens no longer match
    # what was planned for: here, the index's count is edited to say one token more.
    text = np.load(index / "text.npy")
    text[0] += 1
    np.save(index / "text.npy", text)
    loader = Loader(cfg, open_source(cfg))
    assert loader.load(np.array([0]), step=0) == {0: None}
    assert loader.counts()["rejects/load_changed_since_index"] == 1


def test_pixels_are_normalised_with_the_configured_mean_and_std(tmp_path):
    """data.image_mean / image_std (a pretrained encoder's processor): (x / 255 - mean) / std
    per channel; the default 0.5 / 0.5 is [-1, 1]. Pixels load as uint8; the spec's inputs
    say how the encoder normalises them."""
    from PIL import Image

    from jaxmllm.config.phases import VISION
    from jaxmllm.config.spec import inputs_of
    from jaxmllm.data.media.image import load_image

    rgb = np.zeros((28, 28, 3), np.uint8)
    rgb[..., 0], rgb[..., 1], rgb[..., 2] = 255, 51, 0
    Image.fromarray(rgb).save(tmp_path / "a.png")
    pixels, _ = load_image(str(tmp_path / "a.png"), 14, 2, 1, 10**6)
    assert pixels.dtype == np.uint8 and (pixels.reshape(-1, 3) == [255, 51, 0]).all()
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    for sets, want in [
        ([], [1.0, 51 / 127.5 - 1, -1.0]),
        (
            [f"data.image_mean={list(mean)}", f"data.image_std={list(std)}"],
            (np.array([255, 51, 0]) / 255 - np.array(mean)) / np.array(std),
        ),
    ]:
        inputs = inputs_of(VISION, load_config("configs/tiny.yaml", sets).data)
        got = inputs.normalise(pixels).reshape(-1, 3)
        np.testing.assert_allclose(got, np.tile(want, (len(got), 1)), rtol=1e-5)
