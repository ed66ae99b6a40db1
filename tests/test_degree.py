"""`mesh.context_steps: auto` (issue 57): the steps that split their rows over the context groups,
chosen at start-up from the data by useful FLOPs over computed FLOPs plus the priced exchange
(`jaxmllm.resolve.degree`), kept by a resumed run; and the exchange's bytes a step
(`jaxmllm.cost.exchange`)."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
from test_ladder import _records

from jaxmllm.config import ConfigError, load_config
from jaxmllm.config.spec import BatchSpec
from jaxmllm.cost import exchange
from jaxmllm.data.index import build_index
from jaxmllm.loop.checkpoint import write_config
from jaxmllm.resolve import degree
from jaxmllm.resolve.resumed import keep_resolved
from jaxmllm.resolve.run import resolve_run

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)


def auto_config(tmp_path, *extra):
    """Text chats with one long document in 16 on data=4 x context=2 (`test_context_train`'s
    per-step run), mesh.context_steps: auto."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _records(64, 16)))
    sets = ["mesh.context_strategy=ulysses", "data.eval.source=none", "data.workers=0"]
    sets += ["data.source=files", f"data.path={data}", "batch.llm_row_len=128"]
    sets += ["batch.attention_block=16", "batch.microbatches=1", "mesh.data=4", "mesh.fsdp=1"]
    sets += ["mesh.context=2", "mesh.context_steps=auto", f"train.output_dir={tmp_path / 'out'}"]
    cfg = load_config("configs/manifest_example.yaml", [*sets, "train.steps=40", *extra])
    build_index(cfg, progress=False)
    return cfg


def test_auto_keeps_the_choice_whose_useful_flops_cost_least_and_a_resumed_run_keeps_it(
    tmp_path, monkeypatch, caplog
):
    cfg = auto_config(tmp_path)
    with pytest.raises(ConfigError, match="mesh.context_steps=auto is not resolved"):
        BatchSpec.of(cfg)
    with caplog.at_level(logging.INFO, logger="jaxmllm"):
        run = resolve_run(cfg)
    _, trials = degree.choose(cfg, run.index, run.devices)
    long, every = trials["long"], trials["all"]
    # Every step of `all` splits its rows, the long steps alone of `long` (some, not all)
    assert every.split_steps == every.steps == 40 and 0 < long.split_steps < long.steps
    # ... each such step moves a rank's bytes of every layer (`step_bytes`), priced per byte
    lm, tokens = cfg.model.llm, run.caps.llm_rows * run.caps.llm_row_len
    moved = exchange.step_bytes(lm, "ulysses", tokens, 2, 4)  # (float32)
    layer = exchange.attention_bytes(tokens, 2, lm.heads, lm.kv_heads, lm.head_width, 4)
    assert moved == lm.depth * (layer["ulysses"]["forward"] + layer["ulysses"]["backward"])
    assert every.exchange == 40 * 8 * moved * exchange.FLOPS_PER_BYTE
    best = max(trials, key=lambda s: trials[s].score)
    assert run.cfg.mesh.context_steps == best and f"mesh.context_steps=auto: {best}" in caplog.text
    assert (run.spec.long_context == 2) == (best == "long")
    # The price decides: exchange free, the better packing; dear, the fewer exchanges
    for price, want in ((0.0, max(trials, key=lambda s: trials[s].goodput)), (1e9, "long")):
        monkeypatch.setattr(degree, "FLOPS_PER_BYTE", price)
        assert degree.choose(cfg, run.index, run.devices)[0].mesh.context_steps == want
    # A run resumed with auto keeps the choice its checkpoints were planned with (and its sizes)
    out = tmp_path / "out"
    chosen = "all" if best == "long" else "long"  # (whichever the data would not choose now)
    saved = degree.choose(cfg, run.index, run.devices)[0]
    saved = replace(saved, mesh=replace(saved.mesh, context_steps=chosen))
    write_config(saved, out)
    (out / "checkpoints" / "3").mkdir(parents=True)
    kept = keep_resolved(cfg, out)
    assert kept.mesh.context_steps == chosen and kept.batch.llm_tiles == saved.batch.llm_tiles


def test_the_exchange_of_a_step_sums_each_layer_at_its_own_heads():
    """A hybrid decoder's Gated DeltaNet layers move their projections under ulysses; Gemma 4's
    full-attention layers gather their own head width and KV heads; a group of one moves
    nothing."""
    from jaxmllm.config.decoder import LinearConfig, LLMConfig, WindowConfig

    hybrid = LLMConfig(depth=4, heads=8, kv_heads=2, linear=LinearConfig(every=4))
    t, lin = 1024, LinearConfig(every=4)
    att = exchange.attention_bytes(t, 4, 8, 2, hybrid.head_width, 2)["ulysses"]
    want = 3 * exchange.linear_bytes(t, 4, lin, 2) + att["forward"] + att["backward"]
    assert exchange.step_bytes(hybrid, "ulysses", t, 4, 2) == want
    assert exchange.step_bytes(hybrid, "ulysses", t, 1, 2) == 0
    window = WindowConfig(size=128, every=2)
    gemma = LLMConfig(depth=2, heads=8, kv_heads=4, window=window, full_head_dim=512)
    gemma = replace(gemma, full_kv_heads=1)
    per = {}
    for w, kv in ((gemma.head_width, 4), (512, 1)):  # (sliding layers', the full layer's own)
        moved = exchange.attention_bytes(t, 4, 8, kv, w, 2)["gather"]
        per[w] = moved["forward"] + moved["backward"]
    assert exchange.step_bytes(gemma, "gather", t, 4, 2) == sum(per.values())
    # (gather: 2 (C - 1) T kv e bytes each way, the ids and positions forward)
    assert per[512] == 2 * (2 * 3 * t * 1 * 512 * 2) + 2 * 3 * t * 4


