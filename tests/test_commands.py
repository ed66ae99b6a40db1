"""Every `python -m jaxmllm.*` command ends a bad config, override, file or checkpoint with one
line (`error: ...`) and exit code 2, never a traceback (`jaxmllm.config.command.run`).

Each entry point runs as `python -m` runs it (`runpy`, as `__main__`), all in one child
process so JAX is imported once: with a config file that does not exist, and with an override
that cannot be applied (an unknown key, or a mesh the devices cannot make); entry points that
take no config get an input of their own kind that does not exist.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MISSING = "/nonexistent-jaxmllm/config.yaml"
TINY = "configs/tiny.yaml"
CASES = {  # module: [argv, ...]
    "jaxmllm.train": [["--config", MISSING], ["--config", TINY, "--set", "optim.nope=1"]],
    "jaxmllm.launch": [["--processes", "1", "--config", MISSING]],
    "jaxmllm.generate": [["--run", "/nonexistent-jaxmllm/run", "--prompt", "1 2"]],
    "jaxmllm.hf": [
        ["import", "--model", "/nonexistent-jaxmllm/model", "--out", "{tmp}/x.yaml"],
        ["export", "/nonexistent-jaxmllm/run", "--out", "{tmp}/exported"],
        ["check", "/nonexistent-jaxmllm/model"],
    ],
    "jaxmllm.data.index": [
        ["--config", MISSING],
        ["--config", "configs/manifest_example.yaml", "--set", "data.nope=1"],
    ],
    "jaxmllm.data.frames": [
        ["--config", MISSING],
        ["--config", "configs/manifest_example.yaml", "--set", "data.nope=1"],
        ["--config", TINY],  # (synthetic data: nothing to cache)
    ],
    "jaxmllm.data.arrayrecord": [
        ["--manifest", "{tmp}/m.jsonl", "--out", "{tmp}/x.array_record", "--config", MISSING],
        ["--manifest", "{tmp}/m.jsonl", "--out", "{tmp}/x.array_record", "--set", "data.x=1"],
    ],
    "jaxmllm.config.reference": [["--nope"]],  # (takes no config)
    "jaxmllm.cost.calibrate": [["/nonexistent-jaxmllm/run"]],
    "jaxmllm.bench.attention": [
        ["--mix", "nope"],
        ["--rows", "256"],  # (no document fits)
        ["--kind", "vision", "--window", "64"],  # (a window is a decoder's)
    ],
    "jaxmllm.bench.balance": [["--lengths", "/nonexistent-jaxmllm/lengths.jsonl"]],
    "jaxmllm.bench.compile": [["--config", MISSING], ["--config", TINY, "--set", "mesh.fsdp=3"]],
    "jaxmllm.bench.context": [["--mix", "nope"]],
    "jaxmllm.bench.data": [["--config", MISSING]],
    "jaxmllm.bench.formats": [["--config", MISSING]],
    "jaxmllm.bench.gpu": [["--out", "{tmp}/gpu", "--timeout", "soon"]],
    "jaxmllm.bench.hfload": [["--shape", "nope"]],
    "jaxmllm.bench.indexing": [["--text-image", "10", "--workers", "nope"]],
    "jaxmllm.bench.lengths_synth": [["--samples", "0", "--out", "{tmp}/synth"]],
    "jaxmllm.bench.linear": [["--rows", "1000"]],
    "jaxmllm.bench.startup": [["--lengths", "/nonexistent-jaxmllm/index"]],
    "jaxmllm.bench.host": [["--config", MISSING], ["--config", TINY, "--set", "nope.x=1"]],
    "jaxmllm.bench.lora": [
        ["--config", MISSING],
        ["--config", TINY, "--set", "model.llm.lora.rank=-1"],
    ],
    "jaxmllm.bench.memory": [
        ["--config", MISSING],
        ["--config", TINY, "--set", "mesh.fsdp=3", "--devices", "8"],  # a ShardingError
    ],
    "jaxmllm.bench.moe": [["--parts", "nope"]],
    "jaxmllm.bench.node": [["--config", MISSING], ["--config", TINY, "--steps", "0"]],
    "jaxmllm.bench.pairs": [["--lengths", "/nonexistent-jaxmllm/lengths.jsonl"]],
    "jaxmllm.bench.rollouts": [["--lengths", "/nonexistent-jaxmllm/lengths.jsonl"]],
    "jaxmllm.bench.stages": [["--config", MISSING], ["--set", "nope.x=1"]],
    "jaxmllm.bench.throughput": [["--config", MISSING], ["--config", TINY, "--set", "x.y=1"]],
    "jaxmllm.bench.video": [["--sizes", "nope"]],
}

HARNESS = """
import contextlib, io, json, logging, runpy, sys, time, traceback
out = []
for module, argv in json.loads(sys.argv[1]):
    began = time.perf_counter()
    text = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)  # (.buffer too)
    logging.root.handlers.clear()  # (each command's basicConfig writes to this capture)
    sys.argv = [module, *argv]
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()  # what the command would have shown
            code = "escaped"
    seconds = round(time.perf_counter() - began, 1)
    out.append([module, argv, code, text.buffer.getvalue().decode(), seconds])
