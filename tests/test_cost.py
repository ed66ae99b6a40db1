"""The cost model's calibration: per-device work of a batch, fitting measured step times, and
the files it reads and writes (timings.jsonl, cost_calibrated.json); a decoder's sliding-window
layers priced by their window."""

import json
from dataclasses import replace

import numpy as np
import pytest

from jaxmllm.batch.counts import StepCounter, bucket_work, step_work
from jaxmllm.config import load_config, to_dict
from jaxmllm.cost import training
from jaxmllm.cost.calibrate import main, read_timings
from jaxmllm.cost.model import PHASES, CostFileError, CostModel, PhaseCost, window_sq
from jaxmllm.loop.timings import TimingsRecorder

WINDOW = 16
# Gemma 3's shape on the tiny config: 5 sliding-window layers, then a full one
GEMMA = ["model.llm.depth=6", f"model.llm.window.size={WINDOW}", "model.llm.window.every=6"]


def _run_dir(tmp_path, rows, overrides=()):
    """A run directory with the tiny config (and `overrides`) and these timing rows."""
    cfg = load_config("configs/tiny.yaml", list(overrides))
    (tmp_path / "config.json").write_text(json.dumps(to_dict(cfg)))
    (tmp_path / "timings.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path, CostModel.from_model(cfg.model)


def _synthetic_rows(flops, overhead, scales, steps=60, noise=0.01, seed=0):
    """Steps whose time is overhead + sum_p scales[p] * FLOPs_p(work) (x 1 +- noise), with
    each phase's work drawn on its own (so the phases can be told apart)."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(1, steps + 1):
        work, time_s = {}, overhead
        for p, size in zip(PHASES, (400, 300, 150), strict=True):
            units = float(rng.integers(size // 2, size))
            sq = units * float(rng.integers(20, 120))  # segments of 20..120 units
            work.update({f"{p}_units": units, f"{p}_sq": sq, f"{p}_tiles": 1.0})
            if window := flops.phase(p).window:  # (1..5 documents of up to 64 windows)
                docs = rng.integers(4, 64 * window, size=rng.integers(1, 6)).astype(float)
                units, sq, wsq = docs.sum(), (docs**2).sum(), window_sq(docs, window).sum()
                work.update({f"{p}_units": units, f"{p}_sq": sq, f"{p}_wsq": wsq})
            time_s += scales[p] * flops.phase(p).work_cost(units, sq, work.get(f"{p}_wsq", 0))
        time_s *= 1 + noise * rng.standard_normal()
        rows.append({"step": step, "time_s": time_s, "compile": step == 1, "slowest": work})
    rows[0]["time_s"] = 90.0  # compilation: left out of the fit
    return rows


def _holdout_errors(run) -> dict[str, float]:
    """Each fit's (`scaled`, `free`) mean held-out error on the timings of `run`."""
    errors = {}
    for name in ("scaled", "free"):
        out = run / f"{name}.json"
        assert main([str(run), "--fit", name, "--out", str(out)]) == 0
        errors[name] = json.loads(out.read_text())["errors"]["holdout"]["mean"]
    return errors


def test_calibrate_recovers_known_coefficients(tmp_path, capsys):
    """Step times made from chosen per-phase rates (0.2% noise: audio, 4% of a step, is told
    from the rest within 5%; at 1% within ~20%): the default (scaled) fit gets each phase's
    rate and the overhead back, and predicts held-out steps within the noise; the file it
    writes loads as a CostModel in seconds."""
    flops = _run_dir(tmp_path, [])[1]
    scales = {"llm": 2e-11, "vision": 5e-11, "audio": 1e-10}
    rows = _synthetic_rows(flops, 0.05, scales, noise=0.002)
    _run_dir(tmp_path, rows)
    assert main([str(tmp_path), "--holdout", "0.2"]) == 0
    assert "held out 12 steps (49..60)" in capsys.readouterr().out
    model = CostModel.from_file(tmp_path / "cost_calibrated.json")
    assert model.unit == "seconds"
    assert model.overhead == pytest.approx(0.05, rel=0.1)
    for p in PHASES:
        got, want = model.phase(p), flops.phase(p)
        assert got.linear / want.linear == pytest.approx(scales[p], rel=0.05), p
        assert got.quadratic / want.quadratic == pytest.approx(scales[p], rel=0.05), p
    saved = json.loads((tmp_path / "cost_calibrated.json").read_text())
    assert saved["fit"] == "scaled"
    assert saved["errors"]["holdout"]["mean"] < 0.005
    assert saved["steps"]["holdout"] == list(range(49, 61))  # the later steps, compile left out


def test_free_fit_departs_from_the_flop_ratios_where_the_data_insist(tmp_path):
    """Audio's real quadratic/linear ratio 4x the FLOP model's: the free fit predicts the held-
    out steps better than the scaled one, which cannot change a phase's ratio."""
    flops = _run_dir(tmp_path, [])[1]
    a = flops.phase("audio")
    flops4 = replace(flops, terms={**flops.terms, "audio": replace(a, quadratic=4 * a.quadratic)})
    rows = _synthetic_rows(flops4, 0.05, {"llm": 2e-11, "vision": 5e-11, "audio": 1e-9})
    _run_dir(tmp_path, rows)
    errors = _holdout_errors(tmp_path)
    assert errors["free"] < errors["scaled"]


def test_bad_timings_and_cost_files_are_named_with_the_line(tmp_path, capsys):
    """A malformed line, a missing file or a bad cost file: exit 2 and a message naming the
    file and the line, no traceback."""
    flops = _run_dir(tmp_path, [])[1]
    rows = _synthetic_rows(flops, 0.05, {"llm": 1e-11, "vision": 1e-11, "audio": 1e-11}, 10)
    path = _run_dir(tmp_path, rows)[0] / "timings.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = lines[2].replace('"time_s": ', '"time_s": -')
    path.write_text("\n".join(lines) + "\n")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:3: 'time_s' must be a number of seconds > 0" in err
    lines[2] = '{"step": 3, "time_s": 0.5, "slowest": {"text_units": 4}}'
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CostFileError, match=r"timings.jsonl:3: slowest.text_units"):
        read_timings(path)
    path.write_text("\n".join(lines[:1] + ["{not json"]) + "\n")
    with pytest.raises(CostFileError, match=r"timings.jsonl:2: not valid JSON"):
        read_timings(path)
    path.unlink()
    assert main([str(tmp_path)]) == 2
    assert f"cannot read timings file {path}" in capsys.readouterr().err
    bad = tmp_path / "cost.json"
    bad.write_text('{"unit": "seconds", "overhead": 0.1, "phases": {"llm": {"linear": 1}}}')
    with pytest.raises(CostFileError, match=r"cost.json: not a cost model"):
        CostModel.from_file(bad)


