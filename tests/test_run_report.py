"""What the terminal is told about bad data: the index's rejects whole (wrapped, never cut),
a hint naming data.media_root when most records miss their media, the index's rejects once at
start-up, a line per logging window for records that fail to load, and the run's totals in
the end-of-run summary. (A whole run doing all of it: test_data_real's slow manifest run.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from jaxmllm.bench.data import write_dataset
from jaxmllm.config import load_config
from jaxmllm.data.index import build_index
from jaxmllm.data.index import main as index_main
from jaxmllm.data.loader import Loader
from jaxmllm.data.rejects import CONTINUED
from jaxmllm.data.source import open_source
from jaxmllm.feed.info import StepInfo
from jaxmllm.loop.summary import RunReport, schedule_note

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

SETTINGS = [
    "data.source=files",
    "data.workers=0",
    "data.image_min_pixels=256",
    "data.image_max_pixels=1024",
    "data.eval.source=none",
]


def config(path, *extra):
    return load_config("configs/manifest_example.yaml", [*SETTINGS, f"data.path={path}", *extra])


def index(config_file, sets) -> int:
    """`python -m jaxmllm.data.index --config FILE --set ...`'s exit code."""
    return index_main(
        ["--config", str(config_file), "--workers", "0", *[a for s in sets for a in ("--set", s)]]
    )


def unwrapped(text: str) -> str:
    """The terminal's text with its wrapping undone (a line break and its indent: a space)."""
    return " ".join(line.strip() for line in text.splitlines())


def test_index_prints_a_long_reject_whole_and_names_media_root(tmp_path, capsys):
    """A LLaVA JSON moved away from its images/ folder: most records are missing_media, and
    the index says where their paths start, where the first missing one would be, and
    data.media_root; every example is printed whole, however long."""
    data, images = tmp_path / "moved", tmp_path / "llava" / "images"
    data.mkdir()
    images.mkdir(parents=True)
    deep = "a-very-long-folder-name-that-goes-on-" * 4
    records = []
    for k in range(10):
        name = f"{deep}/{k:06d}.png" if k < 7 else f"{k:06d}.png"
        (images / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((16, 16, 3), 90, np.uint8)).save(images / name)
        records.append(
            {
                "id": f"{k:06d}",
                "image": name,
                "conversations": [
                    {"from": "human", "value": "<image>\nWhat is this?"},
                    {"from": "gpt", "value": "x"},
                ],
            }
        )
    (data / "llava.json").write_text(json.dumps(records))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(Path("configs/manifest_example.yaml").read_text())
    sets = [f"data.path={data / 'llava.json'}", *SETTINGS]
    assert index(cfg, sets) == 1
    out, err = capsys.readouterr()
    first = data / f"{deep}/000000.png"
    assert str(first) in unwrapped(out), out  # (the report: whole, wrapped)
    block = out.split("one example each):\n")[1].split("  wrote ")[0].splitlines()
    # (a line over 100 holds one word: a path, after a continued line's mark)
    one_word = [len(x) <= 100 or " " not in x.strip().removeprefix(CONTINUED) for x in block]
    assert len(block) > 1 and all(one_word), out
    assert "most common reason: missing_media" in err and f"start from {data}" in err, err
    assert f"the first missing one would be {first}" in err and "data.media_root" in err, err
    # Pointed at the folder the paths start from, the same data indexes.
    fixed = [*sets, f"data.media_root={images}"]
    assert index(cfg, fixed) == 0


def test_rejects_at_start_up_per_window_and_in_the_summary(tmp_path, caplog):
    """Media deleted after indexing: start-up names the index's own rejects once; the window
    in which records fail to load says how many by reason with the first one whole; the end
    summary counts both stages and names the files that list them."""
    manifest = write_dataset(tmp_path / "ds", images=12, audio=0, broken=1)
    cfg = config(manifest, f"train.output_dir={tmp_path / 'run'}")
    build_index(cfg, manifest, progress=False)
    caplog.set_level(logging.INFO, logger="jaxmllm")
    source = open_source(cfg)
    started = caplog.text
    assert f"{manifest}: jsonl" in started and "the index accepted 12 of 18 records" in started
    assert "6 rejected (" in started and "rejects.jsonl" in started, started
    gone = [manifest.parent / "media" / f"img{k}.{ext}" for k, ext in ((0, "png"), (1, "jpg"))]
    for path in gone:
        path.unlink()
    rejects_file = tmp_path / "run" / "rejects.jsonl"
    loader, report = (
        Loader(cfg, source, rejects_file),
        RunReport(cfg, tmp_path / "run", 0, rejects_file),
    )
    for step in range(2):  # a window of two steps, each loading half of the samples
        loader.load(np.arange(step * 6, step * 6 + 6), step=step)
        new, first = loader.log.take_new()
        report.step(
            StepInfo(
                step, np.arange(6), {}, 0, {}, {}, 0.0, 0.0, new_rejects=new, first_reject=first
            )
        )
    caplog.clear()
    report.logged(2)
    line = unwrapped(caplog.text)
    assert "load-time rejects in steps 1-2: 2 (missing_media 2)" in line, line
    assert f"no such file: {gone[0]}" in line or f"no such file: {gone[1]}" in line, line
    assert f"Each one is listed in {rejects_file}" in line
    caplog.clear()
    report.logged(3)  # a window without rejects says nothing
    assert "load-time" not in caplog.text
    row = {"loss": 1.25, **loader.counts()}
    window = SimpleNamespace(
        run_steps=2, run_tokens=1000.0, run_seconds=2.0, run_flops=8e12, n_devices=8
    )
    summary = unwrapped("\n".join(report.summary(3, row, window, Path("ck/3"))))
    assert "final loss 1.2500" in summary and "500 real tokens/s over steps 2-3" in summary
    assert "rejects: 6 at indexing (" in summary and "2 at load time (missing_media 2)" in summary
    assert str(rejects_file) in summary and "index" in summary.split("listed in")[1], summary
    assert "checkpoint: ck/3" in summary and "python -m jaxmllm.generate --run" in summary
    assert "reward accuracy" not in summary  # (a preference run's line: its pairs' metrics)
    pairs = {**row, "rewards/accuracies": 0.9, "rewards/margins": 1.5}
    pairs.update({"logps/chosen": -2.0, "logps/rejected": -9.0})
    said = unwrapped("\n".join(report.summary(3, pairs, window, Path("ck/3"))))
    assert "reward accuracy 0.900, margin 1.500, chosen log-prob -2.00, rejected -9.00" in said


def test_a_warm_up_over_most_of_a_short_run_is_said_at_start_up():
    """An imported config's lr 1e-5 after 50 warm-up steps, tried for 20 steps: the warm-up,
    held to the run, takes 19 of them, so the loss barely moves; start-up says so and what to
    set. A run long enough for its warm-up gets its schedule in one line, no warning."""
    imported = ["optim.lr=1e-5", "optim.warmup_steps=50", "optim.min_lr_ratio=0.1"]
    short = load_config("configs/tiny.yaml", [*imported, "train.steps=20"])
    level, line = schedule_note(short)
    assert level == logging.WARNING
    assert "0 -> 1e-05 over 19 warm-up steps" in line and "warmup_steps=50, held" in line
    assert "--set optim.warmup_steps=2" in line
    level, line = schedule_note(load_config("configs/tiny.yaml", [*imported, "train.steps=1000"]))
    assert level == logging.INFO and "over 50 warm-up steps, cosine to 1e-06 at step 1000" in line
