"""Hostile input and faults of issue 50's probes, each class built from the file (or the run)
that showed it, its outcome asserted: a counted reject naming the record, or an error naming
the file and the key to change, never a silent loss or a hang.

Classes here: a run in which no sample loads; the rejects log against the run's counts and
records told apart from their draws. The config-file classes: tests/test_config_files.py;
the data files': tests/test_hostile_shards.py; the run's: tests/test_run_guards.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_run_report import SETTINGS, config  # (a manifest_example config on a data set)

from jaxmllm.bench.data import write_dataset
from jaxmllm.config import load_config
from jaxmllm.data.index import build_index
from jaxmllm.data.loader import Loader
from jaxmllm.data.rejects import REASONS, DataError, read_rejects
from jaxmllm.data.source import open_source
from jaxmllm.feed.info import StepInfo
from jaxmllm.loop.summary import RunReport


def steps_of(loader: Loader, report: RunReport, draws: list[np.ndarray]) -> None:
    """Loads each step's samples as the feed does and hands the step to the report as the
    loop does (the feed writes no rejects itself: `write=False`)."""
    for step, read in enumerate(draws):
        loader.load(read, step=step)
        new, first = loader.log.take_new()
        info = StepInfo(step, read, {"read": read}, 0, {}, loader.counts(), 0.0, 0.0)
        info.new_rejects, info.first_reject = new, first
        info.reject_entries = loader.log.take_entries()
        report.step(info)


@pytest.fixture
def data(tmp_path):
    """A manifest of 16 images, indexed."""
    manifest = write_dataset(tmp_path / "ds", images=16, audio=0)
    cfg = config(manifest, f"train.output_dir={tmp_path / 'run'}", "train.steps=4")
    build_index(cfg, manifest, progress=False)
    return manifest, cfg


def test_a_run_whose_media_are_missing_here_stops_naming_the_cause(data, tmp_path):
    """The media folder is not on the training host (the index was built where it was): every
    sample fails to load. The run trained on padding at 0 tokens/s and exited 0; it stops,
    exit 2, at the step where the share passes data.max_load_rejects."""
    manifest, cfg = data
    (manifest.parent / "media").rename(tmp_path / "elsewhere")
    source, out = open_source(cfg), tmp_path / "run"
    loader = Loader(cfg, source, write=False)
    report = RunReport(cfg, out, 0, out / "rejects.jsonl")
    draws = [np.arange(k * 4, k * 4 + 4) for k in range(4)]
    with pytest.raises(DataError) as e:  # (16 draws: judged at the last step, the 4th)
        steps_of(loader, report, draws)
    message = str(e.value)
    assert "steps 1-4: 16 of the 16 samples drawn failed to load (missing_media 16" in message
    assert "data.max_load_rejects=0.1" in message and "python -m jaxmllm.data.index" in message
    assert "no such file" in message and len(read_rejects(out / "rejects.jsonl")) == 16


def test_a_few_missing_media_are_within_the_bound(data, tmp_path, caplog):
    """Within data.max_load_rejects the run goes on, and every reject it let pass is counted:
    by reason in the step metrics, in the logging window's line, and a line each in the log."""
    manifest, cfg = data
    records = [json.loads(x) for x in manifest.read_text().splitlines()]
    (manifest.parent / records[0]["images"][0]).unlink()
    source, out = open_source(cfg), tmp_path / "run"
    report = RunReport(cfg, out, 0, out / "rejects.jsonl")
    many = [np.arange(16)] * 3  # (48 draws, 3 failing: judged, under 0.1)
    loader = Loader(cfg, source, write=False)
    steps_of(loader, report, many)
    assert loader.counts()["rejects/load_total"] == 3.0
    assert loader.counts()["rejects/load_missing_media"] == 3.0
    with caplog.at_level("WARNING", logger="jaxmllm"):
        report.logged(3)
    assert "load-time rejects in steps 1-3: 3 (missing_media 3)" in caplog.text, caplog.text
    logged = read_rejects(out / "rejects.jsonl")
    assert [r["id"] for r in logged] == [records[0]["id"]] * 3
    assert {r["reason"] for r in logged} == {"missing_media"}

    lax = config(manifest, f"train.output_dir={tmp_path / 'lax'}", "data.max_load_rejects=1")
    (manifest.parent / "media").rename(tmp_path / "elsewhere")
    report = RunReport(lax, tmp_path / "lax", 0, tmp_path / "lax" / "rejects.jsonl")
    loader = Loader(lax, open_source(lax), write=False)
    steps_of(loader, report, many)  # (1: never stops)
    assert loader.counts()["rejects/load_missing_media"] == 48.0
    assert len(read_rejects(tmp_path / "lax" / "rejects.jsonl")) == 48


