"""A preference pair priced as what it computes: its LLM tokens (both documents) as its linear
work, its two documents as its attention (`LengthsIndex.split`), its media once. The planner's
cost and expected tiles of a pair are its documents' sum, a document fits a tile capacity alone,
the tile capacity sized from pair data is what the documents need (smaller than for one
document of both lengths) and no planned step ever needs more than it (bucketize counts the
tiles from its segment ids); data without the split plans as before."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from pairs import PairSource

from jaxmllm.batch.bucketize import bucketize
from jaxmllm.batch.counts import bucket_work
from jaxmllm.config import load_config
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.plan.bins import quad_cost, tile_cost
from jaxmllm.plan.contract import (
    Capacities,
    OversizeError,
    StepPlan,
    check_plan,
    check_tiles_fit,
    step_tiles,
)
from jaxmllm.plan.registry import make_planner
from jaxmllm.plan.tiles import bin_tiles, own_tiles
from jaxmllm.plan.work import Phases
from jaxmllm.resolve.run import resolve_run
from jaxmllm.resolve.sizing import capacities, planner_from_config, resolve_tiles

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

PER_TOKEN = {"vision": 4, "audio": 4}
BLOCK = 16
# (text, images, split: a pair's first document's LLM tokens, 0 for one document)
ROWS = [(100, [64], 40), (70, [], 0), (250, [16, 32], 120), (33, [], 17), (90, [], 0)]


def index_of(split: bool = True) -> LengthsIndex:
    records = [{"text": t, "images": im} for t, im, _ in ROWS]
    if split:
        for r, (_, _, s) in zip(records, ROWS, strict=True):
            r["split"] = s
    return LengthsIndex.from_records(records)


def caps_of(block: int = BLOCK, llm_tiles: int = 0) -> Capacities:
    return Capacities(
        microbatches=1,
        devices=2,
        llm_rows=1,
        llm_row_len=512,
        units={"vision": 256, "audio": 0},
        per_token=PER_TOKEN,
        per_row={"vision": 1, "audio": 4},
        route_pair_capacity=64,
        attention_block=block,
        tiles={"llm": llm_tiles, "vision": 0},
    )


def test_a_pairs_planned_cost_is_the_sum_of_its_two_documents():
    index = index_of()
    llm = index.llm_tokens(PER_TOKEN)
    split = np.array([s for _, _, s in ROWS])
    pair = split > 0
    first, second = split[pair], llm[pair] - split[pair]
    assert index.llm_documents(PER_TOKEN).tolist() == [
        n
        for t, s in zip(llm.tolist(), split.tolist(), strict=True)
        for n in ((s, t - s) if s else (t,))
    ]
    for block, cost in ((0, quad_cost), (BLOCK, tile_cost(BLOCK, True))):
        pool = Phases(index, caps_of(block)).of(np.arange(len(index)), index)
        want = cost(llm)
        want[pair] = cost(first) + cost(second)
        np.testing.assert_allclose(pool.llm_cost, want)  # (its documents' sum)
        assert (pool.llm == llm).all()  # (its linear work: every token of both)
        # Negative control: the split ignored, a pair costs one document of both lengths, more
        one = Phases(index_of(False), caps_of(block)).of(np.arange(len(index)), index_of(False))
        np.testing.assert_allclose(one.llm_cost, cost(llm))
        assert (one.llm_cost[pair] > pool.llm_cost[pair]).all()
        assert (one.llm_cost[~pair] == pool.llm_cost[~pair]).all()
    # The expected tiles selection fits into a microbatch: the documents' too (with a tile
    # capacity), and their longest document is what a long variant looks at
    caps = caps_of(BLOCK, llm_tiles=400)
    phases = Phases(index, caps)
    pool = phases.of(np.arange(len(index)), index)
    tiles = pool.sel[len(pool.work[0])]  # (after the units: the LLM's expected tiles)
    single = Phases(index_of(False), caps).of(np.arange(len(index)), index_of(False))
    assert (tiles[pair] < single.sel[len(pool.work[0])][pair]).all()
    assert (pool.longest() == np.where(pair, np.maximum(split, llm - split), llm)).all()


def test_a_pair_fits_a_tile_capacity_its_documents_fit_alone():
    """check_tiles_fit: a document's tiles must fit the capacity, a pair's two documents each
    (its LLM tokens one document of 250 + 16 + 32 / 4 = 262 tokens would need more)."""
    index = index_of()
    most = max(int(n) for n in index.llm_documents(PER_TOKEN))  # (142 tokens: 9 blocks)
    need = int(own_tiles(np.array([-(-most // BLOCK)]), True)[0])
    check_tiles_fit(index, caps_of(BLOCK, llm_tiles=need))
    with pytest.raises(OversizeError, match=r"llm document of 262 units"):
        check_tiles_fit(index_of(False), caps_of(BLOCK, llm_tiles=need))


def test_a_plans_tiles_count_a_pairs_two_documents_back_to_back():
    """step_tiles (check_plan's, the tile sizing's) lays a pair out as its two documents, the
    second right after the first; the balancer's own count (`TileBudget`) is the same."""
    index = index_of()
    llm = index.llm_tokens(PER_TOKEN)
    caps = caps_of(BLOCK)
    s = np.array([0, 2, 1])
    offset = np.array([0, int(llm[0]), 0])
    plan = StepPlan(0, s, np.zeros(3, np.int64), np.array([0, 0, 1]), np.zeros(3, np.int64), offset)
    got = step_tiles(plan, index, caps)["llm"]
    split = index.split[s, 0]
    docs = [(0, offset[0], split[0]), (0, offset[0] + split[0], llm[0] - split[0])]
    docs += [(0, offset[1], split[1]), (0, offset[1] + split[1], llm[2] - split[1])]
    docs += [(1, 0, llm[1])]
    b, o, n = (np.array(x) for x in zip(*docs, strict=True))
    assert got[0].tolist() == bin_tiles(b, o, n, 2, BLOCK, True).tolist()
    one = step_tiles(plan, index_of(False), caps)["llm"]
    assert one[0, 0] > got[0, 0] and one[0, 1] == got[0, 1]
    # the balancer's exact count of what it places (`TileBudget`) is check_plan's: at a
    # capacity a pair's one-document count would not fit, its plans stay within it
    tight = caps_of(BLOCK, llm_tiles=60)
    planner = make_planner("orchestrated", index, tight, 0)
    for _ in range(5):
        check_plan(planner.plan(), index, tight)
    with pytest.raises(OversizeError):
        make_planner("orchestrated", index_of(False), tight, 0)