print(json.dumps(out))
"""


def harness(cases: list, timeout: int) -> list:
    """[module, argv, exit code, output, seconds] of each (module, argv) run as `python -m`
    runs it, all in one child process (JAX imported once)."""
    proc = subprocess.run(
        [sys.executable, "-c", HARNESS, json.dumps(cases)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def entry_points() -> set[str]:
    """The modules of jaxmllm that run as `python -m` (an `if __name__ == "__main__":` block)."""
    found = set()
    for path in (ROOT / "jaxmllm").rglob("*.py"):
        if re.search(r'^if __name__ == "__main__":', path.read_text(), re.MULTILINE):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found.add(".".join(parts[:-1] if parts[-1] == "__main__" else parts))
    return found


def test_every_entry_point_is_tried_and_ends_through_the_wrapper():
    assert entry_points() == set(CASES), "add the new entry point to CASES"
    for module in CASES:
        path = ROOT / Path(*module.split("."))
        text = (path / "__main__.py" if path.is_dir() else path.with_suffix(".py")).read_text()
        block = text[text.index('if __name__ == "__main__":') :]
        # sys.exit(run(main)), or a main (cli) whose body is `return run(...)`
        assert "run(main)" in block or "    return run(_command, argv)" in text, module


def test_bad_config_exits_2_with_one_message(tmp_path):
    cases = [
        (module, [a.format(tmp=tmp_path) for a in argv])
        for module, argvs in CASES.items()
        for argv in argvs
    ]
    failures = []
    for module, argv, code, text, _ in harness(cases, timeout=600):
        if code != 2 or "Traceback" in text or "error" not in text:
            failures.append(f"python -m {module} {' '.join(argv)} -> {code}:\n{text[-2000:]}")
    assert not failures, "\n\n".join(failures)


def test_a_config_without_data_refuses_to_start(tmp_path, capsys):
    """The built-in data only when asked for: a config with no data.path, data.sources or
    data.source (as `hf import` writes one) stops training and indexing, naming all three."""
    from jaxmllm.config import load_config
    from jaxmllm.data.index import main as index
    from jaxmllm.data.source import make_source
    from jaxmllm.train import cli as train

    raw = yaml.safe_load((ROOT / TINY).read_text())
    del raw["data"]["source"]
    raw["train"]["output_dir"] = str(tmp_path / "run")
    config = tmp_path / "no_data.yaml"
    config.write_text(yaml.safe_dump(raw))
    for command in (train, index):
        assert command(["--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert "the config names no data" in err, err
        for key in ("data.path", "data.sources", "data.source: synthetic"):
            assert key in err, err
        assert f"python -m jaxmllm.data.index --config {config}" in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained
    _, index = make_source(load_config(config, ["data.source=synthetic"]))  # (when named)
    assert len(index) == raw["data"]["synthetic"]["num_samples"]


def test_a_manifest_alone_is_indexed_and_set_takes_several_pairs(tmp_path, capsys):
    """`python -m jaxmllm.data.index --manifest FILE --out DIR`, as its help says, with no
    config: the defaults and `--set`, several pairs after one `--set`."""
    from jaxmllm.data.index import main as index

    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps({"id": i, "text": "hello " * i}) + "\n" for i in (1, 2)))
    out = tmp_path / "index"
    assert index(["--manifest", str(data), "--out", str(out), "--workers", "0"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accepted"] == 2
    argv = ["--manifest", str(data), "--out", str(tmp_path / "i2"), "--workers", "0"]
    sets = ["--set", "data.tokenizer=byte", "data.image_max_pixels=4096"]
    assert index([*argv, *sets]) == 0
    params = json.loads((tmp_path / "i2" / "summary.json").read_text())["params"]
    assert params["image_max_pixels"] == 4096
    capsys.readouterr()


def test_an_overrides_error_names_the_set_not_the_file(tmp_path):
    """In every command (one parser, `add_config_args`): `--set` takes several pairs, and an
    error one of them causes names that `--set`, not the YAML file it overrides."""
    data = tmp_path / "m.jsonl"
    data.write_text(json.dumps({"text": "hi"}) + "\n")
    cases = [
        (
            "jaxmllm.data.index",
            ["--manifest", str(data), "--set", "data.tokenizer=byte", "data.image_max_pixel=9"],
            "--set data.image_max_pixel=9: unknown key 'data.image_max_pixel'",
        ),
        (
            "jaxmllm.bench.host",
            ["--config", TINY, "--set", "train.steps=3", "model.llm.widht=3"],
            "--set model.llm.widht=3: unknown key 'model.llm.widht'; did you mean",
        ),
        (
            "jaxmllm.train",
            ["--config", TINY, "--set", "train.steps=3", "data.source=jsonl"],
            "--set data.source=jsonl: data.path",
        ),
    ]
    proc = subprocess.run(
        [sys.executable, "-c", HARNESS, json.dumps([c[:2] for c in cases])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for (module, _, code, text, _), (_, _, want) in zip(
        json.loads(proc.stdout.splitlines()[-1]), cases, strict=True
    ):
        assert code == 2 and want in text and TINY not in text, (module, text)


def test_a_runs_log_lines_carry_their_time():
    """Importing grain installs a root handler first; the commands' logging replaces it, so
    every line says when (the trainer's start-up lines had none); jaxmllm's at INFO, the other
    libraries' at WARNING."""
    script = (
        "import jaxmllm.train, logging\n"  # (imports grain)
        "from jaxmllm.config.command import configure_logging\n"
        "configure_logging(logging.WARNING, ours=logging.INFO)\n"
        "logging.getLogger('jaxmllm').info('batch resolved')\n"
        "logging.getLogger('orbax').info('registry chatter')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO batch resolved$", proc.stderr, re.M)
    assert "chatter" not in proc.stderr  # (others' INFO lines: warnings only, as before)


# ----------------------------------------------------------------------------- good input

# tiny's LLM alone, on text: what `hf export` writes from scratch, and the benchmarks that train
# it (their main paths are their tables: with the towers, bench.lora took 41 s, not 12)
TEXT_ONLY = [
    "model.vision.enabled=false",
    "model.audio.enabled=false",
    "data.synthetic.image_fraction=0",
    "data.synthetic.multi_image_fraction=0",
    "data.synthetic.audio_fraction=0",
    "data.synthetic.video_fraction=0",
]
RUN = [
    "--config",
    TINY,
    "--set",
    "data.eval.source=none",
    "data.synthetic.num_samples=64",
    "train.steps=12",  # (plan.cost fits on the steps without a compile or a save: 5 at least)
    "train.checkpoint_every=6",
    "train.progress_bar=false",
    *TEXT_ONLY,
    "train.output_dir={tmp}/run",
]
MANIFEST = [
    "--config",
    "configs/manifest_example.yaml",
    "--set",
    "data.path={tmp}/ds/manifest.jsonl",
]
GOOD = [  # (module, argv): each command's main path once, small, in the order they need
    ("jaxmllm.train", RUN),
    ("jaxmllm.generate", ["--run", "{tmp}/run", "--prompt", "12 13 14", "--max-new-tokens", "4"]),
    ("jaxmllm.cost.calibrate", ["{tmp}/run"]),
    (  # (its own output and two steps: the launch is the path, the trainer's ran above)
        "jaxmllm.launch",
        ["--processes", "1", *RUN[:-1], "train.steps=2", "train.output_dir={tmp}/launched"],
    ),
    ("jaxmllm.hf", ["import", "--llm", "{tmp}/llama", "--out", "{tmp}/imported.yaml"]),
    ("jaxmllm.hf", ["check", "{tmp}/llama", "--tokens", "16"]),
    ("jaxmllm.hf", ["export", "{tmp}/run", "--out", "{tmp}/exported"]),
    ("jaxmllm.data.index", [*MANIFEST, "--workers", "0"]),
    ("jaxmllm.data.frames", [*MANIFEST, "--set", "model.vision.video=true"]),
    (
        "jaxmllm.data.arrayrecord",
        ["--manifest", "{tmp}/ds/manifest.jsonl", "--out", "{tmp}/x.array_record"],
    ),
    ("jaxmllm.config.reference", ["--out", "{tmp}/reference.md"]),
    ("jaxmllm.bench.attention", ["--rows", "2048", "--repeat", "1", "--window", "512"]),
    ("jaxmllm.bench.balance", ["--mix", "omni", "--devices", "8", "--max-steps", "3"]),
    ("jaxmllm.bench.compile", ["--config", TINY, "--depth", "2", "--set", "batch.capacity=fixed"]),
    (
        "jaxmllm.bench.context",
        ["--tokens", "512", "--context", "2", "--width", "64", "--repeat", "1"],
    ),
    (  # (the strategies' bytes: XLA's where the process has the devices)
        "jaxmllm.bench.context",
        ["--bytes", "--tokens", "256", "--context", "2", "--width", "64", "--kv-heads", "1"],
    ),
    ("jaxmllm.bench.data", ["--images", "6", "--audio", "2", "--workers", "0"]),
    (
        "jaxmllm.bench.formats",
        ["--records", "40", "--workers", "0", "--index-processes", "1", "--formats", "jsonl"],
    ),
    ("jaxmllm.bench.gpu", ["--out", "{tmp}/gpu", "--smoke", "--parts", "env"]),
    ("jaxmllm.bench.hfload", ["--shape", "tiny", "--devices", "8", "--fsdp", "8"]),
    ("jaxmllm.bench.host", ["--config", TINY, "--steps", "1", "--warmup", "1"]),
    ("jaxmllm.bench.indexing", ["--text-image", "20", "--workers", "0"]),
    (
        "jaxmllm.bench.linear",
        ["--rows", "256", "--width", "64", "--heads", "4", "--kv-heads", "2", "--key-heads", "2"]
        + ["--value-heads", "4", "--head-dim", "16", "--full-max", "256", "--repeat", "1"],
    ),
    ("jaxmllm.bench.lengths_synth", ["--samples", "1000", "--out", "{tmp}/synth"]),
    (
        "jaxmllm.bench.startup",
        ["--lengths", "{tmp}/synth", "--plan", "orchestrated", "--devices", "8"],
    ),
    (
        "jaxmllm.bench.lora",
        ["--config", TINY, "--steps", "1", "--warmup", "1", "--set", *TEXT_ONLY],
    ),
    # (the table: its __main__ once crashed)
    (  # (--device-gib: the largest microbatch that fits is searched by compiling, ~17 min to
        # reach the default 72 GiB from tiny's rows; at 0.03 GiB one row fits and two do not
        # (0.018 and 0.049 GiB), so two compiles end the search, where 0.05 took three. One
        # policy, the config's own, so one search: a row with recomputed FLOPs)
        "jaxmllm.bench.memory",
        ["--config", TINY, "--policies", "full", "--device-gib", "0.03"]
        + ["--set", "batch.capacity=fixed", "model.remat=full"],
    ),
    (
        "jaxmllm.bench.moe",
        [
            "--parts",
            "flops",
            "--tokens",
            "256",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--width",
            "64",
            "--expert-width",
            "32",
        ],
    ),
    (
        "jaxmllm.bench.node",
        ["--config", TINY, "--steps", "1", "--warmup", "1", "--json", "{tmp}/node.json"]
        + ["--set", *TEXT_ONLY],
    ),
    ("jaxmllm.bench.pairs", ["--mix", "ai2d", "--devices", "8", "--steps", "2"]),
    ("jaxmllm.bench.rollouts", ["--mix", "ai2d", "--devices", "8", "--prompts", "16"]),
    (
        "jaxmllm.bench.stages",
        ["--config", TINY, "--stages", "2", "--microbatches", "4", "--measure", ""],
    ),
    (
        "jaxmllm.bench.throughput",
        ["--config", TINY, "--steps", "1", "--warmup", "1", "--policies", "orchestrated"]
        + ["--set", *TEXT_ONLY],
    ),
    (
        "jaxmllm.bench.video",
        ["--sizes", "360p", "--seconds", "2", "--repeat", "1", "--gops", "30", "--recipes", "2b"],
    ),
]


@pytest.mark.slow  # ~10-30 min: every command's main path, each small
@pytest.mark.torch  # (`hf check` and `hf import` read a checkpoint transformers writes)
def test_every_command_runs_its_main_path_on_good_input(tmp_path):
    """Each `python -m jaxmllm.*` command once on a small good input, as `python -m` runs it:
    exit 0, no traceback. (The entry-point test above tries only bad configs, so a command
    that crashed on good input, bench.memory's table, passed CI.)"""
    import hf_models

    from jaxmllm.bench.data import write_dataset

    assert {m for m, _ in GOOD} == set(CASES), "give the new entry point a good input"
    write_dataset(tmp_path / "ds", images=8, audio=4)
    hf_models.llama(tmp_path / "llama", tied=False)
    cases = [(m, [a.format(tmp=tmp_path) for a in argv]) for m, argv in GOOD]
    done = harness(cases, timeout=3600)
    for module, _, _, _, seconds in sorted(done, key=lambda d: -d[4]):
        print(f"{seconds:6.1f} s  python -m {module}")  # (-s, or --durations' neighbour)
    failures = [
        f"python -m {module} {' '.join(argv)} -> {code}:\n{text[-3000:]}"
        for module, argv, code, text, _ in done
        if code != 0 or "Traceback" in text
    ]
    assert not failures, "\n\n".join(failures)


def test_logging_writes_to_the_stderr_of_the_moment(monkeypatch):
    """A command run in-process under one stderr that is then closed (pytest's capture of an
    earlier test) logs the next line to the current stderr, with no "Logging error"."""
    import io
    import logging

    from jaxmllm.config.command import configure_logging

    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging()
    logging.getLogger("jaxmllm").warning("under the first")
    first.close()
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("jaxmllm").warning("under the second")
    assert second.getvalue().endswith("WARNING under the second\n"), second.getvalue()
    assert "Logging error" not in second.getvalue()
