"""Hostile and broken input (issue 30), the run side: untrusted HF checkpoints (safetensors
headers, weight maps, config.json sizes) refused naming file and tensor or key before anything is
allocated; config values that destroy a run, exit 2 naming the key; faults during the run (an
update that makes a parameter non-finite, a background save that fails, a restored planner state
that does not fit, a dead stdout / stderr) that stop cleanly or carry on to the checkpoint. The
end-to-end runs are marked slow. The data side: tests/test_hostile.py.

Time bounds here are backstops against a hang (`BACKSTOP_S`), never speed limits.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from jaxmllm.config import load_config
from jaxmllm.hf.safetensors import Checkpoint, CheckpointError, SafetensorsFile, write_checkpoint

from runs import NO_EVAL, TINY_TEXT, child_env, logged_step, train_cmd

ROOT = Path(__file__).resolve().parents[1]
BACKSTOP_S = 60.0  # a hang guard: no input here takes more than a few seconds


# ----------------------------------------------------------------------------- checkpoints


def good_file(tmp_path: Path) -> tuple[Path, dict, bytes]:
    """A valid two-tensor safetensors file, its header and its data bytes."""
    write_checkpoint(
        tmp_path / "ok",
        [("a", np.arange(6, dtype=np.float32).reshape(2, 3)), ("b", np.ones(4, np.int16))],
    )
    raw = (tmp_path / "ok" / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return tmp_path / "ok" / "model.safetensors", json.loads(raw[8 : 8 + n]), raw[8 + n :]


def file_of(header: object, data: bytes, length: int | None = None) -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def broken_headers(header: dict, data: bytes) -> dict[str, bytes]:
    """Each way a header was found to break the reader, and more of each kind."""
    h = lambda **changes: {**header, **changes}
    a = header["a"]
    return {
        "not_an_object": file_of([1, 2], data),
        "a_string": file_of("tensors", data),
        "no_offsets": file_of(h(a={"dtype": "F32", "shape": [2, 3]}), data),
        "no_dtype": file_of(h(a={"shape": [2, 3], "data_offsets": a["data_offsets"]}), data),
        "dtype_list": file_of(h(a={**a, "dtype": ["F32"]}), data),
        "dtype_unknown": file_of(h(a={**a, "dtype": "F33"}), data),
        "negative_shape": file_of(h(a={**a, "shape": [-2, -3]}), data),
        "float_shape": file_of(h(a={**a, "shape": [2.0, 3]}), data),
        "shape_overflow": file_of(h(a={**a, "shape": [1 << 40, 1 << 40]}), data),
        "offsets_past_end": file_of(h(a={**a, "data_offsets": [0, 1 << 40]}), data),
        "offsets_reversed": file_of(h(a={**a, "data_offsets": [24, 0]}), data),
        "shape_not_bytes": file_of(h(a={**a, "shape": [3, 3]}), data),
        "overlapping": file_of(h(b={**header["b"], "data_offsets": [16, 24]}), data),
        "gap": file_of(h(b={**header["b"], "data_offsets": [26, 34]}), data + b"\0\0"),
        "truncated_data": file_of(header, data[:-3]),
        "trailing_data": file_of(header, data + b"junk"),
        "length_past_end": file_of(header, data, length=1 << 40),
        "length_zero": file_of(header, data, length=0),
        "length_huge": file_of(header, data, length=0xFFFFFFFFFFFFFFFF),
        "not_utf8": file_of(b'{"a": "\xff\xfe"}', data),
        "not_json": file_of(b"{not json", data),
        "metadata_list": file_of(h(__metadata__=["x"]), data),
        "metadata_numbers": file_of(h(__metadata__={"format": 1}), data),
        "empty_file": b"",
        "seven_bytes": b"\x01" * 7,
    }


def test_broken_safetensors_headers_are_refused_naming_the_file(tmp_path):
    import safetensors

    _, header, data = good_file(tmp_path)
    for name, raw in broken_headers(header, data).items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(raw)
        with pytest.raises(CheckpointError, match=name) as e:  # (the path names the case)
            SafetensorsFile(path)
        assert str(path) in str(e.value)
        with pytest.raises(Exception):  # noqa: B017  the safetensors library refuses it too
            with safetensors.safe_open(str(path), framework="np") as f:
                [f.get_tensor(k) for k in f.keys()]


def test_weight_maps_name_files_inside_the_directory_only(tmp_path):
    _, header, data = good_file(tmp_path)
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(file_of(header, data))
    d = tmp_path / "ck"
    d.mkdir()
    (d / "shard.safetensors").write_bytes(file_of(header, data))
    (d / "link.safetensors").symlink_to(outside)
    for name, weight_map in {
        "dotdot": {"a": "../elsewhere.safetensors"},
        "absolute": {"a": str(outside)},
        "symlink_out": {"a": "link.safetensors"},
        "not_in_shard": {"c": "shard.safetensors"},
        "not_a_map": ["shard.safetensors"],
        "not_strings": {"a": 3},
    }.items():
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(CheckpointError, match="index.json") as e:
            Checkpoint(d)
        assert "elsewhere" not in str(e.value) or name in ("dotdot", "absolute"), name
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "shard.safetensors", "b": "shard.safetensors"}})
    )
    assert Checkpoint(d).get("a").tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.torch
def test_config_json_sizes_are_checked_before_anything_is_built(tmp_path, monkeypatch):
    import hf_models

    from jaxmllm.hf import load
    from jaxmllm.hf.family import FamilyError
    from jaxmllm.hf.importer import model_section
    from jaxmllm.hf.towers import config_for, load_towers

    source = tmp_path / "llama"
    hf_models.llama(source, tied=False)
    good = json.loads((source / "config.json").read_text())
    for key, value in (
        ("vocab_size", 10**12),
        ("vocab_size", 1e12),
        ("num_hidden_layers", 10**9),
        ("num_attention_heads", 0),
        ("hidden_size", "abc"),
        ("hidden_size", -64),
        ("intermediate_size", True),
    ):
        (source / "config.json").write_text(json.dumps({**good, key: value}))
        start = time.monotonic()
        with pytest.raises(FamilyError, match=f"config.json: {key} = .*whole number"):
            model_section(str(source))
        with pytest.raises(FamilyError, match=key):
            config_for("llm", str(source))
        assert time.monotonic() - start < BACKSTOP_S
    (source / "config.json").write_text(json.dumps({**good, "rms_norm_eps": "tiny"}))
    with pytest.raises(FamilyError, match="config.json: rms_norm_eps = 'tiny' must be a number"):
        model_section(str(source))  # (its kind checked with the sizes: jaxmllm.hf.config_json)
    (source / "config.json").write_text(json.dumps([good]))
    with pytest.raises(FamilyError, match="not a JSON object"):
        model_section(str(source))
    # Sizes that are plausible but not the tensors': refused from the headers, before any
    # parameter buffer is allocated or any tensor read.
    (source / "config.json").write_text(json.dumps({**good, "intermediate_size": 80}))
    monkeypatch.setattr(load, "fill", lambda *a: pytest.fail("allocated before checking"))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight \[96, 64\] in .*safetensors"):
        load_towers(config_for("llm", str(source)), "llm")


# ----------------------------------------------------------------------------- config values


def cli_fails(capsys, *sets: str, out: str = "") -> str:
    """The trainer's command line with these overrides: exit 2; returns its stderr."""
    from jaxmllm.train import cli

    out = out or "/nonexistent-jaxmllm-test-run"
    argv = ["--config", "configs/tiny.yaml", "--set", *NO_EVAL, f"train.output_dir={out}", *sets]
    start = time.monotonic()
    assert cli(argv) == 2
    assert time.monotonic() - start < BACKSTOP_S
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "value",
    [
        "optim.lr=.nan",
        "optim.lr=.inf",
        "optim.lr=-1e-3",
        "optim.b1=1.0",
        "optim.b2=.nan",
        "optim.b1=-0.1",
        "optim.eps=0",
        "optim.eps=.nan",
        "optim.clip_norm=-1",
        "optim.clip_norm=.inf",
        "optim.weight_decay=.nan",
        "optim.min_lr_ratio=2",
        "model.llm.rope_theta=.nan",
        "model.vision.rope_theta=.inf",
        "model.audio.rope_theta=nan",
        "mesh.cpu_devices=100000",
        "mesh.cpu_devices=-1",
    ],
)
def test_config_values_that_destroy_a_run_exit_2_naming_the_key(capsys, value):
    err = cli_fails(capsys, value)
    assert value.split("=")[0].split(".")[1] in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "value",
    [
        "model.llm.width=!!python/object/apply:os.system ['echo pwned']",
        "data.path=[unclosed",
        "optim.lr={a: [}",
        "train.steps=!!binary 'eA=='",
    ],
)
def test_yaml_errors_in_set_exit_2_naming_the_key(capsys, value):
    err = cli_fails(capsys, value)
    assert f"--set {value.split('=')[0]}" in err or value.split("=")[0] in err, err
    assert "Traceback" not in err


