"""The trainer with pipeline stages: exact resume, and a checkpoint resumed under another stage
count (checkpoints hold the stacked layers as [depth, ...], whatever the stages)."""

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from jaxmllm.config import load_config
from jaxmllm.loop.metrics import read_metrics
from jaxmllm.train import main

from runs import NO_EVAL

STEPS = 6
STAGE2 = ["mesh.stage=2", "mesh.data=4", "mesh.fsdp=1"]
UNPIPELINED = ["mesh.stage=1", "mesh.data=4", "mesh.fsdp=1", "mesh.tensor=2"]  # the same buckets


def tiny(out, mesh, steps=STEPS, *more):
    cfg = load_config("configs/tiny.yaml", ["data.synthetic.num_samples=256", *mesh, *more])
    train = dict(steps=steps, output_dir=str(out), log_every=1, checkpoint_every=2)
    return replace(cfg, train=replace(cfg.train, progress_bar=False, **train))


def stop_at(step):
    def hook(done, _):
        if done == step:
            raise KeyboardInterrupt

    return hook


def assert_same_steps(got_dir, want_dir, steps):
    got = {r["step"]: r for r in read_metrics(got_dir)}  # (a step run twice: its later row)
    want = {r["step"]: r for r in read_metrics(want_dir)}
    for step in steps:
        for key in ("loss", "grad_norm", "loss_tokens"):
            np.testing.assert_allclose(got[step][key], want[step][key], rtol=1e-5, err_msg=key)


@pytest.mark.slow  # runs of the pipelined tiny model (one compile, then cached) and one without
def test_pipelined_run_resumes_exactly_and_under_another_stage_count(tmp_path):
    """Stage 2 interrupted at step 3 resumes from step 2; interrupted again at 4, it resumes
    without a pipeline (tensor 2 instead: the same data-parallel buckets, so the same batches):
    every step's loss and gradient norm are those of the run that was never interrupted. (The
    run never interrupted evaluates at its end, as tiny.yaml does: the suite's evaluation under
    pipeline stages; the resumed runs, compared on their training steps alone, do not.)"""
    main(tiny(tmp_path / "whole", STAGE2))
    out = tmp_path / "resumed"
    for mesh, stop in ((STAGE2, 3), (STAGE2, 4)):
        with pytest.raises(KeyboardInterrupt):
            main(tiny(out, mesh, STEPS, *NO_EVAL), on_step=stop_at(stop))
    main(tiny(out, UNPIPELINED, STEPS, *NO_EVAL))
    assert_same_steps(out, tmp_path / "whole", range(1, STEPS + 1))


@pytest.mark.slow  # ~80 s (quiet 2-core box): 8 pipelined steps, a compile per variant (3)
def test_one_compiled_program_per_step_variant_over_8_steps():
    """The step's mix picks the variant (these 8 steps: three, the commonest again after each
    other): each compiles once, whatever the order they come in."""
    import jax

    import sharding
    from jaxmllm.feed.iterator import make_pipeline
    from jaxmllm.resolve.run import resolve_run
    from jaxmllm.step.stages.program import build_program

    varied = [
        "batch.capacity=fixed",
        "batch.vision_patches=640",
        "batch.audio_frames=256",
        "batch.route_pair_capacity=160",
        "data.synthetic.audio_fraction=0.1",
        "pipeline.encoder_fractions=[0, 0.5, 1]",
        "train.steps=8",
    ]
    cfg = load_config("configs/tiny.yaml", ["data.synthetic.num_samples=256", *STAGE2, *varied])
    run = resolve_run(cfg)
    cfg, mesh = run.cfg, run.mesh
    used = []
    with jax.set_mesh(mesh):
        prog = build_program(cfg, mesh)
        state = prog.init()
        to_device = lambda host: sharding.make_global_batch(host, mesh)
        data = make_pipeline(run, to_device=to_device)
        for _ in range(8):
            element = next(data)
            used.append(element["info"].variant)
            state, metrics = prog.step(state, element["batch"])
        data.close()
    assert np.isfinite(float(metrics["loss"]))
    assert len(set(used)) > 1  # the step's mix chose more than one variant
    assert len(used) > len(set(used))  # and one of them again (a recompile would show)
    assert prog.step._cache_size() == len(set(used))


@pytest.mark.slow  # one compile of the pipelined tiny model in bfloat16, in its own process
def test_bfloat16_pipelined_run_trains(tmp_path):
    """bfloat16 activations through the stages: XLA's CPU compiler aborted the process on the
    bfloat16 all-reduce / reduce-scatter of the pipeline's backward (the head's broadcast from
    the last stage, the data-parallel encoders' gather); a subprocess, so an abort fails the
    test instead of ending the session."""
    out = tmp_path / "bf16"
    sets = [
        "model.compute_dtype=bfloat16",
        "model.remat=full",
        "train.steps=2",
        f"train.output_dir={out}",
        "train.log_every=1",
        "train.progress_bar=false",
        "train.eval_every=0",
        "data.synthetic.num_samples=256",
    ]
    cmd = [sys.executable, "-m", "jaxmllm.train", "--config", "configs/pipeline.yaml"]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(np.isfinite(r["loss"]) and 5.0 < r["loss"] < 7.0 for r in rows), rows
