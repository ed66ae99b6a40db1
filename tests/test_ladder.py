"""The long variants of a step (`jaxmllm.plan.ladder`): a rare very long document waits for a
step of a larger tile capacity instead of setting every step's; nothing is lost, a long sample
waits a bounded number of steps, plans stay a function of (seed, step, index, state)."""

import dataclasses
import json
from collections import Counter

import numpy as np
import pytest

from jaxmllm.bench.tails import index_of, longtail, ragged
from jaxmllm.config.phases import PHASES
from jaxmllm.cost.model import TileWeights
from jaxmllm.plan import ladder
from jaxmllm.plan.contract import Capacities, bucket_tile_caps, check_plan, step_tiles
from jaxmllm.plan.ladder import Ladder, longest_fitting, rung_rows
from jaxmllm.plan.registry import make_planner
from jaxmllm.plan.stream import stream_of
from jaxmllm.plan.tiles import own_tiles
from jaxmllm.resolve.tilesize import (
    flop_share,
    goodput,
    ladder_weights,
    largest_doc_tiles,
    size_tiles,
    step_window_tiles,
    window_cap,
)

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

PER_TOKEN = {"vision": 4, "audio": 4}
PER_ROW = {"vision": 1, "audio": 4}


def rare_long(n=3000, every=500, seed=0):
    """Chats of ~60 tokens with images, and one document of ~3,000 tokens in every `every`."""
    rng = np.random.default_rng(seed)
    text = rng.integers(20, 100, n)
    text[::every] = rng.integers(2800, 3100, len(text[::every]))
    count = rng.integers(0, 2, n)
    images = ragged(count, 64 * rng.integers(1, 5, count.sum()))
    return index_of(text, images)


def caps_of(index, devices=4, tiles=None, long_tiles=()):
    caps = Capacities(
        microbatches=2,
        devices=devices,
        llm_rows=1,
        llm_row_len=4096,
        units={"vision": 4096, "audio": 0},
        per_token=PER_TOKEN,
        per_row=PER_ROW,
        route_pair_capacity=256,
        attention_block=64,
        tiles=tiles or {"llm": 150, "vision": 1100},
        long_tiles=long_tiles,
    )
    return caps


