"""The built-in source's start-up: every sample's parameters drawn at once (jaxmllm.data.pcg),
the same numbers as one numpy Generator per sample, and the same samples as ever."""

import dataclasses
import hashlib
import logging

import numpy as np
import pytest

from jaxmllm.config import SyntheticConfig, load_config
from jaxmllm.data import pcg
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.data.synthetic import AUDIO_PROMPT, IMAGE_PROMPT, VIDEO_PROMPT, SyntheticSource

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

KEYS = [([0], [0]), ([7], [1]), ([2**40 + 5], [0]), ([], [3, 9])]  # (a seed of two words)


@pytest.mark.parametrize("head,tail", KEYS)
def test_streams_draw_what_one_generator_per_key_draws(head, tail):
    ids = np.arange(0, 30_000, 7)
    streams = pcg.Streams(head, ids, tail)
    draws = [
        streams.random(),
        streams.integers(2, 9),
        streams.integers(5, 6),
        streams.geometric(0.01),
        streams.integers(0, 90),
        streams.geometric(0.4),
        streams.integers(0, 3),
    ]
    exact = np.ones(len(ids), bool)
    for d in draws[1:]:
        exact &= d[1]
    assert exact.mean() > 0.95  # numpy's rare branches: left to the caller
    for k, i in enumerate(ids.tolist()):
        if not exact[k]:
            continue
        rng = np.random.default_rng([*head, i, *tail])
        want = [
            rng.random(),
            rng.integers(2, 9),
            rng.integers(5, 6),
            rng.geometric(0.01),
            rng.integers(0, 90),
            rng.geometric(0.4),
            rng.integers(0, 3),
        ]
        got = [draws[0][k], *(d[0][k] for d in draws[1:])]
        assert got == want, i