def test_an_output_dir_that_cannot_be_written_exits_2_naming_it(capsys, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for out in (a_file, a_file / "run", Path("/proc/jaxmllm-run")):
        err = cli_fails(capsys, "data.synthetic.num_samples=64", out=str(out))
        assert f"train.output_dir={out}" in err and "Traceback" not in err, err


# ----------------------------------------------------------------------------- faults


def tiny_text(out, *sets, steps: int = 6, **train):
    """The cheapest run of the trainer: text only, one layer (compiled once per session)."""
    cfg = load_config("configs/tiny.yaml", [*NO_EVAL, *TINY_TEXT, *sets])
    return replace(
        cfg,
        train=replace(
            cfg.train,
            steps=steps,
            output_dir=str(out),
            log_every=1,
            checkpoint_every=2,
            progress_bar=False,
            **train,
        ),
    )


def nan_after(step: int) -> optax.GradientTransformation:
    """An update that turns NaN from optimizer step `step` on, whatever the gradient."""

    def update(updates, count, params=None):
        bad = count >= step
        return jax.tree.map(lambda u: jnp_where(bad, u * np.nan, u), updates), count + 1

    return optax.GradientTransformation(lambda params: np.zeros((), np.int32), update)


def jnp_where(c, a, b):
    import jax.numpy as jnp

    return jnp.where(c, a, b)


def constant_update(value: float) -> optax.GradientTransformation:
    """Replaces every update by `value` (finite or not), whatever the gradient."""
    import jax.numpy as jnp

    return optax.GradientTransformation(
        lambda params: optax.EmptyState(),
        lambda u, state, params=None: (jax.tree.map(lambda x: jnp.full_like(x, value), u), state),
    )


@pytest.mark.parametrize("update, start", [(np.nan, 1.0), (np.inf, 1.0), (3e38, 3e38)])
def test_an_update_that_makes_a_parameter_non_finite_is_skipped(tmp_path, update, start):
    """The loss and gradient are finite; the update is NaN or inf, or a finite one overflows
    the parameter: the step is skipped like a non-finite gradient (parameters and optimizer
    state kept) and flagged. (The train step's rule, on a stand-in loss; the pipelined step is
    built by the same make_train_step.)"""
    import jax.numpy as jnp

    from jaxmllm.step.program import make_optimizer, make_train_step

    base, schedule = make_optimizer(tiny_text(tmp_path))
    optimizer = optax.chain(base, constant_update(update))
    finite = lambda params, frozen, batch: (jnp.float32(1.0), {"w": jnp.ones_like(params["w"])})
    step = jax.jit(make_train_step(None, optimizer, schedule, finite))
    params = {"w": np.full(4, start, np.float32)}
    state = {"params": params, "frozen": {}, "opt_state": optimizer.init(params), "step": 0}
    new, metrics = step(state, {"llm_loss_mask": np.ones((1, 1, 4), bool)})
    assert float(metrics["nonfinite"]) == 1.0
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new), strict=True):
        if np.ndim(a) or a is not state["step"]:
            np.testing.assert_array_equal(a, b)
    assert int(new["step"]) == 1  # (the step counts; the optimizer's own count does not move)