def test_the_rejects_log_lists_what_the_run_counted_and_records_apart_from_draws(data, tmp_path):
    """One image deleted after indexing, drawn in each of 32 steps (a small data set's
    epochs): the log had a line per load (prefetched steps the run never trained included)
    and the summary said "32 at load time", read as 32 broken files. The log now has the
    lines of the steps taken, and the summary says how many records they are."""
    manifest, cfg = data
    records = [json.loads(x) for x in manifest.read_text().splitlines()]
    gone = records[0]["id"]
    (manifest.parent / records[0]["images"][0]).unlink()
    source, out = open_source(cfg), tmp_path / "run"
    cfg = config(manifest, f"train.output_dir={out}", "train.steps=32")
    loader = Loader(cfg, source, write=False)
    report = RunReport(cfg, out, 0, out / "rejects.jsonl")
    steps_of(loader, report, [np.arange(16)] * 32)
    loader.load(np.arange(16), step=32)  # (a step prefetched, never trained: not logged)
    logged = read_rejects(out / "rejects.jsonl")
    assert len(logged) == 32 and {r["id"] for r in logged} == {gone}
    row = {"loss": 1.0, **{k: v for k, v in report_counts(logged).items()}}
    window = type("W", (), {"run_steps": 0})()
    summary = " ".join(report.summary(32, row, window, Path("ck/32")))
    assert "32 at load time (missing_media 32; 1 record, drawn 32 times)" in summary, summary


def report_counts(logged: list[dict]) -> dict:
    return {"rejects/load_total": float(len(logged)), "rejects/load_missing_media": 32.0}


def test_two_sources_sharing_one_index_folder_are_refused(tmp_path, capsys):
    """Two data.sources given one index_dir: each build replaced the other's index, and
    training then claimed a file had changed since its index, which no rebuild fixed."""
    from jaxmllm.config import ConfigError
    from jaxmllm.data.index import main as index_main

    a = write_dataset(tmp_path / "a", images=4, audio=0)
    b = write_dataset(tmp_path / "b", images=4, audio=0)
    shared = tmp_path / "index"
    sources = (
        f"data.sources=[{{path: {a}, index_dir: {shared}}}, {{path: {b}, index_dir: {shared}}}]"
    )
    sets = [*SETTINGS, "data.path=", sources]
    cfg = load_config("configs/manifest_example.yaml", sets)
    with pytest.raises(ConfigError, match=f"{a} and {b} would share the index folder {shared}"):
        open_source(cfg)
    argv = ["--config", "configs/manifest_example.yaml", "--workers", "0"]
    assert index_main([*argv, *[a for s in sets for a in ("--set", s)]]) == 2
    assert "would share the index folder" in capsys.readouterr().err
    assert not shared.exists()  # (refused before either was built)
    build_index(config(a, f"data.index_dir={shared}"), a, progress=False)  # (a's, then b's)
    with pytest.raises(ConfigError, match=f"was built for {a} .*, not {b}: each data set"):
        open_source(config(b, f"data.index_dir={shared}"))


def test_a_long_id_is_quoted_cut_with_its_length(tmp_path):
    """A rejected record's 20 MB id was printed whole in the index's example line (and kept
    in summary.json). Messages quote its start and its length; the rejects log keeps it."""
    from jaxmllm.data.index import report
    from jaxmllm.data.rejects import CONTINUED, RecordError

    rid = "x" * 20_000_000
    manifest = tmp_path / "m.jsonl"
    lines = [{"id": rid, "text": "<image> a", "images": ["gone.png"]}, {"id": "ok", "text": "b"}]
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = config(manifest, "data.min_accept=0")
    summary = build_index(cfg, manifest, progress=False)
    shown = " ".join(line.strip().removeprefix(CONTINUED) for line in report(summary))
    assert len(shown) < 2000 and "... (20000000 characters) (m.jsonl line 1)" in shown, shown
    assert (Path(summary["index"]) / "summary.json").stat().st_size < 100_000
    assert read_rejects(Path(summary["index"]) / "rejects.jsonl")[0]["id"] == rid
    assert len(str(RecordError("missing_media", "gone.png", rid))) < 400


@pytest.mark.torch  # (hf_models builds the checkpoint with transformers' LlamaForCausalLM)
def test_a_tensor_stored_transposed_is_refused_naming_it(tmp_path):
    """A safetensors tensor stored with a transposed shape of the same size (element counts
    were checked, not shapes) loaded scrambled; it is refused naming the file, the tensor
    and both shapes."""
    import hf_models
    from safetensors.numpy import load_file, save_file

    from jaxmllm.hf.safetensors import CheckpointError
    from jaxmllm.hf.towers import config_for, load_towers

    source = tmp_path / "llama"
    hf_models.llama(source, tied=False)
    name = "model.layers.0.mlp.gate_proj.weight"
    files = sorted(source.glob("*.safetensors"))
    for f in files:
        tensors = load_file(f)
        if name in tensors:
            assert tensors[name].shape[0] != tensors[name].shape[1]
            tensors[name] = np.ascontiguousarray(tensors[name].T)
            save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_towers(config_for("llm", str(source)), "llm")
    message = str(e.value)
    assert name in message and "store it as" in message and "transposed?" in message, message