def _old_lengths(source: SyntheticSource) -> LengthsIndex:
    """The index built record by record from each sample's own Generator (as it always was)."""
    records = []
    for i in range(len(source)):
        p = source._sample_params(i)
        if p["kind"] == "text":
            records.append({"text": len(source._text_tokens(p))})
        elif p["kind"] == "image":
            caption = " and ".join(f"a {c} {s}" for _, _, c, s in p["images"])
            text = 2 + len(IMAGE_PROMPT) + len(caption.encode())
            records.append({"text": text, "images": [h * w for h, w, _, _ in p["images"]]})
        elif p["kind"] == "video":  # (a vision item per temporal patch)
            text = 2 + len(VIDEO_PROMPT) + len(source._video_caption(p["video"]).encode())
            patches = [source.syn.video_side**2] * (p["video"][0] // source.temporal)
            records.append({"text": text, "images": patches})
        else:
            caption = f"a {p['audio'][2]} {p['audio'][1]} tone"
            text = 2 + len(AUDIO_PROMPT) + len(caption.encode())
            records.append({"text": text, "audio": [p["audio"][0]]})
    return LengthsIndex.from_records(records)


CONFIGS = {
    "tiny": ("configs/tiny.yaml", []),
    "small": ("configs/small.yaml", []),
    "no videos": ("configs/tiny.yaml", ["data.synthetic.video_fraction=0"]),
    "few words (geometric by search)": ("configs/tiny.yaml", ["data.synthetic.max_text_words=8"]),
    "fixed text tokens": ("configs/tiny.yaml", ["data.synthetic.text_tokens=40"]),
    "one image side, a long seed": (
        "configs/tiny.yaml",
        ["data.synthetic.min_image_side=8", "data.synthetic.max_image_side=8", "data.seed=2**40"],
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_samples_parameters_and_lengths_are_the_per_sample_generators(name):
    path, sets = CONFIGS[name]
    sets = [s.replace("2**40", str(2**40)) for s in sets]
    cfg = load_config(path, ["data.synthetic.num_samples=3000", *sets])
    source = SyntheticSource(cfg)
    for i in range(len(source)):
        assert source._table.params(i) == source._sample_params(i), i
    got, want = source.lengths(), _old_lengths(source)
    for a, b in zip(_index_arrays(got), _index_arrays(want), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def _index_arrays(index: LengthsIndex) -> list[np.ndarray]:
    """text, then each phase's item pointers and sizes (vision's, then audio's)."""
    items = [index.items[p] for p in ("vision", "audio")]
    return [index.text, *(a for each in items for a in (each.ptr, each.sizes))]


def test_the_default_mix_and_no_samples_at_all():
    cfg = load_config("configs/tiny.yaml")
    for n in (0, 1, 5000):
        data = dataclasses.replace(cfg.data, synthetic=SyntheticConfig(num_samples=n))
        source = SyntheticSource(dataclasses.replace(cfg, data=data))
        assert len(source.lengths()) == n
        assert all(source._table.params(i) == source._sample_params(i) for i in range(n))


def test_streams_that_differ_from_numpys_are_caught_and_drawn_numpys_way(monkeypatch, caplog):
    cfg = load_config("configs/tiny.yaml", ["data.synthetic.num_samples=500"])
    random = pcg.Streams.random
    monkeypatch.setattr(pcg.Streams, "random", lambda self: random(self) * 0.5)  # wrong
    with caplog.at_level(logging.WARNING, logger="jaxmllm"):
        source = SyntheticSource(cfg)
    assert "drawn one sample at a time" in caplog.text
    assert all(source._table.params(i) == source._sample_params(i) for i in range(500))


def test_a_lane_on_numpys_rare_branch_is_no_sign_that_the_streams_differ(caplog):
    """Short texts (max_text_words 16) take the geometric draw's slow path in ~2% of samples;
    those lanes are drawn numpy's way, and the start-up probe, which used to compare them
    before they were, warned that numpy's streams differ (configs/tiny_moe.yaml, text only)."""
    sets = [f"data.synthetic.{k}_fraction=0" for k in ("image", "audio", "video", "multi_image")]
    cfg = load_config("configs/tiny_moe.yaml", sets)
    with caplog.at_level(logging.WARNING, logger="jaxmllm"):
        source = SyntheticSource(cfg)
    assert "streams differ" not in caplog.text
    assert all(source._table.params(i) == source._sample_params(i) for i in range(len(source)))


# The tiny config's samples 0, 5, 10, ... 255 (tokens, loss masks, patches, positions, frames)
# and its lengths index, as each sample's own Generator made them before the parameters were
# drawn together and the images rendered with broadcast coordinates (with videos: the digest
# the per-sample code gave; without: the one before videos): they must never change by accident
# (the tiny run's answers and losses depend on them). Since pixels travel as uint8, images and
# video frames are the nearest uint8 pixels of the same renderings (each within half a step,
# 1/255, of the float values the digests before were of: e2b41c97... with videos, b0489aca...
# without); tokens, frames, positions and the index are what they were. Since shapes are drawn
# on the patch grid (`SyntheticSource._render_image`), the pixels are new (24becdfd... and
# 7c27c08b... before) and everything else is what it was.
TINY_DIGESTS = {
    "": "dee82a26a900504acb5dead7b8fd755e0c489c686b64b0514bd033eb1d40c971",
    "data.synthetic.video_fraction=0": (
        "9cc1527f756da5ddc046d3c5ba9238e859e0b96080da7dc1b89b2a235bfb305b"
    ),
}


@pytest.mark.parametrize("setting", list(TINY_DIGESTS))
def test_the_tiny_configs_samples_are_bit_for_bit_what_they_were(setting):
    sets = ["data.synthetic.num_samples=256", *([setting] if setting else [])]
    source = SyntheticSource(load_config("configs/tiny.yaml", sets))
    digest = hashlib.sha256()
    for i in range(0, 256, 5):
        x = source[i]
        images = [a for image in x.media["vision"] for a in image]  # patches, positions
        clips = [frames for frames, _ in x.media["audio"]]  # (their positions: 0, 1, ...)
        for a in [x.tokens, x.loss, *images, *clips]:
            digest.update(np.ascontiguousarray(a).tobytes())
    for a in _index_arrays(source.lengths()):
        digest.update(a.tobytes())
    assert digest.hexdigest() == TINY_DIGESTS[setting]


@pytest.mark.parametrize("patch", [4, 14, 16])
def test_a_shape_on_the_patch_grid_stays_on_its_image(patch):
    """Every radius and centre the drawing gives, for images 1 to 12 patches wide (merge 1
    allows one patch) and videos' frames: the shape reaches no further than half a pixel past
    its image's edge pixels (one patch wide, the centre stays where it was drawn: no line
    between patches lies inside)."""
    from jaxmllm.data.synthetic import _on_grid, _whole_patches

    for side in range(patch, 12 * patch + 1, patch):
        for share in np.linspace(0.2, 0.4, 9):
            r = _whole_patches(share * side, patch, side)
            assert patch <= r or side < 2 * patch
            for v in np.linspace(r, side - r, 7):
                c = _on_grid(v, patch, r, side - r)
                assert c - r >= -1 and c + r <= side, (side, share, r, v, c)


@pytest.mark.parametrize("video_side", [2, 4, 8])
def test_a_videos_shape_moves_the_way_its_answer_says(video_side):
    """Frames 2 to 8 patches wide: the shape's pixels move right from the first frame to the
    last, as the answer says (a shape of whole-patch radius on the grid of a frame 2 patches
    wide could not move at all)."""
    sets = [f"data.synthetic.video_side={video_side}", "data.synthetic.video_fraction=1"]
    sets += ["data.synthetic.image_fraction=0", "data.synthetic.audio_fraction=0"]
    source = SyntheticSource(load_config("configs/tiny.yaml", sets))
    p = source.patch
    for i in range(12):
        frames = source._render_video(np.random.default_rng(i), 4, "red", "square", "right")
        where = []
        for patches, positions in (frames[0], frames[-1]):  # (their first frames)
            pixels = patches[:, : p * p * 3].reshape(-1, p, p, 3).astype(int)
            red = pixels[..., 0] - pixels[..., 1] > 100  # (red: 255, 25; the noise: ~64, ~64)
            k, _, x = np.nonzero(red)
            where.append(np.mean(positions[k, 1] * p + x))
        assert where[1] > where[0], (video_side, i, where)