@pytest.mark.parametrize("loss, grad", [(np.nan, 1.0), (1.0, np.inf), (np.nan, np.nan)])
def test_a_non_finite_loss_or_gradient_is_skipped(tmp_path, loss, grad):
    """A NaN loss or a non-finite gradient (what a NaN in a batch or a diverging learning rate
    gives the real step) through the run's own optimizer: the step is skipped (parameters and
    optimizer state kept), flagged, and counted."""
    import jax.numpy as jnp

    from jaxmllm.step.program import make_optimizer, make_train_step

    optimizer, schedule = make_optimizer(tiny_text(tmp_path))
    given = lambda params, frozen, batch: (
        jnp.float32(loss),
        {"w": jnp.full_like(params["w"], grad)},
    )
    step = jax.jit(make_train_step(None, optimizer, schedule, given))
    params = {"w": np.ones(4, np.float32)}
    state = {"params": params, "frozen": {}, "opt_state": optimizer.init(params), "step": 0}
    new, metrics = step(state, {"llm_loss_mask": np.ones((1, 1, 4), bool)})
    assert float(metrics["nonfinite"]) == 1.0
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new), strict=True):
        if np.ndim(a) or a is not state["step"]:
            np.testing.assert_array_equal(a, b)
    assert int(new["step"]) == 1