def test_too_few_steps_to_fit_is_said(tmp_path, capsys):
    flops = _run_dir(tmp_path, [])[1]
    _run_dir(tmp_path, _synthetic_rows(flops, 0.05, dict.fromkeys(PHASES, 1e-11), 5))
    assert main([str(tmp_path)]) == 2
    assert "3 steps to fit on" in capsys.readouterr().err


def test_step_work_takes_each_microbatch_slowest_device():
    """Two microbatches of two devices: real units, squared segment lengths (a segment is a
    run of one id within a row) and tiles per device; per microbatch the device the cost model
    finds costliest, summed; the mean device over both."""
    seg = np.zeros((2, 2, 2, 8), np.int32)  # [M, D, R, L]
    seg[0, 0, 0, :6] = [1, 1, 1, 2, 2, 2]  # 6 units, 9 + 9
    seg[0, 1, 0, :5] = 1  # 5 units, 25: costlier in its square
    seg[0, 1, 1, :3] = 1  # row 2's id 1 is another segment: 3 units, 9
    seg[1, 0, 0, :] = 1  # 8 units, 64
    seg[1, 1, 0, :2] = 1  # 2 units, 4
    tiles = np.full((2, 2, 4, 2), -1, np.int32)
    tiles[0, 0, :1] = tiles[0, 1, :3] = tiles[1, 0, :2] = tiles[1, 1, :4] = 0
    cost = CostModel.from_model(load_config("configs/tiny.yaml").model)
    work = step_work({"llm_segment_ids": seg, "llm_tiles": tiles}, cost)
    assert work["slowest"] == {"llm_units": 8 + 8, "llm_sq": 34 + 64, "llm_tiles": 3 + 2}
    assert work["mean"] == {"llm_units": (14 + 10) / 2, "llm_sq": (82 + 38) / 2, "llm_tiles": 5.0}
    assert (work["devices"], work["microbatches"]) == (2, 2)


