"""bench.pairs: preference pairs as one sample (both documents, the media once) against the
unpaired layout (two samples, the media twice), planned by orchestrated and grain's packer; the
layouts' rows, the FLOPs pairing saves, and a small run's table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxmllm.bench.pairs import _Split, completions, main, pair_flops, pair_layouts
from jaxmllm.cost.model import CostModel, PhaseCost, window_sq
from jaxmllm.data.lengths import LengthsIndex

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

ROOT = Path(__file__).resolve().parents[1]
PER_TOKEN = {"vision": 4, "audio": 4}
PROMPTS = [{"text": 10, "images": [64, 16]}, {"text": 5}, {"text": 7, "images": [256]}]
CHOSEN, REJECTED = np.array([3, 4, 5]), np.array([6, 1, 2])


def test_a_pair_is_one_sample_of_both_documents_with_its_media_once():
    paired, unpaired = pair_layouts(LengthsIndex.from_records(PROMPTS), CHOSEN, REJECTED, PER_TOKEN)
    slots = np.array([20, 0, 64])  # (placeholder rows: patches / 4)
    prompt = np.array([10, 5, 7]) + slots
    assert paired.docs.tolist() == np.stack([prompt + CHOSEN, prompt + REJECTED], 1).tolist()
    # text: both documents less one copy of the placeholder rows; LLM length: both documents
    assert paired.index.text.tolist() == (2 * prompt - slots + CHOSEN + REJECTED).tolist()
    assert paired.index.llm_tokens(PER_TOKEN).tolist() == paired.docs.sum(1).tolist()
    assert paired.index.items["vision"].sizes.tolist() == [64, 16, 256]  # (once)
    # where each pair splits: its attention is its two documents'
    assert paired.index.split[:, 0].tolist() == (prompt + CHOSEN).tolist()
    assert paired.index.llm_documents(PER_TOKEN).tolist() == paired.docs.ravel().tolist()
    one, _ = pair_layouts(LengthsIndex.from_records(PROMPTS), CHOSEN, REJECTED, PER_TOKEN, False)
    assert one.index.split is None and one.index.text.tolist() == paired.index.text.tolist()
    # unpaired: chosen, rejected of each pair, each its own copy of the images
    assert len(unpaired.index) == 6 and unpaired.pair.tolist() == [0, 0, 1, 1, 2, 2]
    want = np.stack([prompt + CHOSEN, prompt + REJECTED], 1).ravel()
    assert unpaired.index.llm_tokens(PER_TOKEN).tolist() == want.tolist()
    assert unpaired.docs[:, 0].tolist() == want.tolist() and not unpaired.docs[:, 1].any()
    assert unpaired.index.items["vision"].sizes.tolist() == [64, 16, 64, 16, 256, 256]
    assert unpaired.index.items["vision"].count().tolist() == [2, 2, 0, 0, 1, 1]


def test_pairing_saves_one_encoding_of_each_image_and_no_llm_work():
    paired, unpaired = pair_layouts(LengthsIndex.from_records(PROMPTS), CHOSEN, REJECTED, PER_TOKEN)
    cost = CostModel(
        {"llm": PhaseCost(10.0, 0.5), "vision": PhaseCost(3.0, 0.25), "audio": PhaseCost(1, 1)}
    )
    f = pair_flops(paired, unpaired, cost)
    images = sum(3.0 * n + 0.25 * n * n for n in (64, 16, 256)) / 3  # a pair's, once
    assert f["paired"]["vision"] == pytest.approx(images)
    assert f["unpaired"]["vision"] - f["paired"]["vision"] == pytest.approx(images)
    assert f["saved_vision_share"] == pytest.approx(0.5)
    docs = paired.docs.astype(float)
    llm = (10.0 * docs + 0.5 * docs**2).sum() / 3  # each document alone
    assert f["paired"]["llm"] == pytest.approx(llm) and f["unpaired"]["llm"] == pytest.approx(llm)
    assert f["paired"]["llm_planned"] == pytest.approx(llm)  # (the planner's: its documents)
    one_doc, _ = pair_layouts(
        LengthsIndex.from_records(PROMPTS), CHOSEN, REJECTED, PER_TOKEN, False
    )
    one = docs.sum(1)  # (without the split: one document of both lengths)
    planned = pair_flops(one_doc, unpaired, cost)["paired"]["llm_planned"]
    assert planned == pytest.approx((10.0 * one + 0.5 * one**2).sum() / 3)
    assert f["saved_per_pair"] == pytest.approx(images)
    assert f["saved_share"] == pytest.approx(images / (llm + 2 * images))


def test_dpo_cost_and_the_loads_keep_the_sliding_window():
    """A Gemma-shaped decoder's DPO cost (training plus the reference's forward) keeps the
    windowed term and its window, and a plan's attention loads price each document by
    `attention_cost`: with only a windowed term, its window_sq, not 0."""
    from jaxmllm.bench.pairs import _loads, dpo_cost
    from jaxmllm.bench.sizes import make_caps
    from jaxmllm.config import load_config
    from jaxmllm.plan.registry import make_planner

    window = ["model.llm.depth=6", "model.llm.window.size=16", "model.llm.window.every=6"]
    train = CostModel.from_model(load_config("configs/tiny.yaml", window).model).phase("llm")
    cost, with_ref = dpo_cost(load_config("configs/tiny.yaml", window))
    llm = cost.phase("llm")
    assert with_ref and llm.window == 16 and llm.windowed > train.windowed > 0
    assert llm.windowed / train.windowed == pytest.approx(llm.quadratic / train.quadratic)
    paired, _ = pair_layouts(LengthsIndex.from_records(PROMPTS), CHOSEN, REJECTED, PER_TOKEN)
    caps = make_caps(paired.index, 2, 64, 1, "grain", block=8)
    plan = make_planner("grain", paired.index, caps, 0).plan()
    only = CostModel({p: PhaseCost(0.0, 0.0, 1.0, 4) for p in ("llm", "vision", "audio")})
    q, _ = _loads(plan, paired, caps, only)["llm"]
    docs = paired.docs[plan.samples]
    assert q.sum() == pytest.approx(window_sq(docs, 4).sum()) and q.sum() > 0


def test_completions_are_seeded_long_tailed_and_alike_within_a_pair():
    c, r = completions(20000, seed=3)
    again = completions(20000, seed=3)
    assert (c == again[0]).all() and (r == again[1]).all()
    assert 110 < np.median(c) < 150 and c.min() >= 4 and c.max() <= 2048
    assert np.percentile(c, 99) > 4 * np.median(c)  # (a long tail)
    rho = np.corrcoef(np.log(c), np.log(r))[0, 1]
    assert 0.65 < rho < 0.85  # (1 - 0.4^2 / 0.8^2 = 0.75)


def test_split_counts_the_pairs_whose_halves_landed_apart():
    split = _Split(4)
    split.add(np.array([0, 0, 1, 2]), np.array([5, 5, 6, 7]))  # pair 0 together; 1, 2 wait
    split.add(np.array([1, 2, 3]), np.array([6, 9, 9]))  # 1 together, 2 apart; 3 waits
    assert (split.both, split.split) == (3, 1)
    assert split.share == pytest.approx(1 / 3)


def test_a_small_run_prints_its_table_and_its_figures_are_sane(tmp_path, capsys):
    rng = np.random.default_rng(0)
    lengths = tmp_path / "prompts.jsonl"
    with open(lengths, "w") as f:
        for _ in range(400):
            images = (4 * rng.integers(16, 256, rng.integers(0, 3))).tolist()
            f.write(json.dumps({"text": int(rng.integers(8, 200)), "images": images}) + "\n")
    out = tmp_path / "pairs.json"
    argv = ["--lengths", str(lengths), "--devices", "8", "--steps", "3", "--tokens", "4096"]
    argv += ["--micro", "1", "--config", str(ROOT / "configs/gpu/qwen3_vl_8b_dpo.yaml")]
    assert main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pairs/step" in text and "pairing saves" in text
    got = json.loads(out.read_text())
    rows = got["rows"]
    layouts = {(r["layout"], r["policy"]) for r in rows}
    assert layouts == {(a, b) for a in ("paired", "unpaired") for b in ("orchestrated", "grain")}
    for r in rows:
        assert 0 < r["goodput"] <= 1, r
        assert 0 < r["fill"]["llm"] <= 1 and 0 < r["fill"]["vision"] <= 1, r
        assert r["pairs_per_step"] > 0 and r["tflop_per_pair"] > 0
        assert r["quad_max_mean"] >= r["quad_bound"] - 1e-9 and r["quad_bound"] >= 1 - 1e-9
        assert 0 <= r["split"] <= 1
    for r in rows:  # (the planner prices a pair as its two documents: the tiles it needs)
        paired = r["layout"] == "paired"
        assert r["split"] == 0 if paired else True
        assert r["goodput_priced"] == pytest.approx(r["goodput"])
    # Without the split (a pair priced as one document of both lengths, as before the index
    # said where it splits) the planner counts more tiles than the documents need
    assert main([*argv, "--one-document", "--json", str(out)]) == 0
    for r in json.loads(out.read_text())["rows"]:
        paired = r["layout"] == "paired"
        assert r["goodput_priced"] > r["goodput"] if paired else r["goodput_priced"] == r["goodput"]
    f = got["flops"]["prompts.jsonl"]
    assert 0 < f["paired"]["vision"] < f["unpaired"]["vision"]
    assert f["saved_vision_share"] == pytest.approx(0.5)
    assert f["paired"]["llm"] == pytest.approx(f["unpaired"]["llm"])
    assert got["reference_counted"] is True  # (the recipe's sigmoid loss)
