"""Training on data as people have it: tiny on every format (the same losses), data without
images or clips on the three-encoder model, a weighted mixture of three formats that resumes
exactly."""

import json
from dataclasses import replace
from functools import partial

import jax
import numpy as np
import pytest

from jaxmllm.batch.bucketize import batch_shapes
from jaxmllm.bench.formats import make_records, write_formats
from jaxmllm.config import load_config
from jaxmllm.config.spec import BatchSpec
from jaxmllm.data.index import build_index
from jaxmllm.loop.metrics import read_metrics
from jaxmllm.resolve.run import resolve_run

from runs import NO_EVAL

SMALL = ["data.image_min_pixels=256", "data.image_max_pixels=1024", "data.audio_max_frames=32"]


def config(out, *sets, steps=2):
    base = [*NO_EVAL, *SMALL, "data.workers=0", "data.source=files", "data.path="]
    cfg = load_config("configs/manifest_example.yaml", [*base, *sets])
    train = replace(
        cfg.train,
        steps=steps,
        output_dir=str(out),
        log_every=1,
        checkpoint_every=2,
        progress_bar=False,
        async_checkpointing=False,
    )
    return replace(cfg, train=train)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    records = make_records(root, 48)
    paths = write_formats(root, records)
    kinds = {
        "images": [r for r in records if "images" in r],
        "text": [r for r in records if "images" not in r and "audio" not in r],
    }
    for kind, rows in kinds.items():
        paths[kind] = root / f"{kind}.jsonl"
        paths[kind].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def indexed(cfg):
    build_index(cfg, progress=False)
    return cfg


def test_a_phase_the_data_lacks_gets_no_bucket_and_the_step_leaves_it_out(data, tmp_path):
    """Image-only and text-only data on a model with vision and audio encoders: the missing
    phases' buckets are 0, their arrays absent, their modules frozen, and the step traces
    (the reshape of a zero-size bucket used to fail here)."""
    from jaxmllm.step.program import build_model, make_loss_and_grads, model_parts

    for kind, absent in (("images", ["audio"]), ("text", ["vision", "audio"])):
        cfg = indexed(config(tmp_path, f"data.path={data[kind]}"))
        cfg = resolve_run(cfg, 8).cfg
        for phase in absent:
            key = {"vision": "vision_patches", "audio": "audio_frames"}[phase]
            assert getattr(cfg.batch, key) == 0
            assert phase not in BatchSpec.of(cfg).units
            assert key not in batch_shapes(cfg, 8) and f"{phase}_segment_ids" not in batch_shapes(
                cfg, 8
            )
        parts, _ = model_parts(cfg)
        assert set(parts.frozen_keys) == {n for p in absent for n in (p, f"{p}_projector")}
        params, frozen = jax.eval_shape(partial(build_model, cfg, 0))
        batch = {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in batch_shapes(cfg, 8).items()}
        loss, grads = jax.eval_shape(make_loss_and_grads(parts), params, frozen, batch)
        assert loss.shape == () and set(grads) == set(params)


# (Each format trains: the weighted mixture's run below draws from all three. That the same
# records in each format plan and load the same, so train the same, is test_formats' fast
# test: all seven formats to the same samples, token ids and pixels, what training sees.)


@pytest.mark.slow  # ~30 s of CPU, est.: one short run
def test_text_only_data_trains_on_the_three_encoder_model(data, tmp_path):
    """Neither images nor clips in the data: the step without the vision and audio buckets
    compiles and trains, finite losses. (Image-only data, audio alone left out, is the same
    path for its one absent phase: the fast test above traces its step.)"""
    from jaxmllm.train import main

    out = tmp_path / "text"
    main(indexed(config(out, f"data.path={data['text']}")))
    rows = read_metrics(out)
    assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)
    assert "padding/audio" not in rows[-1] and "padding/vision" not in rows[-1]


@pytest.mark.slow  # ~1 minute: a run
def test_a_weighted_mixture_trains_by_its_weights(data, tmp_path):
    """Three formats by weight 2:1:1: samples per source in the metrics. (A mixture's position
    is the planner's cursor: test_formats' restored pipeline holds it, and the trainer's
    resume of that state is test_train's and test_crash's.)"""
    from jaxmllm.train import main

    sources = (
        f"data.sources=[{{path: {data['jsonl']}, weight: 2, name: lines}}, "
        f"{{path: {data['parquet']}, weight: 1}}, {{path: {data['webdataset']}, "
        "weight: 1}]"
    )
    full = tmp_path / "full"
    cfg = config(full, sources, steps=4)
    for ds_path in (data["jsonl"], data["parquet"], data["webdataset"]):
        build_index(cfg, ds_path, progress=False)
    main(cfg)
    want = read_metrics(full)
    drawn = {k: sum(r[f"samples/{k}"] for r in want) for k in ("lines", "parquet", "shards")}
    assert sum(drawn.values()) == sum(r["samples"] for r in want)
    assert drawn["lines"] > max(drawn["parquet"], drawn["shards"]), drawn