def test_a_dead_stderr_never_costs_the_checkpoint_a_signal_asked_for():
    """Ctrl-C on `train | tee log` ends tee too: the handler's message then hit a closed pipe,
    and the BrokenPipeError it raised unwound the loop before the checkpoint. Reproduced with a
    real pipe whose reader is gone."""
    from jaxmllm.loop.guards import Preemption, _Outliving

    read, write = os.pipe()
    os.close(read)  # the reader is gone (tee, head)
    saved = sys.stderr
    try:
        sys.stderr = open(write, "w", buffering=1)  # noqa: SIM115
        preempt = Preemption()
        with pytest.raises(BrokenPipeError):  # the cause, without the wrapper
            os.kill(os.getpid(), signal.SIGINT)
        preempt.restore()
        sys.stderr = _Outliving(sys.stderr)
        preempt = Preemption()
        os.kill(os.getpid(), signal.SIGINT)  # now the loop carries on to its checkpoint
        time.sleep(0.01)
        preempt.restore()
        assert preempt.requested == "SIGINT"
        print("still writable", file=sys.stderr, flush=True)  # (to /dev/null from here on)
    finally:
        sys.stderr = saved


def test_a_background_save_that_fails_is_noticed_at_the_next_step(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.path import async_path

    from jaxmllm.loop import checkpoint

    real = async_path.rename

    async def rename(src, dst, *args, **kwargs):  # the disk fills while step 4 is written
        if Path(dst).name == "4":
            raise OSError(errno.ENOSPC, "No space left on device")
        return await real(src, dst, *args, **kwargs)

    monkeypatch.setattr(async_path, "rename", rename)
    options = ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True)
    mngr = ocp.CheckpointManager(tmp_path / "checkpoints", options=options)
    args = lambda step: ocp.args.Composite(state=ocp.args.StandardSave({"x": np.full(3, step)}))
    stopped = None
    for step in range(1, 9):
        try:
            checkpoint.check_saves(mngr)
            if step % 2 == 0:
                checkpoint.save(mngr, step, args(step))
            while mngr.is_saving_in_progress():  # (a step's work; the write runs meanwhile)
                time.sleep(0.01)
        except checkpoint.SaveError as e:
            stopped, message = step, str(e)
            break
    assert stopped == 5, "the step after the failed save"
    assert f"checkpoint 4 in {tmp_path / 'checkpoints'}" in message
    assert (
        "No space left on device" in message and "latest complete checkpoint is step 2" in message
    )
    checkpoint.wait_for_saves(mngr, close=True)  # (reported once: closes quietly)
    assert checkpoint.complete_steps(tmp_path / "checkpoints") == [2]  # kept (max_to_keep=1)
    with ocp.CheckpointManager(tmp_path / "checkpoints") as again:
        restored = again.restore(2, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    assert restored["state"]["x"].tolist() == [2, 2, 2]


STOPS_AT_START_UP = """
import asyncio, sys
from orbax.checkpoint._src.path import async_path
from jaxmllm.config import load_config
from jaxmllm.loop.checkpoint import make_checkpoint_manager, wait_for_saves

real = async_path.exists
async def slow(path):  # (orbax's clean-up thread, slower than the error that stops the run)
    await asyncio.sleep(0.5)
    return await real(path)
async_path.exists = slow
cfg = load_config("configs/tiny.yaml", [f"train.output_dir={sys.argv[1]}"])
mngr = make_checkpoint_manager(cfg)
wait_for_saves(mngr, close=True)  # (as train.main's exit does, then exit 2)
sys.exit(2)
"""


def test_a_run_that_stops_at_start_up_exits_without_a_traceback(tmp_path):
    """A run stopping right after its checkpoint manager started (a config.json whose sizes
    are not its tensors': exit 2, one line) exited under orbax's clean-up thread, which then
    printed a traceback ("cannot schedule new futures after interpreter shutdown")."""
    cmd = [sys.executable, "-c", STOPS_AT_START_UP, str(tmp_path / "run")]
    done = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]


