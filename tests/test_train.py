"""The trainer end to end on the 8-device CPU mesh: a pulse, and exact resume after an interrupt."""

import json
from dataclasses import replace

import numpy as np
import pytest

from jaxmllm.config import ConfigError, load_config
from jaxmllm.loop.metrics import read_metrics
from jaxmllm.train import main

from runs import NO_EVAL

STEPS = 6


def tiny(out, *sets, **train):
    cfg = load_config("configs/tiny.yaml", ["data.synthetic.num_samples=256", *NO_EVAL, *sets])
    return replace(
        cfg,
        train=replace(
            cfg.train,
            steps=STEPS,
            output_dir=str(out),
            log_every=1,
            checkpoint_every=2,
            progress_bar=False,
            **train,
        ),
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    main(tiny(out, peak_tflops=0.5))  # (a stated peak: CPUs have none, so no MFU otherwise)
    return out


def test_has_a_pulse(uninterrupted):
    rows = read_metrics(uninterrupted)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for key in (
        "loss",
        "grad_norm",
        "lr",
        "step_time_s",
        "tokens_per_s",
        "tflops_per_device",
        "padding/llm",
        "padding/vision",
        "padding/audio",
        *(f"host/{k}_s" for k in ("wait", "plan", "load", "bucketize", "count", "transfer")),
        "host/wait_share",
    ):
        assert all(np.isfinite(r[key]) for r in rows), key
    assert all(r["host/load_s"] > 0 and r["host/bucketize_s"] > 0 for r in rows)
    assert all(r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.5) for r in rows)
    assert rows[0]["loss"] > 3.0  # starts near uniform over the vocabulary
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert json.loads((uninterrupted / "config.json").read_text())["train"]["steps"] == STEPS
    assert sorted(
        p.name for p in (uninterrupted / "checkpoints").iterdir() if p.name.isdigit()
    ) == ["2", "4", "6"]
    assert list((uninterrupted / "tb").iterdir())  # TensorBoard events were written


WRITES = """
import sys
from jaxmllm.loop.metrics import MetricsWriter
writer = MetricsWriter(sys.argv[1])
writer.write(3, {"loss": 1.5, "lr": float("nan")})
writer.close()
print("torch" in sys.modules)
"""


@pytest.mark.torch  # (where torch is installed: the writer leaves it unimported)
def test_metrics_reach_tensorboard_without_importing_torch(tmp_path):
    """tensorboardX imports torch at import where it is installed (seconds of every run's
    start); the metrics writer holds it out. Its events still hold each finite scalar."""
    import struct
    import subprocess
    import sys

    from tensorboardX.proto.event_pb2 import Event

    done = subprocess.run([sys.executable, "-c", WRITES, str(tmp_path)], capture_output=True)
    assert done.returncode == 0 and done.stdout.split() == [b"False"], done.stderr[-2000:]
    (events,) = (tmp_path / "tb").iterdir()
    data, at, scalars = events.read_bytes(), 0, {}
    while at < len(data):  # (TFRecords: length, its CRC, the record, its CRC)
        (length,) = struct.unpack("<Q", data[at : at + 8])
        event = Event.FromString(data[at + 12 : at + 12 + length])
        scalars |= {(event.step, v.tag): v.simple_value for v in event.summary.value}
        at += 12 + length + 4
    assert scalars == {(3, "loss"): 1.5}  # (the NaN not written: TensorBoard has no use for it)


def _timing_steps(out) -> list[int]:
    """The steps of a run's timings.jsonl, line by line (a step written twice shows twice)."""
    return [json.loads(line)["step"] for line in (out / "timings.jsonl").read_text().splitlines()]


def _bucket_work(batch: dict, phases) -> dict:
    """Per (microbatch, device): units, squared segment lengths, tiles, counted one by one."""
    m_n, d_n = batch["llm_segment_ids"].shape[:2]
    out = {}
    for m, d in np.ndindex(m_n, d_n):
        work = {}
        for p in phases:
            rows = batch[f"{p}_segment_ids"][m, d].reshape(-1, batch[f"{p}_segment_ids"].shape[-1])
            sizes = [int((row == i).sum()) for row in rows for i in set(row.tolist()) - {0}]
            work[f"{p}_units"], work[f"{p}_sq"] = sum(sizes), sum(n * n for n in sizes)
            work[f"{p}_tiles"] = int((batch[f"{p}_tiles"][m, d] != -1).all(-1).sum())
        out[m, d] = work
    return out