def test_a_split_of_zeros_plans_as_no_split():
    """An index whose split is all zeros (SFT data) plans as one without the column: the
    column absent is all zeros; and the lengths file keeps it."""
    rng = np.random.default_rng(0)
    n = 400
    records = [
        {"text": int(t), "images": [int(x) for x in 4 * rng.integers(4, 40, rng.integers(0, 3))]}
        for t in rng.integers(10, 300, n)
    ]
    plain = LengthsIndex.from_records(records)
    zeros = dataclasses.replace(plain, split=np.zeros(n, np.int64))
    assert plain.split is None
    caps = dataclasses.replace(caps_of(32, llm_tiles=300), devices=4, microbatches=2)
    a, b = (make_planner("orchestrated", ix, caps, 3) for ix in (plain, zeros))
    for _ in range(6):
        x, y = a.plan(), b.plan()
        for f in ("samples", "micro", "device", "row", "offset"):
            assert (getattr(x, f) == getattr(y, f)).all(), f
        for f in ("owner", "item", "device", "offset"):
            assert (getattr(x.items["vision"], f) == getattr(y.items["vision"], f)).all(), f
    assert json.dumps(a.get_state()) == json.dumps(b.get_state())


def test_lengths_files_keep_where_pairs_split(tmp_path):
    index = index_of()
    path = tmp_path / "lengths.jsonl"
    index.write_jsonl(path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r.get("split", 0) for r in rows] == [s for _, _, s in ROWS]
    again = LengthsIndex.from_records(rows)
    assert again.split.tolist() == index.split.tolist()
    # "documents": [n1, n2] says the same; a sample of one document has no split
    docs = LengthsIndex.from_records([{"text": 30, "documents": [12, 18]}, {"text": 9}])
    assert docs.split[:, 0].tolist() == [12, 0] and "split" not in docs.record(1)
    both = LengthsIndex.concat([LengthsIndex.from_records([{"text": 5}]), index])
    assert both.split[:, 0].tolist() == [0, *index.split[:, 0].tolist()]