def test_an_unsupported_whole_model_names_what_is_read_and_the_part_flags(tmp_path):
    """`hf import --model` on a multimodal model type jaxmllm does not read said the
    checkpoint was "of one part"; it names the whole models and causal LMs it reads, and the
    flags that take parts."""
    from jaxmllm.hf.family import FamilyError
    from jaxmllm.hf.importer import model_dirs

    model = tmp_path / "m"
    model.mkdir()
    for hf, part in [
        ({"model_type": "idefics3", "text_config": {}, "vision_config": {}}, None),
        ({"model_type": "whisper", "d_model": 64}, "audio"),
    ]:
        (model / "config.json").write_text(json.dumps(hf))
        with pytest.raises(FamilyError) as e:
            model_dirs(str(model))
        message = str(e.value)
        assert f"model_type {hf['model_type']!r} is not a model jaxmllm reads whole" in message
        assert "qwen2_vl" in message and "llama" in message and "--vision, --audio" in message
        assert "of one part" not in message
        if part:
            assert f"it is an {part} part: pass it as --{part} beside --llm" in message


# ----------------------------------------------------------------------------- over processes


def test_max_load_rejects_is_judged_over_the_jobs_processes():
    """Each process judged its own share: one whose 40 draws had 8 failures stopped while its
    peer's 40 had none (8 of the job's 80: within 0.1), and the others then waited on it. The
    share is the job's now, combined over the processes: the same counts pass, and a process
    with no failure of its own stops with its peers when the job's share is over."""
    from jaxmllm.data.rejects import LoadShare

    def peer(drawn: int, missing: int):  # (this process's counts plus one peer's)
        counts = {"missing_media": missing}
        other = [drawn, missing, *(counts.get(r, 0) for r in REASONS)]
        return lambda mine: mine + np.asarray(other, np.float64)

    alone = LoadShare(0.1)
    alone.add(40, {"missing_media": 8}, None)
    with pytest.raises(DataError, match="8 of the 40 samples drawn failed"):
        alone.check("steps 1-10", False, "rebuild")  # (the negative control: one process)
    with_peer = LoadShare(0.1, peer(40, 0))
    with_peer.add(40, {"missing_media": 8}, None)
    with_peer.check("steps 1-10", False, "rebuild")  # (8 of 80)
    clean = LoadShare(0.1, peer(20, 8))
    clean.add(20, {}, None)
    assert clean.totals() == (40, 8, {"missing_media": 8})
    with pytest.raises(DataError, match=r"8 of the 40 samples drawn failed to load \(missing_m"):
        clean.check("steps 1-5", False, "rebuild")


def test_counts_are_summed_over_the_processes_rows(monkeypatch):
    """`summed_over_processes`: one process's vector alone (no collective); with several,
    every process's row from `process_allgather`, summed."""
    import jax
    from jax.experimental import multihost_utils

    from jaxmllm.loop.metrics import over_processes, summed_over_processes

    def no_collective(x):
        raise AssertionError("one process gathers nothing")

    monkeypatch.setattr(multihost_utils, "process_allgather", no_collective)
    np.testing.assert_array_equal(summed_over_processes(np.array([3.0, 1.0])), [3.0, 1.0])
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    rows = lambda x: np.stack([x, 2 * x, np.zeros_like(x)])  # (three processes' vectors)
    monkeypatch.setattr(multihost_utils, "process_allgather", rows)
    assert over_processes(np.array([3.0, 1.0])).shape == (3, 2)
    np.testing.assert_array_equal(summed_over_processes(np.array([3.0, 1.0])), [9.0, 3.0])


def test_with_several_processes_the_share_is_judged_at_the_logged_steps(
    data, tmp_path, monkeypatch
):
    """A collective every step would stall the steps in flight: with several processes the
    run judges the job's share where every process is in the metrics' collective anyway, the
    logged steps (1, every train.log_every, the last). Two processes, each drawing 4 failing
    samples a step: judged at steps 1, 2 and 4, and stopped at 4 with the job's 32 of 32."""
    import jax
    from jax.experimental import multihost_utils

    manifest, _ = data
    out = tmp_path / "run"
    cfg = config(manifest, f"train.output_dir={out}", "train.steps=4", "train.log_every=2")
    (manifest.parent / "media").rename(tmp_path / "elsewhere")
    gathered = []

    def two_processes(x):  # (the peer drew and failed as this one did)
        gathered.append(x)
        return np.stack([x, x])

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", two_processes)
    loader = Loader(cfg, open_source(cfg), write=False)
    report = RunReport(cfg, out, 0, out / "rejects.jsonl")
    with pytest.raises(DataError, match="steps 1-4: 32 of the 32 samples drawn failed"):
        steps_of(loader, report, [np.arange(k * 4, k * 4 + 4) for k in range(4)])
    assert [int(x[0]) for x in gathered] == [4, 8, 16]  # (this process's draws at 1, 2, 4)