def test_timings_hold_every_step_with_its_slowest_devices_work(uninterrupted):
    """One row per step; compilation and saved steps marked; the work is, per microbatch, that
    of the device the FLOP model finds costliest (counted here one segment at a time from the
    same steps' batches), summed over microbatches, and the mean device's."""
    from jaxmllm.cost.model import PHASES, CostModel
    from jaxmllm.feed.iterator import make_pipeline
    from jaxmllm.resolve.run import resolve_run

    rows = [json.loads(line) for line in (uninterrupted / "timings.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[0]["compile"] and not any(r["compile"] for r in rows[1:])
    assert all(rows[s - 1]["checkpoint"] for s in (2, 4, 6))
    assert all(r["time_s"] > 0 for r in rows)
    run = resolve_run(tiny(uninterrupted), 8)  # (as the run resolved it)
    cost = CostModel.from_model(run.cfg.model)
    data = make_pipeline(run, prefetch=0)
    for row in rows:
        work = _bucket_work(next(data)["batch"], PHASES)
        m_n = row["microbatches"]
        slow = [max(range(8), key=lambda d: cost.step_cost(work[m, d])) for m in range(m_n)]
        for key in row["slowest"]:
            assert row["slowest"][key] == sum(work[m, d][key] for m, d in enumerate(slow)), key
            mean = sum(w[key] for w in work.values()) / 8
            assert row["mean"][key] == pytest.approx(mean), key
        assert set(row["slowest"]) == {f"{p}_{f}" for p in PHASES for f in ("units", "sq", "tiles")}
    data.close()


def test_frozen_modules_get_no_gradient_and_no_optimizer_state():
    import jax

    from jaxmllm.step.program import init_state, make_optimizer, model_parts

    cfg = load_config(
        "configs/tiny.yaml",
        ["model.vision.freeze=true", "model.projector_freeze=true", "batch.route_pair_capacity=80"],
    )
    parts, _ = model_parts(cfg)
    assert parts.frozen_keys == ("vision", "vision_projector", "audio_projector")
    optimizer, _ = make_optimizer(cfg)
    state = jax.eval_shape(lambda: init_state(cfg, optimizer))
    assert set(state["params"]) == {"audio", "llm"}
    assert set(state["frozen"]) == {"vision", "vision_projector", "audio_projector"}
    # Adam's moments mirror the trainable params only.
    opt_leaves = sum(x.size for x in jax.tree.leaves(state["opt_state"]))
    trainable = sum(x.size for x in jax.tree.leaves(state["params"]))
    assert opt_leaves < 2 * trainable + 16


@pytest.mark.parametrize(
    ("key", "module"),
    [
        ("model.vision.lr_scale", "vision"),
        ("model.projector_lr_scale", "audio_projector"),
        ("model.llm.lr_scale", "llm"),
    ],
)
def test_lr_scale_scales_its_modules_updates_alone(key, module):
    """A module's lr_scale of 0.25 makes its AdamW updates (decay included) a quarter of those
    at 1.0 and leaves every other module's as they were."""
    import jax
    import jax.numpy as jnp

    from jaxmllm.step.program import make_optimizer

    names = ("vision", "audio_projector", "llm")
    params = {m: {"kernel": jnp.ones((2, 2)), "scale": jnp.ones(2)} for m in names}
    grads = jax.tree.map(lambda x: 0.5 * x, params)

    def updates(*overrides):
        cfg = load_config("configs/tiny.yaml", ["optim.warmup_steps=0", *overrides])
        optimizer, _ = make_optimizer(cfg)
        out, _ = optimizer.update(grads, optimizer.init(params), params)
        return out

    base, scaled = updates(), updates(f"{key}=0.25")
    assert float(jnp.abs(base[module]["kernel"]).min()) > 0
    quarter = jax.tree.map(lambda b, s: jnp.allclose(s, 0.25 * b), base[module], scaled[module])
    assert jax.tree.all(quarter)
    for other in set(names) - {module}:
        assert jax.tree.all(jax.tree.map(jnp.array_equal, scaled[other], base[other]))


@pytest.mark.parametrize(
    "key", ["model.audio.lr_scale", "model.projector_lr_scale", "model.llm.lr_scale"]
)
@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_lr_scale_must_be_positive_and_finite(key, value):
    with pytest.raises(ConfigError, match="lr_scale"):
        load_config("configs/tiny.yaml", [f"{key}={value}"])


def test_weight_decay_applies_to_matrices_only():
    """Stacked layers included: decay iff a param has 2+ dims besides `layers`."""
    import jax

    from jaxmllm.step.program import build_model, decay_mask, model_parts

    cfg = load_config("configs/tiny.yaml", ["batch.route_pair_capacity=80"])
    _, axes = model_parts(cfg)
    params, _ = jax.eval_shape(lambda: build_model(cfg, 0))
    names = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    mask = jax.tree.leaves(decay_mask(params))
    assert mask == [len([n for n in axes if n != "layers"]) >= 2 for axes in names]
    assert True in mask and False in mask


def test_output_dir_of_an_incompatible_run_is_refused_with_the_differences(uninterrupted):
    from jaxmllm.config import ConfigError

    cfg = tiny(uninterrupted)
    wider = replace(cfg, model=replace(cfg.model, llm=replace(cfg.model.llm, width=64)))
    with pytest.raises(ConfigError, match=r"model\.llm\.width: 128 -> 64.*new train\.output_dir"):
        main(wider)


def test_torn_checkpoints_fall_back_to_the_previous_complete_one(uninterrupted, tmp_path, caplog):
    import logging
    import shutil

    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    ckpts = out / "checkpoints"
    shutil.rmtree(ckpts / str(STEPS) / "state")  # the newest one damaged after it was committed
    shutil.rmtree(ckpts / "2" / "meta")  # the oldest half deleted (a kill during orbax's clean-up
    (ckpts / "2" / "_CHECKPOINT_METADATA").unlink()  # of old steps): not taken for an old format
    tmp = ckpts / f"{STEPS + 2}.orbax-checkpoint-tmp-1234"  # and a save cut short by a kill
    tmp.mkdir()
    (tmp / "partial").write_text("x")
    with caplog.at_level(logging.WARNING, logger="jaxmllm"):
        main(tiny(out))
    assert f"discarding {tmp.name}" in caplog.text
    assert f"checkpoint {STEPS} cannot be restored" in caplog.text
    names = [p.name for p in ckpts.iterdir()]
    assert any(n.startswith(f"{STEPS}.unreadable-") for n in names)  # moved aside, not deleted
    assert not any("orbax-checkpoint-tmp" in n for n in names)
    assert (ckpts / str(STEPS) / "state").exists()  # written again by the resumed run
    got = {r["step"]: r for r in read_metrics(out)}  # later rows (the replay) win
    want = {r["step"]: r for r in read_metrics(uninterrupted)}
    for step in (STEPS - 1, STEPS):
        np.testing.assert_allclose(got[step]["loss"], want[step]["loss"], rtol=1e-5)


# (pytest's own hook takes unraisable exceptions as warnings, so they fail the test too)
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_run_whose_checkpoints_are_all_damaged_stops_with_one_error_and_no_tracebacks(
    uninterrupted, tmp_path, capfd
):
    """Each failed restore leaves orbax's other reads of that checkpoint in flight, finishing
    after orbax closed their event loop: counted by jaxmllm.process.late_io, not printed (73
    "Event loop is closed" tracebacks before)."""
    import gc
    import shutil
    import time

    from jaxmllm.process import late_io

    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    for data in (out / "checkpoints").glob("*/state/d/*"):
        data.write_bytes(data.read_bytes()[:10])  # every checkpoint's arrays cut short
    with pytest.raises(ConfigError, match=r"no checkpoint in .*checkpoints could be restored"):
        main(tiny(out))
    settled, seen = time.monotonic(), late_io.late_completions()
    while time.monotonic() - settled < 1.0:  # the abandoned reads finish within milliseconds
        time.sleep(0.1)
        if late_io.late_completions() != seen:
            settled, seen = time.monotonic(), late_io.late_completions()
    gc.collect()  # (abandoned reads that failed on the loop log "never retrieved" when collected)
    err = capfd.readouterr().err
    assert "Event loop is closed" not in err and "Traceback" not in err, err[-2000:]


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_checkpoints_of_another_width_stop_with_one_line_and_no_abandoned_reads(
    uninterrupted, tmp_path, capfd
):
    """Checkpoints copied without their config.json, resumed by a model of another width: the
    run's error came after an "Exception ignored" traceback with a ~70-line TensorStore spec
    for each read orbax abandoned. The shapes are checked against the checkpoint's metadata
    before anything is read now: one error naming a tensor, the checkpoints left as they were."""
    import gc
    import shutil

    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    (out / "config.json").unlink()
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    with pytest.raises(ConfigError) as err:
        main(tiny(out, "model.llm.width=64"))
    gc.collect()  # (the abandoned reads' coroutines printed their tracebacks when collected)
    line = str(err.value)
    assert f"checkpoint {STEPS} in {out / 'checkpoints'} is of a model of another size" in line
    assert "its params/" in line and "is (128,), this config's (64,) (60 tensors differ)" in line
    assert "\n" not in line and "Exception ignored" not in capfd.readouterr().err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


def test_late_completions_of_abandoned_reads_are_counted_and_others_passed_on(monkeypatch):
    """The mechanism on its own: a tensorstore future awaited on orbax's loop completes after
    the coroutine failed and orbax closed the loop. Any other unraisable exception goes to the
    hook that was there before."""
    import asyncio
    import sys

    import tensorstore as ts
    from orbax.checkpoint._src import asyncio_utils

    from jaxmllm.process import late_io

    passed_on = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: passed_on.append(str(u.exc_value)))
    late_io.install()
    promise, future = ts.Promise.new()

    async def restore():
        async def read():
            await future

        asyncio.ensure_future(read())
        await asyncio.sleep(0)  # the read awaits: tensorstore holds a callback into this loop
        raise ValueError("one read failed")

    before = late_io.late_completions()
    with pytest.raises(ValueError):
        asyncio_utils.run_sync(restore())
    promise.set_result(1)  # the abandoned read completes: its callback meets the closed loop
    assert late_io.late_completions() == before + 1

    class Other:
        def __del__(self):
            raise RuntimeError("other")

    Other()  # (its __del__'s exception is unraisable too)
    assert passed_on == ["other"]


@pytest.mark.parametrize("task", ["future", "orbax"])
def test_reads_that_fail_after_the_restore_raised_are_counted_and_other_records_logged(
    task, caplog
):
    """The other ending: an abandoned read fails while orbax's loop still runs, so its task
    holds an exception no one retrieves, which asyncio logs with a traceback when the task is
    collected (CI, under load). Counted instead; asyncio's other records are logged. CI met
    both kinds of task: a TensorStore future wrapped as one, and an orbax coroutine (its
    `async_deserialize`) that awaited one, its frames holding no future."""
    import asyncio
    import gc
    import logging

    import tensorstore as ts
    from orbax.checkpoint._src import asyncio_utils

    from jaxmllm.process import late_io

    late_io.install()
    promise, future = ts.Promise.new()
    held = [future]

    async def read():  # (the future a temporary here, as in orbax's `await ts.open(...)`)
        return await held.pop()

    async def restore():
        if task == "future":
            asyncio.ensure_future(held.pop())  # one of the checkpoint's reads, in flight
        else:  # (asyncio_utils.cancellable: a frame of orbax's code around the read)
            asyncio.ensure_future(asyncio_utils.cancellable(read()))
        await asyncio.sleep(0)
        promise.set_exception(ValueError("OUT_OF_RANGE: a damaged array"))
        await asyncio.sleep(0.05)  # it fails on the loop ...
        raise ValueError("another read failed")  # ... after the restore gave up

    before = late_io.late_completions()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with pytest.raises(ValueError, match="another read failed"):
            asyncio_utils.run_sync(restore())
        gc.collect()
        assert late_io.late_completions() == before + 1, caplog.text
        assert "never retrieved" not in caplog.text
        logging.getLogger("asyncio").error("Task exception was never retrieved (another task)")
    assert "(another task)" in caplog.text


def test_format_stamp_tells_per_layer_from_scanned_layers():
    from jaxmllm.loop.checkpoint import FORMAT, format_stamp

    per_layer = {"llm": {"transformer": {"blocks": {0: {"w": 1}, 1: {"w": 1}}}}}
    scanned = {"llm": {"transformer": {"blocks": {"w": 1}}}}
    assert format_stamp(per_layer) == {"format": FORMAT, "layers": "per_layer"}
    assert format_stamp(scanned) == {"format": FORMAT, "layers": "scanned"}


def test_replicated_arrays_are_split_over_replicas_only_when_big(tmp_path, caplog):
    """Orbax's replica-parallel save compiles a slice program per array shape: a replicated
    array smaller than REPLICA_SLICE_MIN_BYTES a replica is written whole by one replica, a
    bigger one split over all 8 (a program for each replica's device); both come back as saved,
    and the handler's registration is not a warning in the run's log."""
    import jax
    import orbax.checkpoint as ocp

    from jaxmllm.loop.checkpoint import REPLICA_SLICE_MIN_BYTES, make_checkpoint_manager

    replicated = jax.sharding.NamedSharding(jax.make_mesh((8,), ("data",)), jax.P())
    n_big = 8 * REPLICA_SLICE_MIN_BYTES // 4
    state = {  # (shapes no other test saves: their slice programs are compiled here or never)
        "small": jax.device_put(np.arange(8 * 37, dtype=np.float32).reshape(8, 37), replicated),
        "big": jax.device_put(np.arange(n_big, dtype=np.float32).reshape(8, -1), replicated),
    }
    slices = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration" and kw["fun_name"] == "jit(slice)":
            slices.append(kw)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        cfg = load_config("configs/tiny.yaml", [f"train.output_dir={tmp_path}"])
        mngr = make_checkpoint_manager(cfg)
        mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state)), force=True)
        mngr.wait_until_finished()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert "overriding" not in caplog.text
    assert len(slices) == 8  # the big array's, one a replica; none for the small one
    back = mngr.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore(state)))
    mngr.close()
    for key, value in state.items():
        np.testing.assert_array_equal(np.asarray(back["state"][key]), np.asarray(value))