@pytest.mark.slow  # ~4 s: four sized bench runs (the bench's figures, not the trainer's)
def test_the_balance_bench_prices_the_exchange_and_keeps_what_auto_keeps(tmp_path):
    """`bench.balance --policies auto_groups`: no groups, groups in the long steps and in every
    step, each grouped row's exchange priced for the --config's decoder (every step's under
    groups, the long steps' under long_groups) and the highest score kept, as
    `mesh.context_steps: auto`."""
    from jaxmllm.bench.balance import main

    out = tmp_path / "rows.json"
    args = ["--random", "1", "--seed", "100", "--family", "docqa", "--samples", "3000"]
    args += ["--devices", "8", "--block", "128", "--group-size", "4", "--max-steps", "6"]
    args += ["--config", "configs/gpu/qwen3_vl_8b.yaml", "--json", str(out)]
    assert main([*args, "--policies", "orchestrated,long_groups,groups,auto_groups"]) == 0
    alone, long, every, auto = json.loads(out.read_text())
    assert long["long_steps"] > 0
    lm = load_config("configs/gpu/qwen3_vl_8b.yaml").model.llm
    tokens = every["caps"]["llm_rows"] * every["caps"]["llm_row_len"]
    moved = exchange.step_bytes(lm, "gather", tokens, 4, 2) * exchange.FLOPS_PER_BYTE
    for row, split in ((every, 6), (long, long["long_steps"])):
        priced = split * 2 * 8 * moved  # (steps split x microbatches x devices)
        computed = priced / row["exchange_share"]
        assert row["score"] == pytest.approx(row["goodput"] * computed / (computed + priced))
    assert long["exchange_share"] < every["exchange_share"]
    scores = auto["score_by_choice"]  # (none: every sample fits a device's row here)
    assert scores == {"none": alone["goodput"], "long": long["score"], "all": every["score"]}
    assert auto["chose"] == max(scores, key=scores.get) and "score" not in alone


def test_where_every_document_fits_a_device_s_row_auto_may_split_none(tmp_path, monkeypatch):
    """Rows of 256 tokens hold the longest chat (253): `none` is a choice, the run then planned
    and built with mesh.context 1 and the context axis' devices in mesh.data (4 x 2), no
    exchange; a run resumed from it keeps it."""
    cfg = auto_config(tmp_path, "batch.llm_row_len=256")
    run = resolve_run(cfg)
    _, trials = degree.choose(cfg, run.index, run.devices)
    assert set(trials) == {"none", "long", "all"}
    assert trials["none"].exchange == trials["none"].split_steps == 0
    best = max(trials, key=lambda s: trials[s].score)
    assert best == "none"  # (a tiny decoder: any exchange is dear)
    assert (run.cfg.mesh.context, run.cfg.mesh.data, run.mesh.shape["context"]) == (1, 8, 1)
    assert run.spec.long_context == 0 and run.devices == 8
    monkeypatch.setattr(degree, "FLOPS_PER_BYTE", 0.0)  # (free: the best packing)
    free = degree.choose(cfg, run.index, run.devices)[1]
    want = max(free, key=lambda s: free[s].goodput * (1 - 1e-9 * degree.CHOICES.index(s)))
    got = degree.choose(cfg, run.index, run.devices)[0]
    assert (got.mesh.context, got.mesh.context_steps) == (
        (1, "all") if want == "none" else (2, want)
    )
    out = tmp_path / "out"
    write_config(run.cfg, out)
    (out / "checkpoints" / "3").mkdir(parents=True)
    kept = keep_resolved(cfg, out)
    assert (kept.mesh.context, kept.mesh.data, kept.mesh.context_steps) == (1, 8, "all")
    assert kept.batch.llm_tiles == run.cfg.batch.llm_tiles


@pytest.mark.slow  # ~25 s: a short run on the rebuilt mesh, killed and resumed
def test_a_run_whose_auto_chose_none_trains_on_the_mesh_without_groups_and_resumes_exactly(
    tmp_path,
):
    """The trainer under auto's `none`: the mesh rebuilt with mesh.context 1 (4 x 2 data-parallel
    devices), the choice in config.json; killed at step 5 and rerun, step 3's checkpoint is
    resumed on the same mesh and steps 4 and 5 are redone with the very losses they had."""
    from jaxmllm.train import main

    def run():
        cfg = auto_config(tmp_path, "batch.llm_row_len=256")
        train = dict(steps=6, log_every=1, checkpoint_every=3, progress_bar=False)
        return replace(cfg, train=replace(cfg.train, **train))

    def kill_at_5(step, _):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        main(run(), on_step=kill_at_5)
    main(run())
    saved = json.loads((tmp_path / "out" / "config.json").read_text())["mesh"]
    assert (saved["context"], saved["data"], saved["context_steps"]) == (1, 8, "all")
    losses = {}  # (every row metrics.jsonl holds: a redone step's twice)
    for row in map(json.loads, (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()):
        if "loss" in row:
            losses.setdefault(row["step"], []).append(row["loss"])
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and len(losses[4]) == len(losses[5]) == 2
    assert all(len(set(v)) == 1 for v in losses.values())