BAD_STATES = {
    "negative cursor": {"step": 3, "cursor": -5, "deferred": []},
    "cursor not a number": {"step": 3, "cursor": "9", "deferred": []},
    "no step": {"cursor": 5},
    "deferred past the index": {"step": 3, "cursor": 90, "deferred": [[10**6, 1]]},
    "negative deferred": {"step": 3, "cursor": 90, "deferred": [[-1, 1]]},
    "pulled after the step": {"step": 3, "cursor": 90, "deferred": [[5, 7]]},
    "deferred malformed": {"step": 3, "cursor": 90, "deferred": [5, 7]},
    "a list": [3, 90],
}


def test_a_restored_planner_state_that_does_not_fit_is_refused(tmp_path):
    import orbax.checkpoint as ocp

    from jaxmllm.feed.iterator import make_pipeline
    from jaxmllm.loop.checkpoint import restore_latest, save_args
    from jaxmllm.plan.state import PlanStateError
    from jaxmllm.resolve.run import resolve_run

    cfg = load_config("configs/tiny.yaml", ["data.synthetic.num_samples=64", *NO_EVAL])
    run = resolve_run(cfg, 8)  # (once: each pipeline below reuses it)
    pipeline = lambda: make_pipeline(run, prefetch=0)
    it = pipeline()
    steps = [next(it)["info"].samples for _ in range(4)]
    resumed = pipeline()
    resumed.set_state(json.loads(json.dumps(it.get_state())))  # a good state resumes
    np.testing.assert_array_equal(next(resumed)["info"].samples, next(it)["info"].samples)
    assert len(steps) == 4
    for problem, state in BAD_STATES.items():
        with pytest.raises(PlanStateError, match="planner state|data state") as e:
            pipeline().set_state({"planner": state, "load_rejects": {}})
        assert "64 samples" in str(e.value) or "not an object" in str(e.value), problem
    # Through a real checkpoint: refused with the message, and not moved aside as damage.
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    mngr = ocp.CheckpointManager(tmp_path, options=options)
    stamp = {"format": 2, "layers": "scanned"}
    mngr.save(3, args=save_args({"x": np.zeros(2)}, it, stamp))
    data = next((tmp_path / "3" / "data").glob("*.json"))
    state = json.loads(data.read_text())
    state["planner"]["deferred"] = [[999, 0]]
    data.write_text(json.dumps(state))
    abstract = {"x": jax.ShapeDtypeStruct((2,), np.float64)}
    with pytest.raises(PlanStateError, match="deferred sample 999 is past the index's last, 63"):
        restore_latest(mngr, abstract, pipeline(), stamp)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3"]