def test_longest_fitting_is_the_bound_of_a_document_alone_anywhere_in_a_block():
    for cap, causal in ((1, True), (10, True), (150, True), (1100, False), (4, False)):
        rows = longest_fitting(cap, 64, causal)
        worst = own_tiles(np.array([(rows - 1) // 64 + 2, (rows + 63) // 64 + 2]), causal)
        assert rows == 0 or worst[0] <= cap
        assert worst[1] > cap  # (a block more would not fit)


@pytest.mark.parametrize("shuffle", ["permutation", "index"])
def test_rare_long_documents_wait_for_their_variant_and_nothing_is_lost(shuffle):
    """Held in memory (a stored permutation) or mapped (the index shuffle, a columnar index's
    epoch order): the long samples wait for their variant, every position pulled from the
    stream is planned once or still waits, and a planner restored from a saved state plans
    the same steps."""
    index = dataclasses.replace(rare_long(), shuffle=shuffle)
    least = largest_doc_tiles(index, caps_of(index))["llm"]
    caps = caps_of(index, long_tiles=({"llm": least + 100, "vision": 0},))
    assert caps.variants == 2 and caps.tile_caps(1)["llm"] == least + 100
    planner = make_planner("orchestrated", index, caps, 0)
    rungs = Ladder(caps).rungs(index.llm_tokens(PER_TOKEN), {})
    assert set(np.flatnonzero(rungs)) == set(range(0, len(index), 500))  # the long ones
    planned, variants, states = Counter(), [], []
    for _ in range(60):
        states.append(json.loads(json.dumps(planner.get_state())))
        plan = planner.plan()
        check_plan(plan, index, caps)  # (within the step's variant's tiles)
        variants.append(plan.variant)
        long = rungs[plan.samples] > 0
        assert plan.variant or not long.any()  # a base step takes no long sample
        assert planner.ages.max(initial=0) <= max(ladder.LONG_WAIT, planner.max_age)
        tiles = step_tiles(plan, index, caps)["llm"]
        if not plan.variant:
            assert tiles.max() <= caps.tile_caps(0)["llm"]
        planned.update(plan.samples.tolist())
    assert 0 < variants.count(1) < len(variants) // 4  # long steps are few, and they come
    # Nothing lost: what was pulled from the stream is planned once, or still waits.
    pulled = Counter(stream_of(index, 0).take(0, planner.cursor).tolist())
    waiting = Counter(planner.deferred[:, 0].tolist())
    assert planned + waiting == pulled
    # Deterministic: a planner restored from a saved state plans the same steps.
    again = make_planner("orchestrated", index, caps, 0)
    again.set_state(states[30])
    first = make_planner("orchestrated", index, caps, 0)
    for _ in range(30):
        first.plan()
    for _ in range(20):
        a, b = first.plan(), again.plan()
        assert a.variant == b.variant
        np.testing.assert_array_equal(a.samples, b.samples)
        np.testing.assert_array_equal(a.offset, b.offset)


def test_with_a_degree_per_step_long_documents_go_to_the_long_steps_groups():
    """A context degree per step (issue 57): the base steps plan each device's own rows of
    2,048 tokens, the long ones groups of 2 devices (rows of 4,096), where the documents of
    ~3,000 tokens go though the base's tiles would hold them (its rows do not); every
    plan holds its variant's buckets, a long sample waits a bounded number of steps, what
    was pulled is planned once or still waits, and a planner resumed from a saved state
    plans the same steps. (Without the row bound in `rung_rows`
    the long samples wait for base steps that never take them: 23 steps, past LONG_WAIT.)"""
    index = rare_long()
    caps = dataclasses.replace(
        caps_of(index, long_tiles=({"llm": 2000, "vision": 0},)),
        llm_rows=2,
        llm_row_len=2048,
        tiles={"llm": 2400, "vision": 1100},
        long_context=2,
    )
    long_view = caps.at(1)
    assert (caps.at(0).llm_buckets, long_view.llm_buckets, long_view.group_row_len) == (4, 2, 4096)
    rungs = Ladder(caps).rungs(index.llm_tokens(PER_TOKEN), {})
    assert set(np.flatnonzero(rungs)) == set(range(0, len(index), 500))  # by their rows alone
    planner = make_planner("orchestrated", index, caps, 0)
    planned, variants, states = Counter(), [], []
    for _ in range(60):
        states.append(json.loads(json.dumps(planner.get_state())))
        plan = planner.plan()
        check_plan(plan, index, caps)  # (the variant's buckets: devices, or groups)
        variants.append(plan.variant)
        long = rungs[plan.samples] > 0
        assert plan.variant or not long.any()
        if plan.variant:
            assert plan.device.max() < 2 and long.any()  # (a group's bucket)
        assert planner.ages.max(initial=0) <= max(ladder.LONG_WAIT, planner.max_age)
        planned.update(plan.samples.tolist())
    assert 0 < variants.count(1) < len(variants) // 4
    pulled = Counter(stream_of(index, 0).take(0, planner.cursor).tolist())
    assert planned + Counter(planner.deferred[:, 0].tolist()) == pulled
    # Resumed from a saved state, the planner plans the same steps: from the first long step
    k = variants.index(1)
    again = make_planner("orchestrated", index, caps, 0)
    again.set_state(states[k])
    replay = make_planner("orchestrated", index, caps, 0)
    for _ in range(k):
        replay.plan()
    for _ in range(3):
        a, b = replay.plan(), again.plan()
        assert a.variant == b.variant
        for key in ("samples", "device", "row", "offset"):
            np.testing.assert_array_equal(getattr(a, key), getattr(b, key))


def test_a_step_is_long_when_enough_long_samples_wait_or_one_is_old():
    index = rare_long()
    caps = caps_of(index, long_tiles=({"llm": 9000, "vision": 0},))
    lad = Ladder(caps, wait=8)
    enough = int(np.ceil(ladder.BATCH * 2 * 4))  # (of 2 microbatches x 4 devices' buckets)
    since = np.full(enough, 10)
    assert lad.variant(12, since[1:], llm_levels(np.ones(enough - 1))) == 0
    assert lad.variant(12, since, llm_levels(np.ones(enough))) == 1
    assert lad.variant(17, since[:3], llm_levels([0, 1, 0])) == 1  # waited 7 = wait - 1 steps
    assert lad.variant(16, since[:3], llm_levels([0, 1, 0])) == 0


def llm_levels(levels) -> np.ndarray:
    """Per sample, its levels (`Ladder.sample_levels`) of LLM levels `levels`, the encoders'
    0."""
    out = np.zeros((len(levels), len(PHASES)), np.int64)
    out[:, PHASES.index("llm")] = levels
    return out


def long_in_each(n=3000, every=500, seed=0):
    """`rare_long`'s chats with one image each, of 2,048 patches in every `every` from
    `every` // 2 and in the first sample (also one of its long documents)."""
    rng = np.random.default_rng(seed)
    text = rng.integers(20, 100, n)
    text[::every] = rng.integers(2800, 3100, len(text[::every]))
    sizes = 64 * rng.integers(1, 5, n)
    sizes[every // 2 :: every] = sizes[0] = 2048
    return index_of(text, ragged(np.ones(n, np.int64), sizes))


def test_a_step_long_for_one_phase_computes_the_other_phases_base_tiles():
    """Per phase long variants (`ladder.phase_variants`, issue 57): a step long for its LLM
    documents computes the vision encoder's base tiles, one long for its large images the
    LLM's, and only a sample long in both (the first) waits for the variant that raises both;
    each phase's long steps come when its own long samples are BATCH a bucket, and the plans
    hold their variant's tiles with nothing lost. (One variant raising both phases, the rule
    before: every long step computed both phases' long tiles.)"""
    index = long_in_each()
    base = {"llm": 150, "vision": 1100, "audio": 0}
    top = {"llm": 1600, "vision": 2300}
    long = ladder.phase_variants(base, {}, top)  # (cheapest first: tiles over the base's)
    assert long == [{**base, "vision": 2300}, {**base, "llm": 1600}, {**base, **top}]
    mid = {"llm": 500, "vision": 1600}  # (with middle rungs: both middles before the tops)
    assert ladder.phase_variants(base, mid, top) == [
        {**base, "vision": 1600},
        {**base, "vision": 2300},
        {**base, "llm": 500},
        {**base, **mid},
        {**base, "llm": 1600},
        {**base, **top},
    ]
    caps = caps_of(index, tiles=base, long_tiles=tuple(long))
    caps = dataclasses.replace(caps, route_pair_capacity=512)  # (an image of 512 rows)
    lad, vision, llm, both = Ladder(caps), 1, 2, 3
    n = len(index)
    owner = np.repeat(np.arange(n), np.diff(index.items["vision"].ptr))
    rungs = lad.rungs(index.llm_tokens(PER_TOKEN), {"vision": (owner, index.items["vision"].sizes)})
    expect = np.zeros(n, np.int64)
    expect[::500], expect[250::500], expect[0] = llm, vision, both
    np.testing.assert_array_equal(rungs, expect)
    # a phase's long steps: its own long samples BATCH a bucket, or one of them old
    since = np.full(12, 2)
    assert lad.variant(3, since[:11], lad.levels[[llm] * 6 + [vision] * 5]) == llm
    assert lad.variant(3, since[:11], lad.levels[[vision] * 6 + [llm] * 5]) == vision
    assert lad.variant(3, since, lad.levels[[llm] * 6 + [vision] * 6]) == both
    assert lad.variant(20, since[:1], lad.levels[[both]]) == both  # (waited LONG_WAIT - 1)
    planner = make_planner("orchestrated", index, caps, 0)
    planned, variants = Counter(), []
    for _ in range(30):
        plan = planner.plan()
        check_plan(plan, index, caps)  # (within the step's variant's tiles)
        variants.append(plan.variant)
        assert (lad.levels[rungs[plan.samples]] <= lad.levels[plan.variant]).all()
        planned.update(plan.samples.tolist())
    assert {1, 2} <= set(variants)
    pulled = Counter(stream_of(index, 0).take(0, planner.cursor).tolist())
    assert planned + Counter(planner.deferred[:, 0].tolist()) == pulled


def test_sizing_gives_the_longest_documents_a_variant_instead_of_every_step():
    """On a long-tailed index the base capacity stays near the mean need and a long variant
    holds the longest document; without the ladder every step holds it."""
    from jaxmllm.bench.sizes import make_caps

    index = longtail(20000)
    caps = make_caps(index, 8, 32768, 2, "orchestrated", block=128)
    make = lambda c: make_planner("orchestrated", index, c, 0)
    least = largest_doc_tiles(index, caps)
    flat = size_tiles(make(caps), index, caps, 10, ladder=False)
    lad = size_tiles(make(caps), index, caps, 10)
    assert flat.long == () and flat.tiles["llm"] >= least["llm"]
    assert lad.long and lad.tiles["llm"] < 0.6 * least["llm"]
    top = dataclasses.replace(caps, tiles=lad.tiles, long_tiles=lad.long)
    assert top.tile_caps(top.variants - 1)["llm"] >= least["llm"]
    assert all(b["llm"] > 0 for b in rung_rows(top))
    # the longest sample is of the top rung, the median one of the base
    llm = index.llm_tokens(caps.per_token)
    rungs = Ladder(top).rungs(llm[[np.argmax(llm), np.argsort(llm)[len(llm) // 2]]], {})
    assert rungs.tolist() == [top.variants - 1, 0]
    # A context degree per step (groups of 4 in the long steps): a rank's long capacity is
    # its share of a group that holds the longest document and 3 devices' base buckets
    grouped = dataclasses.replace(caps, long_context=4)
    per_step = size_tiles(make(grouped), index, grouped, 10)
    held = dataclasses.replace(grouped, tiles=per_step.tiles, long_tiles=per_step.long)
    group = bucket_tile_caps(held.top, held.variants - 1)["llm"]
    assert group >= least["llm"] + 3 * per_step.tiles["llm"]
    assert per_step.long[-1]["llm"] < top.tile_caps(top.variants - 1)["llm"]


def test_sizing_a_degree_per_step_gives_the_groups_the_documents_a_device_row_cannot_hold():
    """A context degree per step (groups of 2 in the long steps) on chats that each fill most
    of a device's row (2 rows of 2,048 tokens) and a few of 2,050-2,200 tokens: their tiles
    are within the base's, so no long rung is sized for tiles' sake, but those documents fit
    no device's row: the sizing (as the resolver runs it, with the spec's long variant at the
    base's tiles while unsized) gives a long variant all the same, whose group holds them,
    so a planner takes the sizes. (Without it none is sized: a planner then refuses them.)"""
    rng = np.random.default_rng(0)
    text = rng.integers(1800, 2040, 600)
    text[::100] = rng.integers(2050, 2200, 6)
    index = index_of(text, ragged(np.zeros(600, np.int64), np.zeros(0, np.int64)))
    caps = dataclasses.replace(
        caps_of(index, long_tiles=({"llm": 0, "vision": 0},)),
        llm_rows=2,
        llm_row_len=2048,
        tiles={"llm": 0, "vision": 0},
        long_context=2,
    )
    make = lambda c: make_planner("orchestrated", index, c, 0)
    sizes = size_tiles(make(caps), index, caps, 10, ladder=True)
    held = dataclasses.replace(caps, tiles=sizes.tiles, long_tiles=sizes.long)
    top = bucket_tile_caps(held.top, held.variants - 1)["llm"]
    assert sizes.long and top >= largest_doc_tiles(index, caps)["llm"]
    make(held)  # (every document fits its variant: `check_tiles_fit`)


def test_a_base_of_few_blocks_still_holds_the_common_document():
    """Rows of 8 blocks (128 tokens of 16) and chats of 30-50 tokens, one in 16 of ~230, in
    groups of 2 in the long steps: a base sized by the density of the documents under its
    bound alone shrank until its bound (32 rows) missed the median chat, and every step was
    long (stop 71). The base's bound holds BODY of the documents, the median sample's rung is
    the base, and most steps of a run are base steps."""
    rng = np.random.default_rng(0)
    text = rng.integers(30, 50, 640)
    text[8::16] = rng.integers(220, 240, 40)
    index = index_of(text, ragged(np.zeros(640, np.int64), np.zeros(0, np.int64)))
    caps = dataclasses.replace(
        caps_of(index, devices=8, long_tiles=({"llm": 0, "vision": 0},)),
        microbatches=1,
        llm_row_len=128,
        attention_block=16,
        tiles={"llm": 0, "vision": 0},
        long_context=2,
    )
    make = lambda c: make_planner("orchestrated", index, c, 0)
    sizes = size_tiles(make(caps), index, caps, 10)
    held = dataclasses.replace(caps, tiles=sizes.tiles, long_tiles=sizes.long)
    bound = rung_rows(held)[0]["llm"]
    assert bound >= np.quantile(text, ladder.BODY)
    assert Ladder(held).rungs(np.array([int(np.median(text))]), {}).tolist() == [0]
    planner = make(held)
    variants = [planner.plan().variant for _ in range(12)]
    assert variants.count(0) > len(variants) // 2 and max(variants) > 0


def test_with_a_degree_per_step_long_images_keep_a_variant_of_groups_alone():
    """A context degree per step (groups of 2) on short chats with a large image in every
    500: the vision encoder gets its long variants (a middle one and a top) and the LLM,
    without a long rung for tiles' sake, one of groups at the base's tiles, first (the
    cheapest: a document longer than a device's row takes it, not a long vision step); the
    variant that would raise both is the vision top's twin, one compiled program, not two."""
    rng = np.random.default_rng(0)
    sizes = 64 * rng.integers(1, 5, 3000)
    sizes[250::500] = 2048
    index = index_of(rng.integers(20, 100, 3000), ragged(np.ones(3000, np.int64), sizes))
    caps = dataclasses.replace(
        caps_of(index, long_tiles=({"llm": 0, "vision": 0},)),
        route_pair_capacity=512,
        tiles={"llm": 0, "vision": 0},
        long_context=2,
    )
    got = size_tiles(make_planner("orchestrated", index, caps, 0), index, caps, 10, ladder=True)
    assert len(got.long) == 3 and len({tuple(r.items()) for r in got.long}) == 3
    assert got.long[0]["vision"] == got.tiles["vision"]  # (the LLM's groups alone)
    assert got.long[0]["vision"] < got.long[1]["vision"] < got.long[2]["vision"]


@pytest.mark.parametrize("context", [1, 2])
def test_capacities_of_a_config_carry_its_long_variants(context):
    from jaxmllm.config import load_config
    from jaxmllm.config.spec import BatchSpec
    from jaxmllm.resolve.sizing import capacities

    sets = [
        "batch.llm_tiles=20",
        "batch.vision_tiles=40",
        "batch.audio_tiles=4",
        "batch.llm_long_tiles=[30,60]",
        "batch.vision_long_tiles=[0,50]",
        "batch.audio_long_tiles=[]",
        "batch.route_pair_capacity=64",
        f"mesh.context={context}",
        "mesh.fsdp=1",
        f"mesh.data={8 // context}",
    ]
    cfg = load_config("configs/tiny.yaml", sets)
    caps = capacities(cfg, 8)
    assert caps.variants == 3
    assert [caps.tile_caps(v)["llm"] for v in range(3)] == [20, 30, 60]
    assert [caps.tile_caps(v)["vision"] for v in range(3)] == [40, 40, 50]
    assert [caps.tile_caps(v)["audio"] for v in range(3)] == [4, 4, 4]
    spec = BatchSpec.of(cfg)
    assert [spec.tile_caps(v)["llm"] for v in range(3)] == [20, 30, 60]
    with pytest.raises(Exception, match="llm_long_tiles"):
        load_config(
            "configs/tiny.yaml", ["batch.llm_long_tiles=[30,60]", "batch.vision_long_tiles=[50]"]
        )


def _records(n: int, every: int) -> list[dict]:
    """Text chats of ~40 tokens (byte tokenizer), one in `every` a document of ~230."""
    out = []
    for k in range(n):
        long = k % every == every // 2
        answer = " ".join(str(k % 10 + j) for j in range(80 if long else 8))
        out.append(
            {
                "id": f"r{k}",
                "messages": [
                    {"role": "user", "content": f"count from {k % 10}"},
                    {"role": "assistant", "content": answer},
                ],
            }
        )
    return out


@pytest.mark.slow  # ~2-3 minutes: two short runs of two compiled programs each
def test_a_run_with_rare_long_documents_trains_both_variants_and_resumes_exactly(
    tmp_path, caplog, monkeypatch
):
    """Text data with a rare document several times a step's mean tiles: auto sizing gives it a
    long variant; the run trains base and long steps, each program compiled once, finite
    losses; interrupted and rerun, it resumes exactly, and the ledger holds exactly what the
    planner planned (what it pulled from the stream, less what still waits)."""
    import logging

    import jax

    from jaxmllm.config import load_config
    from jaxmllm.data.index import build_index
    from jaxmllm.data.source import make_source
    from jaxmllm.loop import ledger
    from jaxmllm.loop.metrics import read_metrics
    from jaxmllm.resolve import sizing
    from jaxmllm.resolve.sizing import planner_from_config
    from jaxmllm.train import main

    monkeypatch.setattr(sizing, "LADDER_MIN_STEPS", 1)  # (a short run: a ladder all the same)
    monkeypatch.setattr(ladder, "LONG_WAIT", 4)  # (long steps within the run)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _records(400, 100)))
    steps = 12

    def config(out):
        sets = [
            "data.eval.source=none",
            "data.workers=0",
            "data.source=files",
            f"data.path={data}",
            "batch.llm_row_len=256",
            "batch.attention_block=16",
            "batch.microbatches=2",
        ]
        cfg = load_config("configs/manifest_example.yaml", sets)
        train = dict(steps=steps, output_dir=str(out), log_every=1, checkpoint_every=2)
        return dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, progress_bar=False, ledger=True, **train)
        )

    out = tmp_path / "run"
    build_index(config(out), progress=False)

    def interrupt_at_7(step, _):
        if step == 7:
            raise KeyboardInterrupt

    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING):
            with pytest.raises(KeyboardInterrupt):
                main(config(out), on_step=interrupt_at_7)
            first = sum("Compiling jit(train_step)" in r.getMessage() for r in caplog.records)
            caplog.clear()
            main(config(out))  # resumes from the step-6 checkpoint
            second = sum("Compiling jit(train_step)" in r.getMessage() for r in caplog.records)
    finally:
        jax.config.update("jax_log_compiles", False)
    resolved = json.loads((out / "config.json").read_text())["batch"]
    assert resolved["llm_long_tiles"] and resolved["llm_long_tiles"][-1] > resolved["llm_tiles"]
    assert first == 2 and second <= 2  # one program per variant a run uses
    losses = {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}
    assert sorted(losses) == list(range(1, steps + 1)) and np.isfinite(list(losses.values())).all()
    # The planner's plans, replayed: both variants, and the ledger holds exactly them.
    cfg = config(out)
    cfg = dataclasses.replace(
        cfg,
        batch=dataclasses.replace(
            cfg.batch, **{k: tuple(v) if isinstance(v, list) else v for k, v in resolved.items()}
        ),
    )
    _, index = make_source(cfg)
    planner = planner_from_config(cfg, index, 8)  # (data x fsdp: 8 buckets)
    plans = [planner.plan() for _ in range(steps)]
    # base steps and long ones: which long variant depends on the sizing's dry run (a mapped
    # index's epoch order is the index shuffle's; with a middle variant sized, the longest
    # documents here go to the top one), each a program compiled once (above)
    used = {p.variant for p in plans}
    assert 0 in used and len(used) == 2 and max(used) <= len(resolved["llm_long_tiles"])
    assert ledger.check_replays(out) == []  # step 7, redone, trained the same samples
    audit = ledger.audit(out, range(1, steps + 1))
    planned = Counter(s for p in plans for s in p.samples.tolist())
    assert audit["missing_steps"] == [] and audit["text"] == planned
    pulled = Counter(stream_of(index, cfg.data.seed).take(0, planner.cursor).tolist())
    assert planned + Counter(planner.deferred[:, 0].tolist()) == pulled


@pytest.mark.parametrize("chunk", [7, 1 << 22])
def test_the_summary_holds_the_index_extremes_and_its_longest_samples(monkeypatch, chunk):
    """Exact extremes and the longest samples by each measure, however the pass is chunked;
    the body is a uniform sample of SAMPLE samples (the whole index when smaller)."""
    from jaxmllm.bench.tails import chats_mix
    from jaxmllm.plan import summary

    monkeypatch.setattr(summary, "CHUNK", chunk)
    monkeypatch.setattr(summary, "TAIL", 5)
    monkeypatch.setattr(summary, "SAMPLE", 300)
    index = chats_mix(1, 1000)
    got = summary.summarize(index, PER_TOKEN)
    llm = index.llm_tokens(PER_TOKEN)
    units = index.units()
    assert got.most["llm"] == llm.max() and got.least["llm"] == llm[llm > 0].min()
    for p in ("vision", "audio"):
        sizes = index.items[p].sizes
        assert got.most[p] == sizes.max() and got.least[p] == sizes[sizes > 0].min()
        assert got.most_units[p] == units[p].max()
        assert set(np.argsort(-units[p], kind="stable")[:5]) <= set(got.tail_ids)
    assert set(np.argsort(-llm, kind="stable")[:5]) <= set(got.tail_ids)
    np.testing.assert_array_equal(got.tail.llm_tokens(PER_TOKEN), llm[got.tail_ids])
    assert len(got.body) == 300 and got.scale == 1000 / 300
    np.testing.assert_array_equal(got.body.text, index.text[got.body_ids])
    small = summary.summarize(chats_mix(1, 200), PER_TOKEN)
    assert small.whole and len(small.body) == 200


# ----------------------------------------------------------------------------- windowed lists


def test_the_windowed_lists_capacity_is_the_batchs():
    """`window_cap` from a planner's capacities and the LLM's weights is the capacity the
    batch gives the sliding-window layers' list (`bucketize.window_tile_cap`): the band
    binds at 40 causal tiles, the causal capacity at 8; none without a window."""
    from jaxmllm.batch.bucketize import window_tile_cap
    from jaxmllm.config import load_config
    from jaxmllm.config.spec import BatchSpec

    window = ["model.llm.depth=6", "model.llm.window.size=16", "model.llm.window.every=6"]
    for llm_tiles in (40, 8):
        tiles = [f"batch.llm_tiles={llm_tiles}", "batch.vision_tiles=10", "batch.audio_tiles=10"]
        more = ["model.attention=block_sparse", "batch.route_pair_capacity=8", *tiles]
        spec = BatchSpec.of(load_config("configs/tiny.yaml", window + more))
        caps = Capacities.of(spec, 8)
        weight = TileWeights(1.0, 1.0, 1.0, spec.window)
        assert window_cap(caps, llm_tiles, weight) == window_tile_cap(spec) == min(llm_tiles, 11)
        assert window_cap(caps, llm_tiles, TileWeights(1.0, 1.0)) == 0


def test_the_goodput_counts_the_windowed_tiles_over_their_lists_capacity():
    """Weights where only the windowed layers' tiles cost: a plan's goodput is the windowed
    tiles its documents need (fewer than their causal ones: ~3,000-token documents, a window
    of 64) over the band a bucket of 1,300 causal tiles holds (127 here); the ladder weighs a
    causal tile at the full layers' alone where the band binds (its cost spread over the
    row), at both where the windowed list is as long as the causal one."""
    index = rare_long(600, every=50)
    caps = caps_of(index, tiles={"llm": 1300, "vision": 1100})
    window = TileWeights(0.0, 0.0, 1.0, 64)
    assert window_cap(caps, 1300, window) == 127  # (64 blocks a row, each and the one before)
    assert window_cap(caps, 100, window) == 100
    assert flop_share(np.zeros(3), {}, caps, {"llm": 1300}, 2, {"llm": window}, 127.0) == 0.5
    make = lambda c: make_planner("orchestrated", index, c, 0)  # noqa: E731
    need, causal, planner = 0.0, 0.0, make(caps)
    for _ in range(3):
        plan = planner.plan()
        need += float(step_window_tiles(plan, index, caps, 64).sum())
        causal += float(step_tiles(plan, index, caps)["llm"].sum())
    assert 0 < need < causal
    buckets = 3 * caps.microbatches * caps.devices
    weights = {"llm": window, "vision": (0.0, 0.0), "audio": (0.0, 0.0)}
    assert goodput(make(caps), index, caps, 3, weights) == pytest.approx(need / (buckets * 127))
    both = {"llm": TileWeights(1.0, 2.0, 3.0, 64)}
    rows = {"llm": 4096}
    assert ladder_weights(both, caps, {"llm": 150}, rows)["llm"] == pytest.approx(
        (1.0 + 3.0 * 127 / 4096, 2.0)
    )
    assert ladder_weights(both, caps, {"llm": 100}, rows)["llm"] == pytest.approx((1.0, 5.0))