def test_resumed_recorder_drops_the_steps_it_will_redo(tmp_path):
    """Rows of steps after the checkpoint (and a line torn by a crash) go when a resumed run
    opens the file; the first step after a (re)start is marked as compiling."""
    path = tmp_path / "timings.jsonl"
    path.write_text("".join(json.dumps({"step": s, "time_s": 1.0}) + "\n" for s in (1, 2, 3)))
    path.write_text(path.read_text() + '{"step": 4, "ti')
    rec = TimingsRecorder(tmp_path, start=2)
    for step in (3, 4):
        rec.dispatched(step, np.zeros(()), {"slowest": {}})
    rec.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r.get("compile") for r in rows[2:]] == [True, False]


def test_calibrated_model_predicts_in_the_metrics_and_a_bad_one_stops_the_run(tmp_path):
    """train.cost_file: StepCounter adds the calibrated model's step time; a file that is not a
    cost model is a ConfigError naming the key (the trainer checks it at start-up)."""
    from jaxmllm.config import ConfigError
    from jaxmllm.cost.model import calibrated_cost

    cfg = load_config("configs/tiny.yaml")
    model = CostModel(dict.fromkeys(PHASES, PhaseCost(1e-3, 1e-6)), unit="seconds", overhead=0.5)
    (tmp_path / "cost.json").write_text(json.dumps(model.to_dict()))
    cfg = replace(cfg, train=replace(cfg.train, cost_file=str(tmp_path / "cost.json")))
    seg = np.zeros((1, 2, 1, 8), np.int32)
    seg[0, 0, 0, :4] = 1
    info = StepCounter(cfg)({"llm_segment_ids": seg})
    assert info["predicted_s"] == pytest.approx(0.5 + 4e-3 + 16e-6)
    (tmp_path / "cost.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"train.cost_file: .*cost.json: not a cost model"):
        calibrated_cost(cfg)


# ----------------------------------------------------------------------------- sliding windows


def _llm_costs():
    """The LLM's cost of the Gemma-shaped tiny config and of its twin with full attention in
    every layer."""
    windowed = CostModel.from_model(load_config("configs/tiny.yaml", GEMMA).model)
    full = CostModel.from_model(load_config("configs/tiny.yaml", GEMMA[:1]).model)
    return windowed, full


def test_a_sliding_window_layer_costs_a_full_one_up_to_its_window_and_linearly_beyond():
    """Five windowed layers of six: a document no longer than the window costs what it costs
    with full attention everywhere; past it, the windowed layers' part grows by the same
    amount per token (2 w a layer), so at 64 windows its attention costs a fifth of the full
    twin's. A causal tile and a windowed one together weigh the full twin's tile."""
    windowed, full = _llm_costs()
    gemma, twin = windowed.phase("llm"), full.phase("llm")
    assert (gemma.window, twin.window) == (WINDOW, 0)
    assert gemma.linear == twin.linear  # (same projections in every kind of layer)
    assert (gemma.quadratic, gemma.windowed) == pytest.approx(
        (twin.quadratic / 6, twin.quadratic * 5 / 6)
    )
    short = np.arange(1, WINDOW + 1)
    np.testing.assert_allclose(gemma.item_cost(short), twin.item_cost(short), rtol=1e-12)
    long = np.arange(WINDOW, 64 * WINDOW)
    local = gemma.item_cost(long) - gemma.quadratic * long.astype(float) ** 2
    np.testing.assert_allclose(np.diff(local), gemma.linear + 2 * WINDOW * gemma.windowed)
    n = 64 * WINDOW  # (attention: the full layer's sixth and 5 / 6 of 2 w / n of the rest)
    assert gemma.attention_cost(n) < 0.2 * twin.attention_cost(n)
    w, f = windowed.tile_weights(32, {})["llm"], full.tile_weights(32, {})["llm"]
    assert w.tile + w.window_tile == pytest.approx(f.tile)


def test_a_windowed_layers_tile_is_priced_on_their_own_list_but_in_context_groups():
    """Five windowed layers of six: a tile of the row's causal list costs the full layer's
    sixth, a tile of the windowed layers' own list the other five sixths, and the LLM's weights
    carry the window (what the list's capacity follows). Under context groups the windowed
    layers compute the causal list: a causal tile costs every layer, as the full twin's, and
    there is no windowed list; without a window the weights are what they were before."""
    windowed, full = _llm_costs()
    w, f = windowed.tile_weights(32, {})["llm"], full.tile_weights(32, {})["llm"]
    twin = full.phase("llm")
    assert tuple(f) == (twin.linear, 2 * twin.quadratic * 32**2, 0.0, 0)  # (as before windows)
    assert full.tile_weights(32, {}, context=2) == full.tile_weights(32, {})
    assert (w.unit, w.window) == (f.unit, WINDOW)
    assert (w.tile, w.window_tile) == pytest.approx((f.tile / 6, f.tile * 5 / 6))
    grouped = windowed.tile_weights(32, {}, context=2)["llm"]
    assert grouped.tile == pytest.approx(f.tile) and grouped[2:] == (0.0, 0)
    # a bucket's capacity: causal tiles at the full weight, windowed ones at theirs
    assert w.cost(100, 40, 11) == pytest.approx(w.unit * 100 + w.tile * 40 + w.window_tile * 11)
    assert windowed.tile_weights(32, {})["vision"] == full.tile_weights(32, {})["vision"]


def test_a_bucket_counts_the_windowed_lists_real_tiles_and_its_timings_row_reads_back(tmp_path):
    """`llm_window_tiles` (the sliding-window layers' own list) is counted as `llm_tiles`:
    its real tiles per bucket, padding left out; a timings row that records them reads back
    (recorded, not fitted)."""
    seg = np.zeros((1, 2, 1, 8), np.int32)
    seg[0, 0, 0, :6] = 1
    causal = np.full((1, 2, 4, 2), -1, np.int32)
    causal[0, 0, :3] = [[0, 0], [1, 0], [1, 1]]
    band = np.full((1, 2, 3, 2), -1, np.int32)
    band[0, 0, :2] = [[0, 0], [1, 1]]
    batch = {"llm_segment_ids": seg, "llm_tiles": causal, "llm_window_tiles": band}
    work = bucket_work(batch, window=4)
    assert work["llm_tiles"].tolist() == [[3.0, 0.0]]
    assert work["llm_window_tiles"].tolist() == [[2.0, 0.0]]
    assert "llm_window_tiles" not in bucket_work({"llm_segment_ids": seg, "llm_tiles": causal})
    slowest = {k: float(v[0, 0]) for k, v in work.items()}
    row = {"step": 1, "time_s": 1.0, "compile": False, "slowest": slowest}
    (tmp_path / "timings.jsonl").write_text(json.dumps(row) + "\n")
    assert read_timings(tmp_path / "timings.jsonl")[0]["slowest"]["llm_window_tiles"] == 2.0


def _pairs(n: int, window: int = 0) -> int:
    """Key-query pairs a causal document of `n` tokens has, counted on its mask: key <= query,
    and with a window key > query - window (`models.attention.windowed`)."""
    query, key = np.arange(n)[:, None], np.arange(n)[None, :]
    mask = key <= query
    if window:
        mask &= key > query - window
    return int(mask.sum())


def test_the_full_and_windowed_terms_count_the_key_query_pairs():
    """The LLM's attention part against the pairs its six layers' masks hold, counted: 4 q
    FLOPs a pair forward (scores and values), times the training multiplier, where n**2 / 2
    counts a full layer's diagonal half (n (n + 1) / 2 - n / 2) and window_sq / 2 a windowed
    one's min(n, w) keys half. Priced as six full layers, a document past the window is off."""
    cfg = load_config("configs/tiny.yaml", GEMMA)
    lm, (windowed, full) = cfg.model.llm, _llm_costs()
    per_pair = 4 * lm.heads * lm.head_width * training.modules(cfg.model)["llm"].multiplier
    windows = [WINDOW if lm.window.is_sliding(i) else 0 for i in range(lm.depth)]
    assert windows == [WINDOW] * 5 + [0]
    gemma = windowed.phase("llm")
    for n in range(1, 3 * WINDOW):
        counted = sum(_pairs(n, w) - min(n, w or n) / 2 for w in windows)
        assert gemma.item_cost(n) - gemma.linear * n == pytest.approx(per_pair * counted), n
    twin = full.phase("llm")
    assert twin.item_cost(n) - twin.linear * n > 1.5 * per_pair * counted  # (n = 47)


def test_cost_files_carry_the_window_and_older_ones_read_without(tmp_path):
    """to_dict / from_file keep the windowed term and its window; a file written before them
    (no windowed, no window) reads as no window; a window that is no token count is refused,
    naming the file."""
    windowed, full = _llm_costs()
    path = tmp_path / "cost.json"
    for model in (windowed, full):
        path.write_text(json.dumps(model.to_dict()))
        assert CostModel.from_file(path) == model
    assert json.loads(path.read_text())["phases"]["llm"]["window"] == 0
    path.write_text(json.dumps(windowed.to_dict()))
    assert CostModel.from_file(path).phase("llm").window == WINDOW
    old = windowed.to_dict()
    for t in old["phases"].values():
        del t["windowed"], t["window"]
    path.write_text(json.dumps(old))
    got, want = CostModel.from_file(path).phase("llm"), windowed.phase("llm")
    assert got == PhaseCost(want.linear, want.quadratic, 0.0, 0)
    bad = windowed.to_dict()
    bad["phases"]["llm"]["window"] = 2.5
    path.write_text(json.dumps(bad))
    with pytest.raises(CostFileError, match=r"cost.json: not a cost model .*window must be"):
        CostModel.from_file(path)


def test_bucket_work_sums_each_documents_window_sq():
    """Two devices of two rows, window 4: llm_wsq per bucket is the sum of window_sq over its
    documents (a run of one id within a row); within the window a document's is its square.
    Without a window there is none; with context groups of 2 a document spanning the group
    counts once, each device half of it. StepCounter reads the window off the config: its
    FLOPs are the documents' item costs, windowed term and all (not with the window left out)."""
    seg = np.zeros((1, 2, 2, 12), np.int32)  # [M, D, R, L]
    seg[0, 0, 0, :9] = [1] * 6 + [2] * 3  # window_sq: 2*6*4 - 16 = 32, and 9
    seg[0, 0, 1, :] = [1] * 10 + [0, 0]  # 2*10*4 - 16 = 64
    seg[0, 1, 0, :4] = 1  # 16 (within the window)
    seg[0, 1, 1, :] = 3  # 2*12*4 - 16 = 80
    work = bucket_work({"llm_segment_ids": seg}, window=4)
    np.testing.assert_array_equal(work["llm_wsq"], [[32 + 9 + 64, 16 + 80]])
    np.testing.assert_array_equal(work["llm_sq"], [[36 + 9 + 100, 16 + 144]])
    assert "llm_wsq" not in bucket_work({"llm_segment_ids": seg})
    group = np.zeros((1, 2, 1, 8), np.int32)
    group[0, :, 0, :] = 1  # one document of 16 tokens across the context group
    work = bucket_work({"llm_segment_ids": group}, context=2, window=4)
    np.testing.assert_array_equal(work["llm_wsq"], [[(2 * 16 * 4 - 16) / 2] * 2])
    np.testing.assert_array_equal(work["llm_sq"], [[16**2 / 2] * 2])

    cfg = load_config("configs/tiny.yaml", GEMMA)
    seg = np.zeros((1, 2, 1, 512), np.int32)
    seg[0, 0, 0, :500] = [1] * 300 + [2] * 200
    seg[0, 1, 0, :] = [1] * 12 + [2] * 500  # (one within the window)
    info = StepCounter(cfg, calibrated=None)({"llm_segment_ids": seg})
    llm = CostModel.from_model(cfg.model).phase("llm")
    want = llm.item_cost(np.array([300, 200, 12, 500])).sum()
    assert info["flops"] == info["llm_flops"] == pytest.approx(want, rel=1e-12)
    no_window = llm.item_cost(np.array([300, 200, 12, 500])) - llm.windowed * window_sq(
        np.array([300, 200, 12, 500]), WINDOW
    )
    assert no_window.sum() < 0.99 * want


def test_calibrate_a_windowed_model(tmp_path):
    """Step times of the Gemma-shaped tiny model (its LLM's documents up to 64 windows long): the
    scaled fit gets each phase's rate back and keeps the LLM's windowed / linear ratio and its
    window; its file reads back windowed, and the free fit's has a windowed coefficient of its
    own. Where the windowed layers cost as full ones (context groups: the row's tiles), the
    free fit predicts held-out steps better than the scaled one."""
    flops = _run_dir(tmp_path, [], GEMMA)[1]
    assert flops.phase("llm").window == WINDOW
    scales = {"llm": 2e-11, "vision": 5e-11, "audio": 1e-10}
    _run_dir(tmp_path, _synthetic_rows(flops, 0.05, scales, noise=0.002), GEMMA)
    assert main([str(tmp_path)]) == 0
    model = CostModel.from_file(tmp_path / "cost_calibrated.json")
    got, want = model.phase("llm"), flops.phase("llm")
    assert got.window == WINDOW
    assert got.windowed / got.linear == pytest.approx(want.windowed / want.linear, rel=1e-12)
    for p in PHASES:
        assert model.phase(p).linear / flops.phase(p).linear == pytest.approx(scales[p], rel=0.05)
    saved = json.loads((tmp_path / "cost_calibrated.json").read_text())
    assert saved["errors"]["holdout"]["mean"] < 0.005
    assert main([str(tmp_path), "--fit", "free", "--out", str(tmp_path / "free.json")]) == 0
    free = CostModel.from_file(tmp_path / "free.json").phase("llm")
    assert free.window == WINDOW and free.windowed > 0  # (its own coefficient, fitted)

    g = flops.phase("llm")
    tiled = replace(g, quadratic=g.quadratic + g.windowed, windowed=0.0)  # (window kept)
    truth = replace(flops, terms={**flops.terms, "llm": tiled})
    rows = _synthetic_rows(truth, 0.05, scales)
    assert rows[1]["slowest"]["llm_wsq"] < rows[1]["slowest"]["llm_sq"]
    _run_dir(tmp_path, rows, GEMMA)
    errors = _holdout_errors(tmp_path)
    assert errors["free"] < errors["scaled"]


def test_gemma4s_full_layers_are_priced_at_their_own_head_shapes():
    """Beside windowed layers, a full layer of its own head width (full_head_dim) and kv heads
    whose values are its keys' (full_k_eq_v: no v projection) costs its own projections and
    its own quadratic term; the sliding layers keep theirs."""
    from jaxmllm.config import LLMConfig
    from jaxmllm.cost.flops import decoder_linear

    window = {"size": 8, "layers": [0, 1]}
    base = LLMConfig(width=64, depth=3, heads=4, kv_heads=2, head_dim=24, mlp_dim=96)
    base = replace(base, window=replace(base.window, **window))
    own = replace(base, full_head_dim=32, full_kv_heads=1, full_k_eq_v=True)
    d = 64
    before = 2.0 * (2 * d * 4 * 24 + 2 * d * 2 * 24)  # (q, o; k, v at the sliding shapes)
    after = 2.0 * (2 * d * 4 * 32 + d * 1 * 32)  # (q, o at 32; k only, one kv head)
    assert decoder_linear(own) - decoder_linear(base) == pytest.approx(after - before)
    cfg = load_config(None)
    costs = [CostModel.from_model(replace(cfg.model, llm=llm)).terms["llm"] for llm in (base, own)]
    assert costs[1].quadratic / costs[0].quadratic == pytest.approx(32 / 24)  # (its full layer)
    assert costs[1].windowed == costs[0].windowed


def test_a_conformer_audio_phase_is_priced_linear_in_frames_at_what_xla_counts():
    """Gemma 4's conformer (model.audio.stem: conformer) attends within a bounded window: the
    audio phase has no quadratic term, and its per-frame FLOPs are what XLA counts the
    encoder's program to do per frame added (within its elementwise work, a few %; one
    block: XLA counts a scanned body once), for clips of 240 to 960 frames alike."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxmllm.config import Config, from_dict
    from jaxmllm.cost.flops import conformer_flops
    from jaxmllm.models.conformer import ConformerEncoder

    conformer = {"channels": [16, 8], "chunk": 6, "context_left": 7, "out_dim": 48}
    audio = {"stem": "conformer", "positions": "relative", "mlp": "silu", "n_mels": 32}
    audio.update(width=128, heads=4, mlp_dim=512, depth=1, conformer=conformer)
    cfg = from_dict(Config, {"model": {"audio": audio}})
    a = cfg.model.audio
    term = CostModel.from_model(cfg.model).phase("audio")
    assert term.quadratic == 0 and term.windowed == 0
    graphdef, state = nnx.split(
        ConformerEncoder(a, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    )
    encode = jax.jit(lambda s, x, seg, pos: nnx.merge(graphdef, s)(x, seg, pos))

    def counted(frames):
        x, pos = jnp.zeros((1, frames, a.n_mels)), jnp.arange(frames)[None]
        return encode.lower(state, x, jnp.ones_like(pos), pos).compile().cost_analysis()["flops"]

    f240, f480, f960 = counted(240), counted(480), counted(960)
    per_frame = [(f480 - f240) / 240, (f960 - f480) / 480]
    assert per_frame[1] == pytest.approx(per_frame[0], rel=0.02)  # linear in frames
    ours = conformer_flops(a)
    assert 0.9 < ours / per_frame[1] < 1.0, (ours, per_frame)  # (XLA adds the elementwise)
    proj = 2 * (a.out_width * cfg.model.llm.width + cfg.model.llm.width**2) / 4
    assert term.linear == pytest.approx(3 * (ours + proj))  # (trained: forward x 3)


def test_gemma4s_shared_layers_and_per_layer_inputs_are_priced():
    """A layer reusing another's keys computes no k and v projections, and with
    kv_shared_wide_mlp its MLP is twice as wide; per-layer inputs add their projection of the
    input embeddings and each layer's gate and projection."""
    from jaxmllm.config import LLMConfig
    from jaxmllm.cost.flops import decoder_linear

    window = {"size": 8, "layers": [0, 2]}
    base = LLMConfig(width=64, depth=4, heads=4, kv_heads=2, head_dim=24, mlp_dim=96)
    base = replace(base, window=replace(base.window, **window))
    shared = replace(base, kv_shared_layers=2, kv_shared_wide_mlp=True)
    d = 64
    kv = 2.0 * 2 * d * 2 * 24  # (a layer's k and v)
    mlp = 3 * 2.0 * d * 96  # (a gated MLP's three matrices)
    assert decoder_linear(shared) - decoder_linear(base) == pytest.approx(2 * (mlp - kv))
    ple = replace(base, per_layer_dim=8)
    assert decoder_linear(ple) - decoder_linear(base) == pytest.approx(6.0 * d * 8 * 4)