@pytest.mark.slow  # (a run of the trainer over checkpoints of another format)
def test_checkpoints_of_another_format_are_refused_and_left_alone(
    uninterrupted, tmp_path, monkeypatch, capsys
):
    import grain
    import orbax.checkpoint as ocp

    from jaxmllm import train
    from jaxmllm.loop import checkpoint

    def unstamped(state, data_iter, stamp):  # what the trainer saved before the format stamp
        return ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data_iter)
        )

    with monkeypatch.context() as m:
        m.setattr(train, "save_args", unstamped)
        cfg = tiny(tmp_path)
        main(replace(cfg, train=replace(cfg.train, steps=2)))
    ckpts = tmp_path / "checkpoints"
    before = sorted(p.name for p in ckpts.iterdir())
    assert "2" in before and not (ckpts / "2" / "meta").exists()
    argv = ["--config", "configs/tiny.yaml", "--set", "data.synthetic.num_samples=256", *NO_EVAL]
    code = train.cli([*argv, f"train.output_dir={tmp_path}", "train.progress_bar=false"])
    err = capsys.readouterr().err
    assert code == 2, err  # a config error: nothing trained, nothing moved, nothing deleted
    assert f"checkpoint 2 in {ckpts.absolute()} has no format stamp" in err, err
    assert "Use a new train.output_dir" in err
    assert sorted(p.name for p in ckpts.iterdir()) == before

    # A stamp of another format (e.g. a later version's) is refused the same way.
    mngr = checkpoint.make_checkpoint_manager(tiny(uninterrupted))
    stamp = mngr.restore(STEPS, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    checkpoint.check_format(mngr, STEPS, stamp)  # its own: accepted
    with pytest.raises(ConfigError, match=rf"checkpoint {STEPS} in .* has \{{'format': "):
        checkpoint.check_format(mngr, STEPS, {**stamp, "format": checkpoint.FORMAT + 1})
    mngr.close()


# ----------------------------------------------------------------------------- generation, eval


EVAL = (
    "data.eval.source=synthetic",
    "data.eval.samples=32",
    "data.eval.questions=4",
    "data.eval.max_new_tokens=8",
    "train.eval_every=2",
)


def evaluated(out):
    return tiny(out, *EVAL)


@pytest.mark.slow  # (three runs: one evaluating, one interrupted, its rerun resuming)
def test_evaluation_at_its_interval_changes_no_loss_and_an_interrupt_resumes_exactly(
    uninterrupted, tmp_path, capsys
):
    """Eval metrics at every eval_every steps (and the last), per modality mix; the training
    losses those runs log are the same as without evaluation. A run interrupted at step 3 and
    rerun with the same command resumes from its step-2 checkpoint (step 3's first timing row
    dropped, each process's first step marked as compiled): every step's loss, gradient norm,
    token and sample counts are those of the run never interrupted, and it evaluates at the
    same steps to the same values (the eval set is fixed). (Resuming exactly after a kill:
    test_crash and test_preemption.)"""
    full, cut = tmp_path / "full", tmp_path / "cut"
    main(evaluated(full))
    assert "Held-out questions after step 6" in capsys.readouterr().out

    def interrupt_at_3(step, _):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        main(evaluated(cut), on_step=interrupt_at_3)
    assert read_metrics(cut)[-1]["step"] == 3
    assert _timing_steps(cut) == [1, 2, 3]
    main(evaluated(cut))  # the same command again: resumes from step 2's checkpoint
    assert _timing_steps(cut) == list(range(1, STEPS + 1))  # step 3's first row dropped
    timings = [json.loads(line) for line in (cut / "timings.jsonl").read_text().splitlines()]
    assert [r["step"] for r in timings if r["compile"]] == [1, 3]  # each process's first step
    plain, rows, resumed = (read_metrics(p) for p in (uninterrupted, full, cut))
    want = {r["step"]: r for r in plain}
    got = {r["step"]: r for r in resumed}
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm", "loss_tokens", "samples"):
            np.testing.assert_allclose(got[step][key], want[step][key], rtol=1e-5, err_msg=key)
    assert [r["step"] for r in rows if "eval/loss" in r] == [2, 4, 6]
    assert [r["step"] for r in resumed if "eval/loss" in r] == [2, 4, 6]
    np.testing.assert_array_equal([r["loss"] for r in rows], [r["loss"] for r in plain])
    for a, b in zip(resumed, rows, strict=True):
        for key in [k for k in b if k.startswith("eval/") or k == "loss"]:
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, err_msg=key)
    last = rows[-1]
    for mix in ("text", "image", "audio"):
        assert 0 < last[f"eval/loss/{mix}"] < rows[1][f"eval/loss/{mix}"]  # (it learns)
        assert 0 <= last[f"eval/accuracy/{mix}"] <= 1
    assert 0 <= last["eval/answers/exact"] <= 1
    marked = [json.loads(line) for line in (full / "timings.jsonl").read_text().splitlines()]
    assert [r["step"] for r in marked if r.get("eval")] == [2, 4, 6]  # (kept out of the fit)

    # The run's checkpoints answer on the command line (its config, tokenizer and template).
    from jaxmllm import generate

    capsys.readouterr()
    run = ["--run", str(full), "--max-new-tokens", "6", "--json", "--prompt", "12 13 14"]
    assert generate.main([*run, "--prompt", "7"]) == 0
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(answers) == 2 and all(1 <= len(a["ids"]) <= 6 for a in answers)
    assert generate.main([*run, "--step", "2"]) == 0  # (another checkpoint)


# (The README's first run, shortened, answers held-out questions well above chance:
# tests/test_preference_learn.py, on the SFT run its DPO run starts from.)
