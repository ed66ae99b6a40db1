"""The planners through the registry: the contract on random workloads, resume, the registry
and config, the balancer's behaviours (routing, window, selection), the balance bench."""

from __future__ import annotations

import dataclasses as dc
import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxmllm.bench.mixes import from_arrays, synthetic_omni
from jaxmllm.config import ModelConfig, load_config
from jaxmllm.cost.model import CostModel
from jaxmllm.plan.balancer import MANY_BUCKETS
from jaxmllm.plan.contract import Capacities, OversizeError, check_plan
from jaxmllm.plan.registry import PLANNERS
from jaxmllm.plan.select import BINDING, HEADROOM, Selector
from jaxmllm.plan.stream import SampleStream
from jaxmllm.resolve.capacity import suggest_capacities

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

MERGE_AREA, SUBSAMPLE = 4, 4
PER_TOKEN = {"vision": MERGE_AREA, "audio": SUBSAMPLE}  # (units per LLM token)
PER_ROW = {"vision": 1, "audio": SUBSAMPLE}  # (units per encoder row: the pairs stem)
SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def workloads(draw, policy: str):
    n = draw(st.integers(1, 30))
    text = draw(st.lists(st.integers(1, 60), min_size=n, max_size=n))  # >= BOS
    images = [
        np.array(draw(st.lists(st.integers(1, 16), max_size=3)), np.int64) * MERGE_AREA
        for _ in range(n)
    ]
    audio = [
        np.array(draw(st.lists(st.integers(1, 16), max_size=1)), np.int64) * SUBSAMPLE
        for _ in range(n)
    ]
    index = from_arrays(np.array(text), images, audio)
    llm = index.llm_tokens(PER_TOKEN)
    vis = index.items["vision"].per_sample()
    aud = index.items["audio"].per_sample()
    slack = draw(st.integers(0, 64))
    route = 0
    if policy == "orchestrated":
        route = draw(st.integers(16, 40))
    rows = 1 if policy == "grain" else draw(st.integers(1, 2))
    caps = Capacities(
        microbatches=draw(st.integers(1, 2)),
        devices=draw(st.integers(1, 4)),
        llm_rows=rows,
        llm_row_len=max(int(llm.max()), 1) + slack,
        units={
            "vision": 4 * ((int(vis.max()) + 4 * slack) // 4 + 1),
            "audio": 4 * ((int(aud.max()) + 4 * slack) // 4 + 1),
        },
        per_token=PER_TOKEN,
        per_row=PER_ROW,
        route_pair_capacity=route,
        devices_per_host=draw(st.integers(0, 2)),  # (routing within a host first)
    )
    seed = draw(st.integers(0, 3))
    return index, caps, seed


def one_by_one(planner, steps: int):
    """Yields each plan as it is made (the planner's `ages` and state are that plan's)."""
    for _ in range(steps):
        yield planner.plan()


def run(planner, steps: int):
    plans = []
    for _ in range(steps):
        plans.append(planner.plan())
    return plans


def same_plan(a, b) -> bool:
    fields = ("samples", "micro", "device", "row", "offset")
    if any(not np.array_equal(getattr(a, f), getattr(b, f)) for f in fields):
        return False
    return all(
        np.array_equal(getattr(a.items[p], f), getattr(b.items[p], f))
        for p in ("vision", "audio")
        for f in ("owner", "item", "device", "offset")
    )


@pytest.mark.parametrize("policy", list(PLANNERS))
@SETTINGS
@given(data=st.data())
def test_plans_honour_capacities_and_routing(policy, data):
    index, caps, seed = data.draw(workloads(policy))
    planner = PLANNERS[policy](index, caps, seed)
    for plan in one_by_one(planner, 6):
        check_plan(plan, index, caps)  # capacities, no overlap, items placed once, routes
        assert len(planner.ages) == len(plan.samples) and (planner.ages >= 0).all()


@pytest.mark.parametrize("policy", ["orchestrated", "balanced"])
@SETTINGS
@given(data=st.data())
def test_every_sample_once_and_progress(policy, data):
    index, caps, seed = data.draw(workloads(policy))
    planner = PLANNERS[policy](index, caps, seed)
    planned = Counter()
    for plan in one_by_one(planner, 3 * len(index) + 4):
        planned.update(plan.samples.tolist())
    waiting = Counter(planner.deferred[:, 0].tolist())
    pulled = Counter(planner.stream.take(0, planner.cursor).tolist())
    assert planned + waiting == pulled  # nothing lost, nothing twice
    assert planner.cursor >= 2 * len(index)  # it made progress over whole epochs
    # The age bound is not asserted here: on random tiny workloads it does not hold (a sample
    # of 2 devices' buckets of 108 tokens waited 10 steps against max_age 4; one that fills a
    # whole microbatch now goes alone and holds others back). test_age_bound_holds_after_every
    # _plan pins a case and fails once the planner keeps its bound. Nothing is lost, above.


def test_age_bound_holds_after_every_plan():
    """No sample waits more than max_age steps, after every plan. A case where it did not
    hold: urgent samples that did not fit the emptiest buckets waited again (17 samples, so
    the window holds a sample twice, and one needing 80 of a device's 92 patches); a
    microbatch whose placement left out a share of what it selected is now selected again
    with more room (`balancer.RETRY_FILL`), and they fit. (On random tiny workloads the bound
    can still slip: test_every_sample_once_and_progress.)"""
    index = from_arrays(
        np.ones(17, np.int64),
        [np.array(x, np.int64) for x in ([4, 4, 60], [4, 4, 12], [], [], [], [])]
        + [np.array([24, 44, 12])]
        + [np.zeros(0, np.int64)] * 10,
        [np.zeros(0, np.int64)] * 17,
    )
    caps = Capacities(1, 2, 1, 23, {"vision": 92, "audio": 12}, PER_TOKEN, PER_ROW, 16)
    planner = PLANNERS["orchestrated"](index, caps, 0)
    for plan in one_by_one(planner, 3 * len(index) + 4):
        check_plan(plan, index, caps)
        assert planner.ages.max(initial=0) <= planner.max_age


@pytest.mark.parametrize("policy", list(PLANNERS))
@SETTINGS
@given(data=st.data(), k=st.integers(0, 4))
def test_pure_function_and_resume(policy, data, k):
    index, caps, seed = data.draw(workloads(policy))
    a = PLANNERS[policy](index, caps, seed)
    b = PLANNERS[policy](index, caps, seed)
    plans_a = run(a, k)
    assert all(same_plan(x, y) for x, y in zip(plans_a, run(b, k), strict=True))
    state = json.loads(json.dumps(a.get_state()))  # JSON-able
    after = run(a, 3)
    c = PLANNERS[policy](index, caps, seed)
    c.set_state(state)
    assert all(same_plan(x, y) for x, y in zip(after, run(c, 3), strict=True))


def test_stream_slices_match_their_definition():
    """The sliced epoch stream equals the plain definition."""
    stream = SampleStream(7, seed=3)
    for start, count in [(0, 0), (0, 5), (3, 20), (13, 1), (6, 8), (40, 15)]:
        pos = np.arange(start, start + count)
        want = [np.random.default_rng([3, p // 7]).permutation(7)[p % 7] for p in pos]
        assert np.array_equal(stream.take(start, count), np.array(want, np.int64))


def suggested_caps(sug, devices: int, route: int) -> Capacities:
    """Two microbatches of `devices` buckets of the suggested capacities."""
    return Capacities(
        microbatches=2,
        devices=devices,
        llm_rows=sug.llm_rows,
        llm_row_len=sug.llm_row_len,
        units=sug.units,
        per_token=PER_TOKEN,
        per_row=PER_ROW,
        route_pair_capacity=route,
    )


def test_orchestrated_needs_routing_and_balances_better():
    index = synthetic_omni(3000, seed=1)
    sug = suggest_capacities(index, 8192, PER_TOKEN, per_row=PER_ROW)
    unrouted = suggested_caps(sug, 8, 0)
    with pytest.raises(OversizeError, match="route_pair_capacity"):
        PLANNERS["orchestrated"](index, unrouted, 0)
    caps = suggested_caps(sug, 8, sug.units["vision"] // MERGE_AREA)
    fills = {}
    for name, c in (("orchestrated", caps), ("naive", unrouted)):
        planner = PLANNERS[name](index, c, 0)
        work = 0
        for plan in run(planner, 8):
            check_plan(plan, index, c)
            work += index.llm_tokens(PER_TOKEN)[plan.samples].sum()
        fills[name] = work / (8 * 2 * 8 * sug.llm_rows * sug.llm_row_len)
    assert fills["orchestrated"] > 0.85 > 0.5 > fills["naive"]


@pytest.mark.parametrize("route", ["whole", "tight"])
def test_many_buckets_contract_and_coarser_window(route):
    """Beyond MANY_BUCKETS buckets the planner skips the slack pass and shrinks its window;
    plans still honour every capacity and route, every pulled sample is planned once or
    waits, and no sample waits longer than max_age (2 x 80 devices, omni-like data, with a
    route capacity of a whole device's output and with the largest item's rows)."""
    index = synthetic_omni(6000, seed=3)
    sug = suggest_capacities(index, 4096, PER_TOKEN, per_row=PER_ROW)
    route_rows = sug.units["vision"] // MERGE_AREA
    tight = max(
        index.items["vision"].sizes.max() // MERGE_AREA,
        index.items["audio"].sizes.max() // SUBSAMPLE,
    )  # (largest)
    caps = suggested_caps(sug, 80, route_rows if route == "whole" else tight)
    planner = PLANNERS["orchestrated"](index, caps, 1)
    assert 2 * 80 > MANY_BUCKETS and not planner.slack_pass
    assert planner.lookahead == pytest.approx(0.5 * (MANY_BUCKETS / 160) ** 0.5)
    planned = Counter()
    for plan in one_by_one(planner, 10):
        check_plan(plan, index, caps)
        planned.update(plan.samples.tolist())
        assert planner.ages.max(initial=0) <= planner.max_age
    waiting = Counter(planner.deferred[:, 0].tolist())
    assert planned + waiting == Counter(planner.stream.take(0, planner.cursor).tolist())


def test_nonbinding_phase_takes_its_share_of_each_microbatch():
    """A phase that does not bind (omni's vision) takes at most its long-run share of a
    microbatch plus a third of the rest, so that the next microbatch is not left short of
    it; the binding phases may fill their capacity."""
    index = synthetic_omni()  # (the bench's omni mix and capacities: vision does not bind)
    sug = suggest_capacities(index, 32768, PER_TOKEN, per_row=PER_ROW, match_llm=True)
    caps = suggested_caps(sug, 8, sug.units["vision"] // MERGE_AREA)
    planner = PLANNERS["orchestrated"](index, caps, 0)
    share, micro_cap = planner.selector.share, planner.selector.micro_cap
    assert share[1] < BINDING and (micro_cap[[0, 2]] == 1).all()
    assert micro_cap[1] == pytest.approx(share[1] + HEADROOM * (1 - share[1]))
    vision = index.items["vision"].per_sample()
    for plan in run(planner, 6):
        check_plan(plan, index, caps)
        for m in range(2):
            took = vision[plan.samples[plan.micro == m]].sum()
            # (the first selection keeps to the cap, the slack pass adds a sliver: here <= 0.2%;
            # without the cap the first microbatch takes up to 99.7% and the second 94%)
            assert took <= (micro_cap[1] + 0.005) * 8 * caps.units["vision"]


def test_selection_trades_text_for_a_short_binding_phase(monkeypatch):
    """Text-only chats ahead of audio clips in the stream fill the LLM bucket and leave audio
    (binding) short: the swap brings the window's clips in and defers chats instead; every
    capacity holds and nothing is lost."""
    n = 400
    chat = np.arange(n) < 200
    text = np.where(chat, 256, 28)  # (a clip: 28 + 400 / 4 = 128 LLM tokens)
    audio = [np.zeros(0, np.int64) if c else np.array([400]) for c in chat]
    index = from_arrays(text, [np.zeros(0, np.int64)] * n, audio)
    caps = Capacities(1, 4, 1, 1024, {"vision": 0, "audio": 1024}, PER_TOKEN, PER_ROW, 256)
    order = np.concatenate([np.arange(18), np.arange(200, 400), np.arange(18, 200)])

    def audio_of_first_plan():
        planner = PLANNERS["orchestrated"](index, caps, 0, lookahead=0.25)
        planner.stream.take = lambda start, count: order[start : start + count]
        plan = planner.plan()
        check_plan(plan, index, caps)
        pool = len(plan.samples) + len(planner.deferred)
        assert len(np.unique(np.concatenate([plan.samples, planner.deferred[:, 0]]))) == pool
        return planner.phases.of(plan.samples).work.sum(0)

    got = audio_of_first_plan()
    monkeypatch.setattr(Selector, "swap", lambda *a: None)
    without = audio_of_first_plan()
    assert (without[2], got[2]) == (400, 1600)  # (the window: 4 clips behind 18 chats)
    assert got[0] <= 4 * 1024 and got[0] >= 0.9 * without[0]


def test_equal_tiles_fill_whole_buckets():
    """Tiles of one size trade devices for locality without costing a tile of room: buckets
    of 112 tiles take all 112 (keeping 0.3% of a bucket back for the exchanges cost one)."""
    tiles, devices, n = 112, 8, 2000
    index = from_arrays(np.full(n, 8), [np.array([1024])] * n, [np.zeros(0, np.int64)] * n)
    units = {"vision": tiles * 1024, "audio": 0}
    caps = Capacities(1, devices, 1, 1 << 16, units, PER_TOKEN, PER_ROW, tiles * 256)
    plan = PLANNERS["orchestrated"](index, caps, 0).plan()
    check_plan(plan, index, caps)
    per_device = np.bincount(plan.items["vision"].device, minlength=devices)
    assert per_device.max() == tiles and per_device.min() >= tiles - 1


def test_routing_tables_are_a_bijection():
    """Through the real pipeline: every encoder output row fills exactly one placeholder."""
    from jaxmllm.feed.iterator import make_pipeline
    from jaxmllm.resolve.run import resolve_run

    cfg = load_config(
        None,
        [
            "model.vision.patch_size=4",
            "model.vision.width=32",
            "model.vision.heads=2",
            "model.audio.n_mels=16",
            "batch.llm_rows=2",
            "batch.llm_row_len=160",
            "batch.attention_block=32",
            "batch.vision_patches=512",
            "batch.audio_frames=128",
            "batch.microbatches=2",
            "batch.route_pair_capacity=128",
            "batch.planner=orchestrated",
            "batch.devices_per_host=2",  # (two hosts: routing within a host first)
            "data.source=synthetic",
            "data.synthetic.num_samples=256",
        ],
    )
    it = make_pipeline(resolve_run(cfg, 4), prefetch=0)
    routed = 0
    for _ in range(3):
        batch = next(it)["batch"]
        for phase, per in (("vision", 4), ("audio", 4)):
            seg = batch[f"{phase}_segment_ids"]  # [M, D, P]
            send = batch[f"{phase}_send"]  # [M, D(src), D(dst), C]
            src = batch[f"llm_{phase}_src"]  # [M, D, R, L]
            m_n, d_n, c = send.shape[0], send.shape[1], send.shape[3]
            for m in range(m_n):
                real_rows = {
                    (s, r)
                    for s in range(d_n)
                    for r in np.flatnonzero(seg[m, s, ::per] > 0).tolist()
                }
                used = []
                n_own = seg.shape[2] // per  # [own projector rows | received rows (D*C)]
                for d in range(d_n):
                    for v in src[m, d][src[m, d] >= 0].tolist():
                        if v < n_own:
                            used.append((d, v))
                            continue
                        s, slot = divmod(v - n_own, c)
                        assert s != d  # a local item never goes through the exchange
                        used.append((s, int(send[m, s, d, slot])))
                        routed += 1
                assert len(used) == len(set(used)) == len(real_rows)
                assert set(used) == real_rows
    assert routed > 0


def test_balance_benchmark_runs():
    """The bench on a small omni mix: orchestrated fills the buckets, keeps the slowest
    device's attention cost within 3% of what any plan of those samples could (1.023 vs a
    bound of 1.011 here), far under naive's (~3x), and beats random dealing."""
    from jaxmllm.bench.balance import run_policy

    index = synthetic_omni(2000, seed=3)
    cost = CostModel.from_model(ModelConfig())
    row, _ = run_policy("orchestrated", index, 8, 16384, 2, 3, cost)
    naive, _ = run_policy("naive", index, 8, 16384, 2, 3, cost)
    assert row["fill"]["llm"] > 0.95 and row["max_age"] <= 4
    assert row["quad_max_mean"] <= 1.03 * row["quad_bound"]
    assert naive["quad_max_mean"] > 1.5 * row["quad_max_mean"]
    assert row["random_cv"] > 2 * row["micro_cv"] > 0


@pytest.mark.slow  # ~8 s: three sized runs of the bench
def test_balance_bench_rows_with_context_groups():
    """`bench.balance --policies groups,long_groups` (issue 57) on a long-tailed index: with a
    context degree per step the base steps keep a device's capacity and a rank's long
    capacity is its share of a group's, below the long variant's without groups (without
    the groups' view a rank held the group's whole: 7987 against 6139); a grouped step's
    LLM loads are its ranks' shares (spread over the group the attention balance stays near
    1; piled on one device per group it read 1.44, and 2.3 on docqa). (Goodput at this size
    is no measure: 6 steps; the bench's rows at 200k samples are in docs/long-tails.md.)"""
    from jaxmllm.bench.balance import run_policy
    from jaxmllm.bench.tails import longtail

    index = longtail(4000)
    cost = CostModel.from_model(ModelConfig())
    run = lambda groups: run_policy(
        "orchestrated", index, 8, 8192, 2, 6, cost, 0, 128, groups=groups
    )
    alone, per_step, every = run((1, 0))[0], run((1, 4))[0], run((4, 0))[0]
    assert per_step["long_steps"] > 0 and every["long_steps"] == 0
    assert per_step["tile_capacity"] == alone["tile_capacity"]  # (the base: a device's rows)
    assert per_step["tile_capacity_long"] < alone["tile_capacity_long"]
    assert max(per_step["quad_max_mean"], every["quad_max_mean"]) < 1.05


def test_a_config_s_patches_repatch_the_built_in_mixes():
    """`bench.balance --config`: the built-in mixes' images (14 px patches) in the config's
    patches, the same pixels: Qwen3-VL's 16 px patches take (14 / 16)^2 of them, in whole
    merge blocks (at least one), the text unchanged."""
    from jaxmllm.bench.mixes import repatched

    index = synthetic_omni(500, seed=1)
    again = repatched(index, 16, 2)
    before, after = index.items["vision"].sizes, again.items["vision"].sizes
    assert (after % 4 == 0).all() and (after >= 4).all() and len(after) == len(before)
    assert abs(after.sum() / before.sum() - (14 / 16) ** 2) < 0.02
    assert (again.text == index.text).all()
    assert (repatched(index, 14, 2).items["vision"].sizes == before).all()  # (no change)


def test_one_registry_names_the_planners():
    """config validates batch.planner against the registry; unknown names say which exist."""
    from jaxmllm.config import ConfigError
    from jaxmllm.plan.registry import make_planner

    for name in PLANNERS:
        assert load_config(None, [f"batch.planner={name}"]).batch.planner == name
    with pytest.raises(ConfigError, match="first_fit"):
        load_config(None, ["batch.planner=best_fit"])
    index = synthetic_omni(100, seed=0)
    caps = suggested_caps(suggest_capacities(index, 8192, PER_TOKEN, per_row=PER_ROW), 2, 0)
    with pytest.raises(ValueError, match="unknown planner 'best_fit'.*first_fit"):
        make_planner("best_fit", index, caps, 0)


def test_config_names_the_planners_the_registry_has():
    """config sits below the planners, so it validates batch.planner against its own list of
    names: the registry must implement exactly those."""
    from jaxmllm.config.sections import PLANNER_NAMES

    assert tuple(PLANNERS) == PLANNER_NAMES


def test_lengths_files_are_rounded_as_the_pipeline_rounds_and_bad_lines_named(tmp_path, capsys):
    """Audio frame counts off the subsampling factor and image patches off the merge area are
    rounded down (what the pipeline does to real media), items that vanish are dropped and
    counted, the bench plans the result without raising; a malformed record names its line."""
    from jaxmllm.bench.balance import main
    from jaxmllm.bench.mixes import load_lengths

    rng = np.random.default_rng(0)
    lines = [{"text": 3, "audio": [3]}, {"images": [2]}]  # both vanish: audio 3 -> 0, image 2 -> 0
    for _ in range(400):
        lines.append(
            {
                "text": int(rng.integers(1, 400)),
                "images": [int(x) for x in rng.integers(1, 3000, int(rng.integers(0, 3)))],
                "audio": [int(x) for x in rng.integers(1, 2000, int(rng.integers(0, 2)))],
            }
        )
    path = tmp_path / "odd.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    index = load_lengths(path)
    assert len(index) == len(lines) - 1  # {"images": [2]} has no LLM token left
    assert (index.items["audio"].sizes % SUBSAMPLE == 0).all() and (
        index.items["audio"].sizes > 0
    ).all()
    assert (index.items["vision"].sizes % MERGE_AREA == 0).all() and (
        index.items["vision"].sizes > 0
    ).all()
    assert index.text[0] == 3 and index.items["audio"].ptr[1] == 0  # the 3-frame clip is gone
    raw = [x for rec in lines for x in rec.get("audio", [])]
    assert sorted(index.items["audio"].sizes.tolist()) == sorted(x // 4 * 4 for x in raw if x >= 4)
    out = tmp_path / "rows.json"
    args = ["--lengths", str(path), "--devices", "8", "--policies", "orchestrated,grain"]
    assert main(args + ["--tokens", "8192", "--max-steps", "6", "--json", str(out)]) == 0
    assert [r["policy"] for r in json.loads(out.read_text())] == ["orchestrated", "grain"]

    for bad, what in [
        ('{"text": -1}', "text must be a count"),
        ('{"text": 3, "audio": [850.5]}', "audio must be a list of frame counts"),
        ('{"text": 3, "images": 1024}', "images must be a list of patch counts"),
        ('{"txt": 3}', r"unknown field\(s\) \['txt'\]"),
        ("[1, 2]", "expected an object"),
    ]:
        path.write_text('{"text": 5}\n' + bad + "\n")
        with pytest.raises(ValueError, match=rf"odd.jsonl:2: {what}"):
            load_lengths(path)
        assert main(["--lengths", str(path), "--devices", "8"]) == 2
        assert "odd.jsonl:2" in capsys.readouterr().err


def test_random_workloads_are_a_family_and_the_bench_summarizes_them(tmp_path, capsys):
    """random_mix: deterministic per seed, different across seeds, lengths on the phases'
    granularity, every sample within the bench's rows; the bench runs the family and prints
    the distribution of its figures."""
    from jaxmllm.bench import family
    from jaxmllm.bench.balance import main
    from jaxmllm.bench.mixes import random_mix

    a, b, c = random_mix(5, 3000), random_mix(5, 3000), random_mix(6, 3000)
    assert (a.text == b.text).all() and all(
        (a.items[k].sizes == b.items[k].sizes).all() for k in a.items
    )
    assert len(a.items["vision"]) != len(c.items["vision"]) or (a.text != c.text).any()
    for ix in (a, c):
        assert (ix.items["audio"].sizes % SUBSAMPLE == 0).all() and (
            ix.items["vision"].sizes % MERGE_AREA == 0
        ).all()
        assert ix.llm_tokens(PER_TOKEN).max() <= 32768 and ix.text.max() <= 16384
    out = tmp_path / "rows.json"
    args = ["--random", "2", "--seed", "3", "--devices", "8", "--policies", "orchestrated,grain"]
    assert main(args + ["--max-steps", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert sorted({r["mix"] for r in rows}) == ["random:3", "random:4"]
    summaries = family.summarize(rows)
    assert {(s["policy"], s["mixes"]) for s in summaries} == {("orchestrated", 2), ("grain", 2)}
    printed = capsys.readouterr().out
    assert "over 2 random workloads" in printed and family.table(summaries) in printed


def test_host_aware_routing_keeps_encoder_rows_on_their_host():
    """With 8 devices a host (64 devices, omni-like data), orchestrated routes fewer encoder
    rows across hosts than host-blind routing and more within them, with the same fill, and
    its plans honour the contract (every item once, each pair within its route capacity)."""
    from jaxmllm.plan.contract import item_rows

    index = synthetic_omni(20000, seed=2)
    sug = suggest_capacities(index, 32768, PER_TOKEN, per_row=PER_ROW)
    base = suggested_caps(sug, 64, sug.units["vision"] // MERGE_AREA)
    share, fill = {}, {}
    for per_host in (0, 8):
        caps = dc.replace(base, devices_per_host=per_host)
        rows = np.zeros(3)  # all, routed within a host, routed across hosts
        llm = 0
        for plan in run(PLANNERS["orchestrated"](index, caps, 0), 3):
            check_plan(plan, index, caps)
            llm += index.llm_tokens(PER_TOKEN)[plan.samples].sum()
            for p in ("vision", "audio"):
                it, r = plan.items[p], item_rows(plan, index, caps, p)
                home = plan.device[it.owner]
                across = it.device // 8 != home // 8
                rows += [r.sum(), r[(it.device != home) & ~across].sum(), r[across].sum()]
        share[per_host], fill[per_host] = rows[1:] / rows[0], llm
    assert share[8][1] < 0.75 * share[0][1] and share[8][0] > share[0][0]
    assert fill[8] >= 0.995 * fill[0]


def test_route_capacity_from_the_planners_traffic_is_held():
    """The per-pair route capacity sized from a dry run of the planner's plans is at least
    the largest item's rows and far below a device's whole output; the planner holds it
    over a longer run (samples wait rather than overflow a pair), and nothing is lost."""
    from jaxmllm.plan.contract import pair_rows
    from jaxmllm.resolve.capacity import largest_item_rows, route_capacity, whole_output_rows

    index = synthetic_omni(6000, seed=4)
    sug = suggest_capacities(index, 4096, PER_TOKEN, per_row=PER_ROW)
    free = dc.replace(suggested_caps(sug, 16, 1), devices_per_host=4)
    free = dc.replace(free, route_pair_capacity=whole_output_rows(free))
    pair = route_capacity(PLANNERS["orchestrated"](index, free, 1), index, free, 2, 3)
    assert largest_item_rows(index, free) <= pair < whole_output_rows(free)
    caps = dc.replace(free, route_pair_capacity=pair)
    planner = PLANNERS["orchestrated"](index, caps, 0)  # (another seed: not the dry run's)
    planned, most = Counter(), 0
    for plan in one_by_one(planner, 6):
        check_plan(plan, index, caps)  # (raises past the route capacity)
        most = max(
            most, *(pair_rows(plan, index, caps, p).max(initial=0) for p in ("vision", "audio"))
        )
        planned.update(plan.samples.tolist())
    assert 0.5 * pair < most <= pair
    waiting = Counter(planner.deferred[:, 0].tolist())
    assert planned + waiting == Counter(planner.stream.take(0, planner.cursor).tolist())


@pytest.mark.parametrize("context", [1, 2])
@pytest.mark.parametrize("dense_pairs", [0, 1 << 24])
def test_routes_hold_the_route_capacity_as_items_one_by_one(monkeypatch, dense_pairs, context):
    """`route.Routes` (a table of rows per pair up to DENSE_PAIRS pairs, sorted pairs beyond)
    flags the items a pair cannot carry as counting them one by one would, rows already
    routed by earlier placements first."""
    from jaxmllm.plan import route

    monkeypatch.setattr(route, "DENSE_PAIRS", dense_pairs)
    devices, per_row, capacity = 6, 2, 20
    routes = route.Routes(devices, per_row, capacity, bucket=1000, context=context)
    carried = Counter()
    rng = np.random.default_rng(0)
    for _ in range(5):  # placements of one microbatch
        n = int(rng.integers(0, 30))
        size = rng.integers(1, 16, n)
        dev, home = rng.integers(0, devices, (2, n))
        # (src, dst): with context groups the text's group; an item in its text's group stays
        pair = [(d, h // context) for d, h in zip(dev.tolist(), home.tolist(), strict=True)]
        remote = (dev != home) if context == 1 else (dev // context != home // context)
        want, running = np.zeros(n, bool), Counter(carried)
        for i in np.flatnonzero(remote):
            running[pair[i]] += int(size[i]) // per_row
            want[i] = running[pair[i]] > capacity
        assert np.array_equal(routes.overflow(size, dev, home), want)
        keep = ~want & (rng.random(n) < 0.8)  # (some turned away for other reasons)
        routes.add(size[keep], dev[keep], home[keep])
        for i in np.flatnonzero(keep & remote):
            carried[pair[i]] += int(size[i]) // per_row


def test_a_route_capacity_its_plans_never_exceed_changes_no_plan():
    """A route capacity over the most a pair carried in the same plans without a bound leaves
    the plans as they were (block-sparse tiles, so some samples are turned away after routing:
    their rows must not count against the pairs)."""
    from jaxmllm.bench.sizes import held_caps, make_caps
    from jaxmllm.plan.contract import pair_rows

    index = synthetic_omni()  # (the bench's omni at 8 devices: the tile capacity binds)
    free = make_caps(index, 8, 32768, 2, "orchestrated", block=128)
    free = held_caps(index, free, "orchestrated", 12, 0)
    plans = run(PLANNERS["orchestrated"](index, free, 0), 12)
    most = max(
        pair_rows(plan, index, free, p).max(initial=0)
        for plan in plans
        for p in ("vision", "audio")
    )
    assert most < free.route_pair_capacity
    # (30% over: a placement's overflow check still counts, within that placement, rows of
    # samples the tile capacity then turns away; they used to count for the rest of the
    # microbatch, which changed these plans even 60% over)
    bound = dc.replace(free, route_pair_capacity=int(most * 1.3))
    again = run(PLANNERS["orchestrated"](index, bound, 0), 12)
    assert all(same_plan(a, b) for a, b in zip(plans, again, strict=True))
