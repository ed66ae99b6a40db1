"""Synthetic data, the first-fit planner and bucketize: the batch contract's invariants."""

import numpy as np
import pytest

from jaxmllm.batch.bucketize import batch_shapes, bucketize
from jaxmllm.config import load_config
from jaxmllm.data.synthetic import SyntheticSource
from jaxmllm.data.text import tokenizer as tok
from jaxmllm.feed.iterator import make_pipeline
from jaxmllm.plan.contract import OversizeError
from jaxmllm.resolve.sizing import capacities, planner_from_config

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

IMAGE, AUDIO = tok.RESERVED.media["vision"], tok.RESERVED.media["audio"]  # the placeholders
VISION = [IMAGE, tok.RESERVED.media["video"]]  # (the vision phase's: images', videos')

SMALL = ["data.synthetic.num_samples=300", "batch.microbatches=2"]
FIRST_FIT = ["batch.planner=first_fit", "batch.route_pair_capacity=0", "batch.capacity=fixed"]


def tiny(*extra):
    return load_config("configs/tiny.yaml", [*SMALL, *extra])


def first_fit(*extra):
    """The tiny config, first-fit planner; tile capacities (block-sparse attention): every tile
    of the bucket, so that bucketize needs no dry run (resolve_batch) and never overflows."""
    cfg = tiny(*FIRST_FIT, *extra)
    b, m = cfg.batch, cfg.model
    full = lambda n, rows, causal: rows * (n * (n + 1) // 2 if causal else n * n)
    blk = b.attention_block
    tiles = [
        f"batch.llm_tiles={full(b.llm_row_len // blk, b.llm_rows, True)}",
        f"batch.vision_tiles={full(b.vision_patches // blk, 1, False)}",
        f"batch.audio_tiles={full(b.audio_frames // m.audio.subsample // blk, 1, False)}",
    ]
    return tiny(*FIRST_FIT, *extra, *tiles)


def test_synthetic_is_deterministic_and_index_matches_samples():
    cfg = tiny()
    a, b = SyntheticSource(cfg), SyntheticSource(cfg)
    index = a.lengths()
    kinds = set()
    for i in range(len(a)):
        s = a[i]
        assert np.array_equal(s.tokens, b[i].tokens)
        text = int(np.isin(s.tokens, list(tok.RESERVED.media.values()), invert=True).sum())
        assert text == index.text[i], i
        assert [len(p) for p, _ in s.media["vision"]] == index.record(i)["images"]
        assert [len(f) for f, _ in s.media["audio"]] == index.record(i)["audio"]
        kinds.add((len(s.media["vision"]), len(s.media["audio"])))
    assert {(0, 0), (1, 0), (2, 0), (0, 1)} <= kinds  # text-only, image, multi-image, audio


def test_patches_are_in_merge_order():
    cfg = tiny()
    src = SyntheticSource(cfg)
    s = next(src[i] for i in range(len(src)) if src[i].media["vision"])
    patches, pos = s.media["vision"][0]
    blocks = pos.reshape(-1, 4, 2)
    # each run of 4 patches is one 2x2 block: same (row//2, col//2)
    assert (blocks // 2 == blocks[:, :1] // 2).all()
    assert patches.shape[1] == 4 * 4 * 3


def plan_steps(cfg, devices, steps):
    src = SyntheticSource(cfg)
    planner = planner_from_config(cfg, src.lengths(), devices)
    return src, planner, [planner.plan() for _ in range(steps)]


def test_first_fit_never_exceeds_capacity_and_loses_nothing():
    cfg = first_fit()
    src, planner, plans = plan_steps(cfg, 8, 12)
    caps = capacities(cfg, 8)
    index = src.lengths()
    llm = index.llm_tokens({"vision": 4, "audio": 4})
    seen = np.concatenate([p.samples for p in plans])
    # The stream in order, nothing skipped: a prefix of the epoch permutations.
    assert np.array_equal(seen, planner.stream.take(0, len(seen)))
    for p in plans:
        for m in range(caps.microbatches):
            for d in range(caps.devices):
                sel = (p.micro == m) & (p.device == d)
                for r in range(caps.llm_rows):
                    rs = sel & (p.row == r)
                    ends = p.offset[rs] + llm[p.samples[rs]]
                    assert ends.max(initial=0) <= caps.llm_row_len
                    # segments do not overlap
                    order = np.argsort(p.offset[rs])
                    assert (p.offset[rs][order][1:] >= ends[order][:-1]).all()


def test_bucketize_routes_every_placeholder_to_its_encoder_rows():
    cfg = first_fit()
    src, planner, plans = plan_steps(cfg, 8, 2)
    caps = capacities(cfg, 8)
    plan = plans[1]
    samples = {int(s): src[int(s)] for s in plan.samples}
    batch = bucketize(plan, samples, cfg, caps)
    for k, (shape, dtype) in batch_shapes(cfg, 8).items():
        assert batch[k].shape == shape and batch[k].dtype == dtype, k
    # Every vision placeholder (an image's, a video's) points at a distinct, filled encoder
    # output row of its device.
    img = np.isin(batch["llm_tokens"], VISION)
    assert ((batch["llm_vision_src"] >= 0) == img).all()
    aud = batch["llm_tokens"] == AUDIO
    assert ((batch["llm_audio_src"] >= 0) == aud).all()
    for m in range(caps.microbatches):
        for d in range(caps.devices):
            src_rows = batch["llm_vision_src"][m, d][img[m, d]]
            assert len(set(src_rows.tolist())) == len(src_rows)
            seg = batch["vision_segment_ids"][m, d].reshape(-1, 4)[:, 0]
            assert (seg[src_rows] > 0).all()
            assert (seg > 0).sum() == len(src_rows)  # every filled row is consumed
    # The token stream of each placed sample is written verbatim.
    k = 3
    s = samples[int(plan.samples[k])]
    at = (plan.micro[k], plan.device[k], plan.row[k])
    o = plan.offset[k]
    assert np.array_equal(batch["llm_tokens"][at][o : o + len(s.tokens)], s.tokens)
    assert batch["llm_loss_mask"][at][o : o + len(s.tokens)].sum() == s.loss[1:].sum()


def test_routed_mode_bucketize_uses_send_tables():
    cfg = first_fit("batch.route_pair_capacity=96")
    src, planner, plans = plan_steps(cfg, 4, 1)
    plan = plans[0]
    caps = capacities(cfg, 4)
    # Move every image to the next device to force cross-device routing.
    plan.items["vision"].device = (plan.device[plan.items["vision"].owner] + 1) % 4
    owner_dev = plan.device[plan.items["vision"].owner]
    for m in range(caps.microbatches):
        for d in range(4):  # repack offsets per encoder device
            sel = np.flatnonzero(
                (plan.micro[plan.items["vision"].owner] == m) & (plan.items["vision"].device == d)
            )
            sizes = [
                len(
                    src[int(plan.samples[plan.items["vision"].owner[i]])].media["vision"][
                        plan.items["vision"].item[i]
                    ][0]
                )
                for i in sel
            ]
            plan.items["vision"].offset[sel] = (
                np.concatenate([[0], np.cumsum(sizes)[:-1]]) if len(sel) else []
            )
    samples = {int(s): src[int(s)] for s in plan.samples}
    batch = bucketize(plan, samples, cfg, caps)
    assert (owner_dev != plan.items["vision"].device).all()
    img = batch["llm_tokens"] == IMAGE
    srcs = batch["llm_vision_src"][img]
    assert (srcs >= 0).all()
    # Received index N + s*C + c must point at a send slot that names a real row of device s.
    C, N = 96, cfg.batch.vision_patches // 4
    for m in range(caps.microbatches):
        for d in range(4):
            for v in batch["llm_vision_src"][m, d][img[m, d]]:
                assert v >= N  # nothing is local: every image moved
                s_dev, c = divmod(int(v) - N, C)
                assert s_dev == (d + 1) % 4
                row = batch["vision_send"][m, s_dev, d, c]
                assert batch["vision_segment_ids"][m, s_dev, row * 4] > 0


def test_oversize_sample_is_a_clear_start_up_error():
    with pytest.raises(OversizeError, match=r"raise batch\.vision_patches to at least"):
        plan_steps(first_fit("batch.vision_patches=64"), 8, 1)


def test_pipeline_state_roundtrip_reproduces_steps():
    from jaxmllm.resolve.run import resolve_run

    run = resolve_run(tiny(), 8)  # (the trainer resolves once)
    it = make_pipeline(run)
    for _ in range(3):
        next(it)
    state = it.get_state()
    want = [next(it) for _ in range(2)]
    it.close()
    it2 = make_pipeline(run)
    it2.set_state(state)
    got = [next(it2) for _ in range(2)]
    it2.close()
    for a, b in zip(want, got, strict=False):
        assert a["info"].step == b["info"].step
        for k in a["batch"]:
            assert np.array_equal(a["batch"][k], b["batch"][k]), k


def test_resolve_batch_sizes_encoder_buckets_and_route_capacity_from_the_data():
    from jaxmllm.data.source import make_source
    from jaxmllm.resolve.sizing import resolve_batch

    cfg = tiny("batch.capacity=auto", "batch.route_pair_capacity=-1")
    _, index = make_source(cfg)
    got = resolve_batch(cfg, index).batch
    # orchestrated places items, not samples: its bucket holds the largest item, a planner of
    # whole samples' the largest sample's (here more than the data's ratio asks for)
    vision = index.items["vision"].per_sample().max()
    assert got.vision_patches >= index.items["vision"].sizes.max() and got.vision_patches % 4 == 0
    whole = resolve_batch(tiny("batch.planner=balanced", "batch.capacity=auto"), index).batch
    assert whole.vision_patches >= vision > got.vision_patches
    assert got.audio_frames >= index.items["audio"].per_sample().max()
    # the route capacity: the most a pair carried in a dry run of the planner's own plans, at
    # least the largest item's rows, at most a device's whole encoder output (issue 18)
    whole = max(got.vision_patches, got.audio_frames) // 4
    largest = (
        max(index.items["vision"].sizes.max(initial=0), index.items["audio"].sizes.max(initial=0))
        // 4
    )
    assert largest <= got.route_pair_capacity <= whole
    assert got.devices_per_host >= 1  # (auto: one process's data-parallel positions)
    fixed = resolve_batch(tiny("batch.planner=first_fit", "batch.capacity=fixed"), index).batch
    assert fixed.route_pair_capacity == 0 and fixed.vision_patches == cfg.batch.vision_patches


def test_orchestrated_without_routing_is_a_config_error():
    from jaxmllm.config import ConfigError

    with pytest.raises(ConfigError, match=r"batch\.route_pair_capacity"):
        tiny("batch.planner=orchestrated", "batch.route_pair_capacity=0")


def test_route_capacity_from_the_dry_run_is_held_by_the_pipeline():
    """`route_pair_capacity: -1` resolves below a device's whole output on omni-like data
    (the dense exchange shrinks), the planner keeps every pair within it, and every placeholder
    still reads its item's rows through the exchange (bucketize raises past the capacity)."""
    from jaxmllm.feed.iterator import make_pipeline
    from jaxmllm.plan.contract import check_plan
    from jaxmllm.resolve.run import resolve_run

    cfg = tiny(
        "batch.capacity=auto",
        "batch.route_pair_capacity=-1",
        "batch.microbatches=2",
        "batch.llm_row_len=384",  # (buckets of several items: a pair carries less than one)
        "data.synthetic.num_samples=512",
        "train.steps=100",
    )
    run = resolve_run(cfg, 8)
    got, index = run.cfg, run.index
    whole = max(got.batch.vision_patches, got.batch.audio_frames) // 4
    assert got.batch.route_pair_capacity < whole
    planner = run.planner()
    for _ in range(60):  # (past the dry run's 50 plans: the bound is held, not just met)
        check_plan(planner.plan(), index, run.caps)  # (raises past the route capacity)
    it = make_pipeline(run, prefetch=0)
    for _ in range(3):
        out = next(it)
        batch = out["batch"]
        for phase in ("vision", "audio"):
            assert batch[f"{phase}_send"].shape[-1] == got.batch.route_pair_capacity
            assert batch[f"{phase}_send_count"].max() <= got.batch.route_pair_capacity