# ----------------------------------------------------------------------------- end to end


def checkpoint_params(out: Path) -> dict[int, list[np.ndarray]]:
    """Every checkpoint's trained parameters, read back from disk."""
    import orbax.checkpoint as ocp

    steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    got = {}
    with ocp.CheckpointManager(out / "checkpoints") as m:
        for step in steps:
            item = m.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore()))
            got[step] = [np.asarray(x) for x in jax.tree.leaves(item["state"]["params"])]
    return got


@pytest.mark.slow  # a training run and its resume: ~1-2 min on 2 cores
def test_a_run_whose_updates_turn_nan_never_checkpoints_them(tmp_path, monkeypatch):
    from jaxmllm.loop.guards import NonFiniteError
    from jaxmllm.step import program
    from jaxmllm.train import main

    real = program.make_optimizer

    def poisoned(cfg):  # finite loss and gradient throughout; the updates from step 4 on NaN
        optimizer, schedule = real(cfg)
        return optax.chain(optimizer, nan_after(3)), schedule

    monkeypatch.setattr(program, "make_optimizer", poisoned)
    cfg = tiny_text(tmp_path, steps=12, max_nonfinite_steps=3)
    with pytest.raises(NonFiniteError, match=r"last good parameters checkpointed.*Lower optim\.lr"):
        main(cfg)
    saved = checkpoint_params(tmp_path)
    assert saved and max(saved) >= 3
    for step, leaves in saved.items():
        assert all(np.isfinite(x).all() for x in leaves), step
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite"] for r in rows][:3] == [0.0, 0.0, 0.0]
    assert rows[-1]["nonfinite_total"] >= 1
    # Resumed with one step left, the run said `done` with a NaN loss (the count restarted,
    # the last step's flag unread); finished, a rerun said nothing of the stop. Both stop now.
    stopped = max(saved)
    last = replace(cfg, train=replace(cfg.train, steps=stopped + 1))
    with pytest.raises(NonFiniteError, match=f"stopped at step {stopped + 1} with the last good"):
        main(last)
    with pytest.raises(NonFiniteError, match=f"stopped at step {stopped + 1} with the last good"):
        main(last)  # (its checkpoint is at train.steps: not done, stopped)
    saved = checkpoint_params(tmp_path)
    assert max(saved) == stopped + 1
    for step, leaves in saved.items():
        assert all(np.isfinite(x).all() for x in leaves), step


