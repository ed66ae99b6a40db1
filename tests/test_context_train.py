"""Training with context groups (issue 14): one compiled step, exact resume, and a checkpoint
resumed with another mesh.context (the parameters do not depend on it; the planner's state
plans the new groups, so every sample is still trained once per epoch)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import replace

import jax
import numpy as np
import pytest

from jaxmllm.config import load_config
from jaxmllm.data.index import build_index
from jaxmllm.data.source import make_source
from jaxmllm.feed.iterator import make_pipeline
from jaxmllm.loop import ledger
from jaxmllm.plan.contract import OversizeError, check_fits
from jaxmllm.resolve.run import resolve_run
from jaxmllm.resolve.sizing import capacities
from jaxmllm.train import main

SAMPLES, STEPS = 256, 6


def context_run(out, data: int, context: int, steps: int = STEPS):
    """tiny.yaml on a data x context mesh (64 LLM tokens a device), a checkpoint every 2 steps,
    the sample ledger on, no evaluation (test_eval's evaluates with context groups)."""
    cfg = load_config(
        "configs/tiny.yaml",
        [
            f"data.synthetic.num_samples={SAMPLES}",
            "data.eval.source=none",
            f"mesh.data={data}",
            "mesh.fsdp=1",
            f"mesh.context={context}",
            "batch.llm_row_len=64",
        ],
    )
    train = dict(steps=steps, output_dir=str(out), log_every=1, checkpoint_every=2)
    return replace(cfg, train=replace(cfg.train, progress_bar=False, ledger=True, **train))


def _losses(out) -> dict[int, list[float]]:
    """step -> every loss metrics.jsonl holds for it, in order (a redone step twice)."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    got: dict[int, list[float]] = {}
    for row in rows:
        if "loss" in row:
            got.setdefault(row["step"], []).append(row["loss"])
    return got


def _compiles(caplog) -> int:
    return sum("Compiling jit(train_step)" in r.getMessage() for r in caplog.records)


@pytest.mark.slow  # ~3 training runs of a few steps (each compiles its step once)
def test_context_groups_train_with_one_program_resume_exactly_and_change_size(
    tmp_path, caplog, capsys
):
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING):
            # data=2 x context=4, stopped after step 3 (checkpoints at 2), then rerun: step 3
            # is redone from the step-2 checkpoint with the same samples and the same loss.
            def interrupt_at_3(step, _):
                if step == 3:
                    raise KeyboardInterrupt

            with pytest.raises(KeyboardInterrupt):
                main(context_run(tmp_path, 2, 4), on_step=interrupt_at_3)
            assert _compiles(caplog) == 1
            caplog.clear()
            main(context_run(tmp_path, 2, 4))
            assert _compiles(caplog) == 1  # one program for all its steps, whatever they hold
            caplog.clear()
            # The same checkpoints, now data=1 x context=8, for 4 more steps.
            main(context_run(tmp_path, 1, 8, steps=STEPS + 4))
            assert _compiles(caplog) == 1
    finally:
        jax.config.update("jax_log_compiles", False)
    printed = capsys.readouterr().out
    assert "resumed from checkpoint at step 2 in" in printed
    assert f"resumed from checkpoint at step {STEPS} in" in printed
    losses = _losses(tmp_path)
    assert losses[3][0] == losses[3][1]  # the redone step: bit for bit
    assert sorted(losses) == list(range(1, STEPS + 5))
    assert np.mean([v[-1] for k, v in losses.items() if k > STEPS]) < losses[1][0]
    assert ledger.check_replays(tmp_path) == []
    audit = ledger.audit(tmp_path, range(1, STEPS + 5))
    assert audit["missing_steps"] == []
    counts = Counter(audit["text"])
    assert set(counts.values()) == {1} and len(counts) > 100  # within the epoch: once each
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["mesh"]["context"] == 8


def test_a_context_size_too_small_for_the_data_is_refused_naming_the_keys():
    """A group's row must hold the data's longest sample (94 tokens): groups of 4 devices of 32
    tokens do, groups of 2 and single devices do not, and the message names the keys."""
    cfg = load_config(
        "configs/tiny.yaml",
        [
            f"data.synthetic.num_samples={SAMPLES}",
            "mesh.data=2",
            "mesh.fsdp=1",
            "mesh.context=4",
            "batch.llm_row_len=32",
            "batch.route_pair_capacity=80",
        ],
    )
    _, index = make_source(cfg)
    check_fits(index, capacities(cfg, 8))  # 4 x 32 tokens hold every sample
    alone = replace(cfg, mesh=replace(cfg.mesh, data=8, context=1))
    with pytest.raises(OversizeError, match=r"more than batch\.llm_row_len=32"):
        check_fits(index, capacities(alone, 8))
    half = replace(cfg, mesh=replace(cfg.mesh, data=4, context=2))
    assert 64 < index.llm_tokens({"vision": 4, "audio": 4}).max() <= 128
    with pytest.raises(OversizeError, match=r"batch\.llm_row_len x mesh\.context"):
        check_fits(index, capacities(half, 8))


def test_a_long_document_of_real_records_trains_whole_in_its_context_group(tmp_path):
    """mesh.context=4 with 256 tokens a device: a JSONL document of 601 tokens, more than a
    device's share, fits its group's row of 1,024. data.on_oversize (shrink, the default)
    leaves it whole, since a sample's cap is the group's row (`BatchSpec.group_row_len`), and
    the feed puts every token of every planned sample in the step's rows."""
    path = tmp_path / "docs.jsonl"
    records = [
        {"id": f"r{i}", "text": ("long document " * 50)[:599] if i % 4 == 0 else "short " * i}
        for i in range(48)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = load_config(
        "configs/tiny.yaml",
        [
            "data.source=jsonl",
            f"data.path={path}",
            f"data.index_dir={tmp_path / 'index'}",
            "data.eval.source=none",
            "mesh.data=2",
            "mesh.fsdp=1",
            "mesh.context=4",
            "batch.llm_row_len=256",
            "train.steps=4",
        ],
    )
    build_index(cfg, path, progress=False)
    run = resolve_run(cfg)
    lengths = run.index.llm_tokens(run.spec.per_token)
    assert lengths.max() == 601 and run.spec.group_row_len == 1024
    assert run.source.startup_rejects == []  # nothing shrunk, truncated or skipped
    it = make_pipeline(run, prefetch=0)
    long = 0
    for _ in range(3):
        info = next(it)["info"]
        assert info.tokens == lengths[info.samples].sum()  # every planned token is in the rows
        long += int((lengths[info.samples] == 601).sum())
    assert long > 0


EVERY = 4  # per_step_run's checkpoints: a step's plans wait for a long step at most 3 steps


def per_step_run(out, data_path, steps: int, strategy: str = "gather", which: str = "long"):
    """Text chats with one long document in 16 (`test_ladder._records`) on data=4 x context=2,
    context groups in the long steps only (mesh.context_steps: `which`, long or auto, which
    chooses long here: a tiny decoder's exchange is dear): a device's row of 128 tokens in the
    base steps, a group's of 256 in the long ones; tiles sized from the data; a checkpoint every
    3 steps; the long steps' groups attend by `strategy`."""
    sets = [
        f"mesh.context_strategy={strategy}",
        "data.eval.source=none",
        "data.workers=0",
        "data.source=files",
    ]
    sets += [f"data.path={data_path}", "batch.llm_row_len=128", "batch.attention_block=16"]
    sets += ["batch.microbatches=1", "mesh.data=4", "mesh.fsdp=1", "mesh.context=2"]
    cfg = load_config("configs/manifest_example.yaml", [*sets, f"mesh.context_steps={which}"])
    train = dict(steps=steps, output_dir=str(out), log_every=1, checkpoint_every=EVERY)
    return replace(cfg, train=replace(cfg.train, progress_bar=False, ledger=True, **train))


@pytest.mark.slow  # ~30 s: a short run killed and rerun, two compiled programs
def test_a_context_degree_per_step_trains_every_sample_once_and_resumes_exactly(
    tmp_path, monkeypatch
):
    """Issue 57's acceptance: with groups in the long steps only, a run trains base and long
    steps (the metrics say which), every sample once in an epoch (the ledger holds exactly
    what the planner planned, which with what still waits is what it pulled from the epoch's
    stream), and killed once it has run a long and a base step since its last checkpoint and
    rerun from that checkpoint it redoes both with the very losses it had, bit for bit. Its
    long steps exchange heads (ulysses); what a strategy changes is the long program alone,
    whose math is
    `test_context.test_a_context_degree_per_step_runs_each_variant_with_its_model_on_one_mesh`'s
    under ulysses and, under gather,
    `test_context.test_rows_split_over_context_groups_equal_the_unsplit_reference`'s (plans,
    the ledger and resuming do not depend on it). The run says mesh.context_steps: auto,
    which chooses long at start-up and records it."""
    strategy = "ulysses"
    from test_ladder import _records

    from jaxmllm.loop.metrics import read_metrics
    from jaxmllm.plan import ladder
    from jaxmllm.plan.stream import stream_of
    from jaxmllm.resolve.sizing import planner_from_config

    monkeypatch.setattr(ladder, "LONG_WAIT", 3)  # (long steps within the short run)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _records(64, 16)))
    steps = 7
    build_index(per_step_run(tmp_path, data, steps, strategy, "auto"), progress=False)

    since = []  # (whether each step since the last checkpoint was long)

    def kill_once_both_ran_since_a_checkpoint(step, metrics):
        if step % EVERY == 0:  # (its checkpoint is written before this hook)
            since.clear()
            return
        since.append(metrics["long_variant"] > 0)
        if step > EVERY and any(since) and not all(since):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        main(
            per_step_run(tmp_path, data, steps, strategy, "auto"),
            on_step=kill_once_both_ran_since_a_checkpoint,
        )
    main(per_step_run(tmp_path, data, steps, strategy, "auto"))
    assert json.loads((tmp_path / "config.json").read_text())["mesh"]["context_steps"] == "long"
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    losses = _losses(tmp_path)
    assert sorted(losses) == list(range(1, steps + 1)) and np.isfinite(rows[-1]["loss"])
    redone = [k for k, got in losses.items() if len(got) == 2]
    assert len(redone) == len(since) and all(losses[k][0] == losses[k][1] for k in redone)
    used = {r["step"]: int(r["long_variant"]) for r in rows}
    # (both programs redone from the checkpoint)
    assert {used[k] > 0 for k in redone} == {True, False}
    # The plans replayed from the resolved config: the variants logged, the ledger exactly them
    cfg = per_step_run(tmp_path, data, steps, strategy)
    resolved = json.loads((tmp_path / "config.json").read_text())["batch"]
    tiles = {k: tuple(v) if isinstance(v, list) else v for k, v in resolved.items()}
    cfg = replace(cfg, batch=replace(cfg.batch, **tiles))
    _, index = make_source(cfg)
    planner = planner_from_config(cfg, index, 8)
    plans = [planner.plan() for _ in range(steps)]
    assert [p.variant for p in plans] == [used[k] for k in range(1, steps + 1)]
    assert ledger.check_replays(tmp_path) == []  # steps 4 and 5, redone, trained the same
    audit = ledger.audit(tmp_path, range(1, steps + 1))
    planned = Counter(s for p in plans for s in p.samples.tolist())
    assert audit["missing_steps"] == [] and audit["text"] == planned
    pulled = stream_of(index, cfg.data.seed).take(0, planner.cursor).tolist()
    assert planned + Counter(planner.deferred[:, 0].tolist()) == Counter(pulled)
    n, full = len(index), len(pulled) // len(index)  # (the stream: each epoch every sample once)
    assert full >= 2 and all(
        sorted(pulled[e * n : (e + 1) * n]) == list(range(n)) for e in range(full)
    )
    assert set(planned) == set(range(n)) and max(planned.values()) <= -(-len(pulled) // n)
