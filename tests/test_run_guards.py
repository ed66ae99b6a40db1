"""A run's output folder and start-up under issue 50's probe: two runs on one output_dir (a
lock), a refused resume that rewrote config.json first, a signal at start-up that said
nothing, a step that hangs (the step watchdog)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from jaxmllm.config import ConfigError, load_config
from jaxmllm.loop.lock import LOCK, hold_output_dir

from runs import NO_EVAL, child_env


def tiny(out, *sets, steps: int = 2):
    cfg = load_config("configs/tiny.yaml", ["data.synthetic.num_samples=256", *NO_EVAL, *sets])
    return replace(
        cfg,
        train=replace(
            cfg.train, steps=steps, output_dir=str(out), checkpoint_every=2, progress_bar=False
        ),
    )


def test_an_output_dir_held_by_a_run_refuses_a_second(tmp_path):
    out = tmp_path / "run"
    with hold_output_dir(out):
        with pytest.raises(ConfigError, match=f"train.output_dir={out} is in use by another"):
            with hold_output_dir(out):
                pass
    with hold_output_dir(out):  # (released when the run ends)
        pass
    with hold_output_dir(out, take=False), hold_output_dir(out):  # (process > 0: nothing)
        pass


def test_a_second_trainer_on_a_held_output_dir_stops_naming_the_first(tmp_path, capsys):
    """Two runs started on one output_dir: the second exited 5 with orbax tracebacks and
    removed the first run's unfinished save. It stops at start-up now, exit 2, naming the
    first (here a process holding the folder as a run does), and writes nothing there."""
    from jaxmllm.train import cli

    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from jaxmllm.loop.lock import "
            "hold_output_dir\nwith hold_output_dir(Path(sys.argv[1])):\n print('held', "
            "flush=True); time.sleep(120)",
            str(out),
        ],
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        argv = ["--config", "configs/tiny.yaml", "--set", *NO_EVAL, f"train.output_dir={out}"]
        assert cli([*argv, "data.synthetic.num_samples=256", "train.steps=2"]) == 2
        err = capsys.readouterr().err
        assert f"train.output_dir={out} is in use by another run (process {holder.pid}" in err
        assert "Traceback" not in err and sorted(p.name for p in out.iterdir()) == [LOCK]
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow  # ~60-150 s: three short trainings
def test_a_refused_resume_leaves_config_json_as_it_was(tmp_path, capsys):
    """Checkpoints copied to a new output_dir without config.json and resumed with another
    model: the refused run first wrote its config.json, after which the right config was
    refused with a false claim about the checkpoint's width. Nothing is written now before
    the resume checks pass: the right config then resumes."""
    from jaxmllm.train import main

    out = tmp_path / "run"
    main(tiny(out, steps=2))
    (out / "config.json").unlink()  # (the checkpoints copied without it)
    wide = tiny(out, "model.llm.mlp_dim=96", steps=4)
    with pytest.raises(ConfigError):
        main(wide)
    assert not (out / "config.json").exists()
    main(tiny(out, steps=4))
    assert "resumed from checkpoint at step 2" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["train"]["steps"] == 4