def test_a_failed_saves_cause_names_the_os_error_wherever_tensorstore_puts_it():
    from jaxmllm.loop.checkpoint import save_cause

    # as tensorstore words it on a full tmpfs: the OS error mid-message, a long spec after it
    spec = ", ".join(f'\\"key{i}\\":{i}' for i in range(60))
    message = (
        'RESOURCE_EXHAUSTED: Error opening "zarr" driver: Error writing "params.w/.zarray" in '
        'OCDBT database at local file "/ckpt/4.tmp/": Failed to write 2476 bytes to file 9: No '
        f"space left on device [os_error_code='28'] [tensorstore_spec='{{{spec}}}']"
    )
    cause = save_cause(ValueError(message))
    assert cause.startswith("No space left on device: ValueError: RESOURCE_EXHAUSTED")
    assert len(cause) < 400
    assert save_cause(OSError(errno.EROFS, "Read-only file system")) == (
        "OSError: [Errno 30] Read-only file system"
    )
    wrapped = RuntimeError("write failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "disk full")
    assert save_cause(wrapped) == "No space left on device: RuntimeError: write failed"
    assert save_cause(KeyError()) == "KeyError: "


@pytest.mark.slow  # two training runs: ~2 min on 2 cores
def test_a_full_disk_stops_the_run_within_a_step_keeping_the_last_checkpoint(tmp_path, monkeypatch):
    from orbax.checkpoint._src.path import async_path

    from jaxmllm.loop.checkpoint import SaveError
    from jaxmllm.loop.metrics import read_metrics
    from jaxmllm.train import main

    real = async_path.rename

    async def rename(src, dst, *args, **kwargs):  # a full disk from step 4's checkpoint on
        if Path(dst).parent.name == "checkpoints" and int(Path(dst).name) >= 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return await real(src, dst, *args, **kwargs)

    monkeypatch.setattr(async_path, "rename", rename)
    with pytest.raises(SaveError, match=r"checkpoint 4 .*No space left.*step 2, kept") as e:
        main(tiny_text(tmp_path, steps=10))
    assert str(tmp_path / "checkpoints") in str(e.value)
    assert read_metrics(tmp_path)[-1]["step"] <= 5 + 1  # the failed save's step, then one more
    assert sorted(checkpoint_params(tmp_path)) == [1, 2]  # (orbax saves the first step too)
    monkeypatch.setattr(async_path, "rename", real)  # space freed: the rerun resumes from 2
    main(tiny_text(tmp_path, steps=6))
    assert sorted(checkpoint_params(tmp_path)) == [2, 4, 6]
    assert [r["step"] for r in read_metrics(tmp_path)][-4:] == [3, 4, 5, 6]


@pytest.mark.slow  # a text-only training run in a child process: ~15 s on 2 cores
def test_ctrl_c_with_a_closed_output_pipe_still_checkpoints(tmp_path):
    """`python -m jaxmllm.train ... 2>&1 | tee log`, Ctrl-C: the signal ends tee as well, so
    the run writes to a pipe nobody reads. It must still finish its step, save, and exit 0.
    (The text-only run: what the signal and the pipe do does not depend on the model.)"""
    cmd = train_cmd(
        tmp_path,
        *TINY_TEXT,
        "train.steps=500",
        "train.log_every=1",
        "train.progress_bar=true",
        "train.checkpoint_every=1000",
    )
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 900  # a hang guard: compiling takes minutes on a loaded box
    while logged_step(tmp_path) < 3:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)
    proc.stdout.close()  # tee is gone
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=900) == 0
    last = logged_step(tmp_path)
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert 3 <= last < 500 and saved[-1] == last


@pytest.mark.slow  # a training run on a 5 MB tmpfs: ~1 min; needs permission to mount one
def test_a_real_full_disk_stops_the_run_keeping_the_last_checkpoint(tmp_path):
    """The trainer's command on a disk that fills up: exit code 5, the message, the kept
    checkpoints. (A child process, as a user's run: in-process, a failed save leaves tensorstore
    writes in flight whose late callbacks find orbax's event loop closed; formatted in their
    thread beside pytest's own `ast.parse`, that once broke the test process's end on Python
    3.11's AST recursion counter, CPython gh-106905.)"""
    from jaxmllm.loop.metrics import read_metrics

    disk = tmp_path / "checkpoints"  # room for the first two checkpoints (~2 MB each), no more
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(disk)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root); the patched-writer test covers it")
    sets = [*TINY_TEXT, "train.steps=12", "train.log_every=1", "train.checkpoint_every=2"]
    try:
        done = subprocess.run(
            train_cmd(tmp_path, *sets, "train.progress_bar=false"),
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=600,
        )
        assert done.returncode == 5, done.stderr[-3000:]
        assert re.search(r"checkpoint 4 .*No space left.*step 2, kept", done.stderr), done.stderr
        assert read_metrics(tmp_path)[-1]["step"] <= 6  # noticed within a step of failing
        assert sorted(checkpoint_params(tmp_path)) == [1, 2]
    finally:
        subprocess.run(["umount", str(disk)], check=False)