def test_a_groups_documents_are_priced_tiled_and_kept_as_its_documents(tmp_path):
    """A GRPO group is one sample of G documents (`documents`: the split's cuts, any number):
    its cost is its documents' sum, its longest is theirs, a plan's tiles lay them out back to
    back (check_plan's count, and the balancer's own within a capacity of two groups' tiles),
    and the lengths file keeps every cut. A pair beside them is the case of two."""
    docs = [[30, 40, 46], [20, 25, 25, 30], None, [12, 21]]  # (LLM tokens of each document)
    rows = [(100, [64]), (100, []), (90, []), (33, [])]
    records = [{"text": t, "images": im} for t, im in rows]
    for r, d in zip(records, docs, strict=True):
        if d:
            r["documents"] = d
    index = LengthsIndex.from_records(records)
    llm = index.llm_tokens(PER_TOKEN)
    assert llm.tolist() == [116, 100, 90, 33]
    assert index.llm_documents(PER_TOKEN).tolist() == [n for d in docs for n in d or [90]]
    cost = tile_cost(BLOCK, True)
    pool = Phases(index, caps_of(BLOCK)).of(np.arange(4), index)
    np.testing.assert_allclose(pool.llm_cost, [cost(np.array(d or [90])).sum() for d in docs])
    assert pool.longest().tolist() == [46, 30, 90, 21]
    # a plan's tiles: group 0 at offset 0 then group 1 right after it, in one row
    plan = StepPlan(
        0,
        np.array([0, 1]),
        np.zeros(2, np.int64),
        np.zeros(2, np.int64),
        np.zeros(2, np.int64),
        np.array([0, 116]),
    )
    sizes = np.array([*docs[0], *docs[1]])
    offsets = np.cumsum(sizes) - sizes
    want = bin_tiles(np.zeros(len(sizes), np.int64), offsets, sizes, 2, BLOCK, True)
    assert step_tiles(plan, index, caps_of(BLOCK))["llm"][0].tolist() == want.tolist()
    tight = caps_of(BLOCK, llm_tiles=int(want[0]))  # (the balancer's count never above it)
    planner = make_planner("orchestrated", index, tight, 0)
    planned = set()
    for _ in range(4):
        plan = planner.plan()
        check_plan(plan, index, tight)
        planned.update(plan.samples.tolist())
    assert planned == {0, 1, 2, 3}
    path = tmp_path / "lengths.jsonl"
    index.write_jsonl(path)
    again = LengthsIndex.from_records([json.loads(x) for x in path.read_text().splitlines()])
    assert again.split.tolist() == index.split.tolist()


@pytest.fixture(scope="module")
def tiny():
    """tiny.yaml's model on 8 devices, its built-in data (128 samples) as pairs of two equal
    documents (`tests/pairs.py`), the LLM tile capacity left to be sized from the data."""
    cfg = load_config(
        "configs/tiny.yaml", ["data.synthetic.num_samples=128", "batch.llm_row_len=384"]
    )
    run = resolve_run(cfg)
    cfg = dataclasses.replace(
        run.cfg,
        train=dataclasses.replace(run.cfg.train, objective="dpo"),
        batch=dataclasses.replace(run.cfg.batch, llm_tiles=-1),
    )
    return run, cfg


def test_a_pair_mixes_tile_capacity_is_its_documents_and_no_step_exceeds_it(tiny):
    run, cfg = tiny
    pairs = PairSource(run.source, run.index)
    sized = resolve_tiles(cfg, pairs.index, 8)["llm_tiles"]
    one = resolve_tiles(cfg, PairSource(run.source, run.index, split=False).index, 8)["llm_tiles"]
    assert sized < one  # (sized for one document of both lengths, it held tiles never used)
    cfg = dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, llm_tiles=sized))
    caps = capacities(cfg, 8)
    planner = planner_from_config(cfg, pairs.index, 8)
    full = 0
    for _ in range(6):
        plan = planner.plan()
        check_plan(plan, pairs.index, caps)
        samples = {int(i): pairs[int(i)] for i in np.unique(plan.samples)}
        host = bucketize(plan, samples, cfg, caps, index=pairs.index)  # (TileOverflow if over)
        real = (host["llm_tiles"][..., 0] >= 0).sum(-1)  # [M, D] from the segment ids
        assert real.max() <= sized
        assert (real == step_tiles(plan, pairs.index, caps)["llm"]).all()  # (the planner's)
        full = max(full, int(real.max()))
        # the step's FLOPs count each document's attention alone (n1^2 + n2^2 a pair)
        n = pairs.index.split[plan.samples, 0].astype(np.float64)
        sq = np.zeros((caps.microbatches, caps.devices))
        np.add.at(sq, (plan.micro, plan.device), 2 * n**2)  # (two documents of n tokens)
        assert (bucket_work(host)["llm_sq"] == sq).all()
    assert full >= 0.9 * sized  # (a capacity the plans use, not one far above them)
