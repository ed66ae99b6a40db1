"""The host against the device: the feed's time per stage, bench.host, the trainer's host
metrics and its warning when the devices wait on the data."""

import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from jaxmllm.batch.counts import StepCounter
from jaxmllm.bench import host as bench_host
from jaxmllm.config import ConfigError, load_config
from jaxmllm.data import shared
from jaxmllm.data.loader import Loader, running
from jaxmllm.data.rejects import DataError
from jaxmllm.data.samples import Sample
from jaxmllm.data.synthetic import SyntheticSource
from jaxmllm.feed.info import StepInfo
from jaxmllm.feed.iterator import make_pipeline
from jaxmllm.feed.times import HostTimes
from jaxmllm.loop.metrics import MetricsWindow
from jaxmllm.resolve.run import resolve_run

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

TINY = ["data.synthetic.num_samples=256", "data.eval.source=none"]


def _resolved(*sets):
    return resolve_run(load_config("configs/tiny.yaml", [*TINY, *sets]), 8)


def test_the_feed_times_each_stage_of_a_step():
    run = _resolved()

    def slow_copy(batch):
        time.sleep(0.05)
        return batch

    element = next(make_pipeline(run, prefetch=0, to_device=slow_copy))
    info = element["info"]
    host = info.host
    for stage in ("plan_s", "load_s", "bucketize_s", "count_s"):
        assert 0 < getattr(host, stage) < 5, stage
    assert host.transfer_s >= 0.05
    assert host.samples == len(info.parts["read"])
    assert host.bytes_to_device == sum(a.nbytes for a in element["batch"].values())
    row = host.to_json()
    assert row["serial_s"] == host.plan_s + host.bucketize_s + host.count_s + host.transfer_s
    assert host.total_s == row["serial_s"] + host.load_s


def test_the_copy_runs_on_a_thread_of_its_own_and_the_state_is_the_trainers(monkeypatch):
    """Prefetched, the copy to the devices runs after the feed's thread on another, one batch
    ahead: the same batches in the same order as without prefetching, each copy timed, and the
    state (what a checkpoint keeps) the one after the last batch the trainer took."""
    import jaxmllm.feed.iterator as feed_module

    run = _resolved()
    copies, feeds = [], []
    bucketize = feed_module.bucketize

    def recorded(*args, **kwargs):
        feeds.append(threading.get_ident())
        return bucketize(*args, **kwargs)

    monkeypatch.setattr(feed_module, "bucketize", recorded)

    def copy(batch):
        copies.append(threading.get_ident())
        time.sleep(0.02)
        return {k: v + 0 for k, v in batch.items()}

    feed = make_pipeline(run, prefetch=2, to_device=copy)
    plain = make_pipeline(run, prefetch=0)
    try:
        for _ in range(3):
            a, b = next(feed), next(plain)
            assert a["info"].step == b["info"].step and a["info"].host.transfer_s >= 0.02
            for key, value in b["batch"].items():
                np.testing.assert_array_equal(a["batch"][key], value, err_msg=key)
            assert feed.get_state() == plain.get_state()
    finally:
        feed.close()
    assert len(set(copies)) == 1 and not set(copies) & {threading.get_ident(), *feeds}


def test_analytic_device_time_is_the_costliest_bucket_per_microbatch():
    run = _resolved()
    batch = next(make_pipeline(run, prefetch=0))["batch"]
    flops = StepCounter(run.cfg)(batch)["flops"]  # every bucket's
    seconds = bench_host.flops_seconds(run.cfg, batch, 100.0)
    assert flops / 8 <= seconds * 100e12 <= flops  # at least the mean device, at most all
    # one bucket per microbatch: the device time is its FLOPs
    one = {k: v[:, :1] for k, v in batch.items()}
    want = StepCounter(run.cfg)(one)["flops"]
    assert np.isclose(bench_host.flops_seconds(run.cfg, one, 100.0) * 100e12, want)


def test_a_step_is_counted_with_its_variants_groups():
    """Groups in the long steps only (mesh.context_steps: long, data=4 x context=2): the feed
    counts a base step's FLOPs with a device's own rows and a long step's with its groups'
    (a document's squared length is its group's), as the step computes them."""
    per_step = ["mesh.data=4", "mesh.fsdp=1", "mesh.context=2", "mesh.context_steps=long"]
    per_step += ["batch.llm_row_len=96", "batch.vision_tiles=400", "batch.audio_tiles=100"]
    ladder = ["batch.llm_long_tiles=[]", "batch.vision_long_tiles=[]", "batch.audio_long_tiles=[]"]
    run = _resolved(*per_step, *ladder)  # (the rows alone make a step long)
    feed = make_pipeline(run, prefetch=0)
    seen = {}
    try:
        for _ in range(40):  # (the first base step with samples, and a long one)
            element = next(feed)
            if element["info"].tokens:
                seen.setdefault(min(element["info"].long, 1), element)
            if len(seen) == 2:
                break
    finally:
        feed.close()
    assert len(seen) == 2
    for long, element in seen.items():
        count = StepCounter(run.cfg)
        flops = [count(element["batch"], context)["flops"] for context in (1, 2)]
        assert element["info"].flops == flops[long] != flops[1 - long]


def test_analytic_device_time_prices_sliding_window_layers_by_their_window():
    """A Gemma-shaped decoder (5 windowed layers of 6): a bucket's device time is its FLOPs
    as the metrics count them, the windowed layers on `window_sq` (a document 8 windows
    long costs them far less than full attention would)."""
    window = ["model.llm.depth=6", "model.llm.window.size=16", "model.llm.window.every=6"]
    cfg = load_config("configs/tiny.yaml", window)
    seg = np.zeros((1, 1, 1, 192), np.int32)
    seg[0, 0, 0, :128] = 1
    batch = {"llm_segment_ids": seg}
    want = StepCounter(cfg)(batch)["flops"]
    assert np.isclose(bench_host.flops_seconds(cfg, batch, 100.0) * 100e12, want)
    full = load_config("configs/tiny.yaml", window[:1])
    seconds = bench_host.flops_seconds(cfg, batch, 100.0)
    assert seconds < bench_host.flops_seconds(full, batch, 100.0)


def test_the_media_manifest_holds_large_images_several_per_record_and_long_clips(tmp_path):
    manifest = bench_host.write_media(tmp_path, records=16, seed=1)
    records = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert len(records) == 16
    images = [p for r in records for p in r.get("images", [])]
    clips = [p for r in records for p in r.get("audio", [])]
    assert images and clips and any(len(r.get("images", [])) > 1 for r in records)
    for path in images:
        with Image.open(tmp_path / path) as img:
            assert 300 <= min(img.size) and max(img.size) <= 1500
            assert img.format in ("JPEG", "PNG")
    for path in clips:
        info = sf.info(str(tmp_path / path))
        assert 3.0 <= info.frames / info.samplerate <= 20.0
    for r in records:  # one placeholder per image or clip
        assert r["text"].count("<image>") == len(r.get("images", []))
        assert r["text"].count("<audio>") == len(r.get("audio", []))


def test_bench_host_writes_a_row_per_data_devices_and_workers(tmp_path):
    out = tmp_path / "rows.json"
    sets = [*TINY, "data.image_min_pixels=256", "data.image_max_pixels=2304"]
    sets.append(f"train.output_dir={tmp_path}")  # (its rejects log: not the checkout's runs/)
    args = [
        "--config",
        "configs/tiny.yaml",
        "--data",
        "synthetic,media",
        "--devices",
        "4,16",
        "--steps",
        "2",
        "--warmup",
        "0",
        "--media-dir",
        str(tmp_path / "media"),
        "--media-records",
        "12",
        "--json",
        str(out),
    ]
    assert bench_host.main(args + [f"--set={s}" for s in sets]) == 0
    rows = json.loads(out.read_text())
    assert [(r["data"], r["devices"], r["workers"]) for r in rows] == [
        ("synthetic", 4, 0),
        ("synthetic", 16, 0),
        ("media", 4, 0),
        ("media", 16, 0),
    ]
    for r in rows:
        for key in (
            "plan_s",
            "load_s",
            "bucketize_s",
            "transfer_s",
            "serial_s",
            "load_s_per_sample",
            "device_s",
            "workers_needed",
            "wait_s",
        ):
            assert r[key] >= 0 and np.isfinite(r[key]), (r["data"], key)
        assert r["device_s"] > 0 and r["workers_needed"] > 0 and r["samples"] > 0
        assert r["host_over_device"] == r["host_s"] / r["device_s"]
    by = {(r["data"], r["devices"]): r for r in rows}
    # 16 devices: this host holds 8 of them (--devices-per-host), twice the buckets of 4
    assert by["synthetic", 16]["bytes_to_device"] > 1.5 * by["synthetic", 4]["bytes_to_device"]
    assert Path(tmp_path / "media" / "manifest.jsonl").exists()  # kept for the next run


def _info(**host) -> StepInfo:
    times = HostTimes(**{f"{k}_s": v for k, v in host.items()})
    none = np.zeros(0, np.int64)
    return StepInfo(
        step=1,
        samples=none,
        parts={},
        deferred=0,
        fill={"llm": 1.0},
        rejects={},
        tokens=100.0,
        flops=1e9,
        host=times,
    )


def test_the_metrics_hold_the_feeds_times_per_step_and_the_loops_wait():
    window = MetricsWindow(8)
    window.add(_info(plan=0.01, load=0.3, bucketize=0.1, count=0.02, transfer=0.05), 0.2)
    window.add(_info(plan=0.03, load=0.5, bucketize=0.3, count=0.04, transfer=0.07), 0.4)
    window.start -= 3.0  # the window took 3 s
    stats, _ = window.close(_info())
    want = {
        "plan": 0.02,
        "load": 0.4,
        "bucketize": 0.2,
        "count": 0.03,
        "transfer": 0.06,
        "wait": 0.3,
    }
    for stage, seconds in want.items():
        assert np.isclose(stats[f"host/{stage}_s"], seconds), stage
    assert 0.19 < stats["host/wait_share"] <= 0.2  # 0.6 s of the window's 3 s


def test_waiting_on_the_data_warns_once_naming_the_knob_that_helps(caplog):
    cfg = load_config("configs/tiny.yaml", [*TINY, "data.workers=1"])
    window = MetricsWindow(8, cfg.data)

    def window_of(wait_s, **host):
        window.add(_info(**host), wait_s)
        window.start -= 1.0
        with caplog.at_level("WARNING", logger="jaxmllm"):
            caplog.clear()
            window.close(_info())
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]

    loading = {"plan": 0.01, "load": 0.8, "bucketize": 0.1, "transfer": 0.05}
    assert window_of(0.5, **loading) == []  # the first window: start-up, never warned
    assert window_of(0.05, **loading) == []  # 5% of the window: fine
    [message] = window_of(0.5, **loading)
    assert "waited on the data for 50%" in message
    assert "raise data.workers (now 1)" in message and "data.prefetch (now 2)" in message
    assert window_of(0.9, **loading) == []  # once

    window = MetricsWindow(8, cfg.data)
    window_of(0.5)
    serial = {"plan": 0.3, "load": 0.1, "bucketize": 0.5, "transfer": 0.05}
    [message] = window_of(0.5, **serial)
    assert "serial" in message and "more workers will not help" in message


def test_a_negative_prefetch_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"data\.prefetch: must be >= 0"):
        load_config("configs/tiny.yaml", ["data.prefetch=-1"])


# ----------------------------------------------------------------------------- worker processes


def _sample(big: int = 5000) -> Sample:
    rng = np.random.default_rng(0)
    patches = rng.standard_normal((big, 48)).astype(np.float32)
    frames = rng.standard_normal((big // 7, 80)).astype(np.float32)
    image = (patches, np.zeros((big, 2), np.int32))
    clip = (frames, np.arange(big // 7, dtype=np.int32))
    media = {"vision": [image, None], "audio": [clip, None]}
    return Sample(3, np.arange(10, dtype=np.int32), np.ones(10, bool), media, grids=[(50, 100)])


def _same(a: Sample, b: Sample) -> bool:
    missing = lambda s: [[m is None for m in items] for items in s.media.values()]  # noqa: E731
    if (a.id, a.grids, missing(a)) != (b.id, b.grids, missing(b)):
        return False
    pairs = zip(_arrays(a), _arrays(b), strict=True)
    return all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in pairs)


def test_a_samples_large_arrays_travel_through_shared_memory_and_come_back_the_same():
    before = set(shared.SHM.glob("jaxmllm-*"))
    packed = shared.pack(_sample(), "0123456789abcdef")
    assert isinstance(packed, shared.Packed)
    assert isinstance(packed.sample.media["vision"][0][0], shared.Ref)  # the patches: a file
    assert isinstance(packed.sample.tokens, np.ndarray)  # small: pickled
    assert len(pickle.dumps(packed)) < len(pickle.dumps(_sample())) / 10  # through the pipe
    got = shared.unpack(pickle.loads(pickle.dumps(packed)))
    assert _same(got, _sample())
    assert set(shared.SHM.glob("jaxmllm-*")) == before  # its name deleted on arrival
    patches = got.media["vision"][0][0]
    patches[0, 0] = 7.0  # writable, privately
    assert patches[0, 0] == 7.0


def test_without_shared_memory_a_sample_travels_pickled(monkeypatch, tmp_path):
    small = _sample(big=10)
    assert shared.pack(small, "0123456789abcdef") is small  # nothing large: as it is
    monkeypatch.setattr(shared, "SHM", tmp_path / "missing")
    assert _same(shared.pack(_sample(), "0123456789abcdef"), _sample())

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shared, "SHM", tmp_path)
    monkeypatch.setattr(shared.os, "pwrite", full)
    assert isinstance(shared.pack(_sample(), "0123456789abcdef"), Sample)
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_stale_removal_deletes_only_the_files_of_loaders_whose_lock_is_free(monkeypatch, tmp_path):
    """Names carry a loader's random token, and a loader's lock (an flock the kernel drops when
    its process dies, in any pid namespace) is what says it lives: a pid is never trusted."""
    monkeypatch.setattr(shared, "SHM", tmp_path)
    mine = shared.Owner()
    (tmp_path / f"{shared.prefix(mine.token)}1-0").write_bytes(b"x")
    dead = "0123456789abcdef"  # a loader killed before it could clean up: its lock is free
    (tmp_path / f"jaxmllm-{dead}.lock").write_bytes(b"")
    (tmp_path / f"jaxmllm-{dead}-1-0").write_bytes(b"x")
    other = f"jaxmllm-{_dead_pid()}-1-0"  # not a loader's token (another kind): never touched
    (tmp_path / other).write_bytes(b"x")
    shared.remove_stale()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([other, f"jaxmllm-{mine.token}.lock", f"{shared.prefix(mine.token)}1-0"])
    mine.close()
    assert [p.name for p in tmp_path.iterdir()] == [other]


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_workers_load_the_same_samples_as_the_loaders_process(tmp_path):
    cfg = load_config("configs/tiny.yaml", [*TINY, f"train.output_dir={tmp_path}"])
    source = SyntheticSource(cfg)
    indices = np.arange(0, 200, 7)
    alone = Loader(cfg, source).load(indices, step=1)
    loader = Loader(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, workers=2)), source)
    try:
        got = loader.load(indices, step=1)
    finally:
        loader.close()
    for i in indices.tolist():
        a, b = alone[i], got[i]
        assert (a.id, a.grids) == (b.id, b.grids)
        for x, y in zip(_arrays(a), _arrays(b), strict=True):
            assert x.dtype == y.dtype and np.array_equal(x, y)
    assert not list(shared.SHM.glob(f"{shared.prefix(loader.owner.token)}*"))


def _arrays(s: Sample) -> list[np.ndarray]:
    items = [a for each in s.media.values() for item in each if item is not None for a in item]
    return [s.tokens, s.loss, *items]


class _Dies(SyntheticSource):
    """Sample 5 kills the worker process that loads it."""

    def __getitem__(self, i):
        if int(i) == 5:
            os._exit(1)
        return super().__getitem__(i)


def test_a_worker_that_dies_stops_the_load_with_an_error_that_says_why(tmp_path):
    cfg = load_config(
        "configs/tiny.yaml", [*TINY, "data.workers=1", f"train.output_dir={tmp_path}"]
    )
    loader = Loader(cfg, _Dies(cfg))
    try:
        with pytest.raises(
            DataError, match=r"data.workers=1: a worker process died while loading step 4"
        ) as got:
            loader.load(np.arange(10), step=4)
    finally:
        loader.close()
    # ... and names the record it was loading, and how it ended
    assert "loading index 5 (exit code 1)" in str(got.value), got.value


def test_a_dead_workers_exit_code_is_read_once_the_pool_has_collected_it(tmp_path, monkeypatch):
    """The pool's manager thread collects a dead worker's exit status (`waitpid`) while the load
    asks for it. Asked beside it, the code was lost in 13 of 150 loads beside a CPU burner:
    Python takes the lost `waitpid` (ECHILD) for a process still running, and the error named
    no record. Here the manager thread takes 0.5 s to record what it collected, the window made
    wide; the load and the close must wait for it, not ask beside it."""
    from concurrent.futures.process import _ExecutorManagerThread

    real = os.waitpid

    def slow_to_record(pid, flags):
        got = real(pid, flags)
        if got[0] == pid and isinstance(threading.current_thread(), _ExecutorManagerThread):
            time.sleep(0.5)
        return got

    monkeypatch.setattr(os, "waitpid", slow_to_record)
    cfg = load_config(
        "configs/tiny.yaml", [*TINY, "data.workers=2", f"train.output_dir={tmp_path}"]
    )
    loader = Loader(cfg, _Dies(cfg))
    try:
        with pytest.raises(DataError, match=r"loading index 5 \(exit code 1\)"):
            loader.load(np.arange(10), step=4)
        workers = list(loader.pool._processes.values())
    finally:
        loader.close()
    assert sorted(w.exitcode for w in workers) == [-signal.SIGTERM, 1]


def test_closing_the_feed_stops_and_joins_its_workers(tmp_path):
    """grain's close only marks its iterators closed: the step iterator's stops the loader's
    worker processes (a notebook whose run raised would keep them) and deletes its files."""
    import multiprocessing

    run = _resolved("data.workers=2", f"train.output_dir={tmp_path}")
    feed = make_pipeline(run, prefetch=2)
    next(feed)
    workers = multiprocessing.active_children()
    assert len(workers) == 2
    loader = _step_iterator(feed).feed.loader
    own = {p.pid for p in loader.pool._processes.values()}  # (the rest: an earlier test's)
    token = loader.owner.token
    assert list(shared.SHM.glob(f"jaxmllm-{token}*"))  # its lock, its workers' slots
    feed.close()
    # ... each ended and collected: the OS has no such pid, not even a zombie, and Python
    # has its exit code (the pool's manager thread is their one reaper: `loader._reaped`)
    left = [
        (w.pid, w.pid in own, w.exitcode) for w in workers if running(w.pid) or w.exitcode is None
    ]
    assert not left, f"(pid, this feed's, exit code): {left}"
    assert not [c.pid for c in multiprocessing.active_children() if running(c.pid)]
    assert not list(shared.SHM.glob(f"jaxmllm-{token}*"))


def _ignore_sigterm():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _busy(started: str) -> None:
    open(started, "w").close()
    time.sleep(60)


def test_a_worker_that_outlives_sigterm_is_killed_and_said(caplog, tmp_path, monkeypatch):
    """Closing stops every worker: one that ignores SIGTERM is killed after its grace
    (`STOP_GRACE_S`, 5 s; 0.5 s here, the same path), and the warning gives its signal state
    (how a worker once outlived SIGTERM beside a burner)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from jaxmllm.data import loader
    from jaxmllm.data.loader import _stop

    monkeypatch.setattr(loader, "STOP_GRACE_S", 0.5)

    pool = ProcessPoolExecutor(1, multiprocessing.get_context("spawn"), _ignore_sigterm)
    started = tmp_path / "started"
    pool.submit(_busy, str(started))  # (busy: the pool's own stop, a sentinel, would wait)
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    [worker] = pool._processes.values()
    with caplog.at_level("WARNING", logger="jaxmllm"):
        _stop(pool, shared.Owner())
    assert not worker.is_alive() and worker.exitcode == -signal.SIGKILL
    assert f"pid {worker.pid}) outlived SIGTERM by 0.5 s" in caplog.text
    assert "SigIgn" in caplog.text


def _step_iterator(it):
    """The StepIterator under grain's prefetch iterators."""
    while type(it).__name__ != "StepIterator":
        it = it._parents[0] if getattr(it, "_parents", None) else it._maybe_nonnative_parent
    return it


UNGUARDED = """
from jaxmllm.config import load_config
from jaxmllm.feed.iterator import make_pipeline
from jaxmllm.resolve.run import resolve_run
cfg = load_config("configs/tiny.yaml", ["data.workers=1", "data.synthetic.num_samples=64",
    "data.eval.source=none", "train.output_dir={out}"])
next(make_pipeline(resolve_run(cfg, 8), prefetch=0))
print("loaded")
"""


@pytest.mark.slow  # ~30 s: a child Python and its spawned worker import jaxmllm
def test_a_script_without_a_main_guard_gets_an_error_not_a_hang(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED.format(out=tmp_path / "out"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # (the repo)
    env.pop("XLA_FLAGS", None)
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=root,
    )
    assert done.returncode != 0 and "loaded" not in done.stdout
    assert 'if __name__ == "__main__":' in done.stderr and "data.workers=1" in done.stderr


# (the LLM alone: a quicker compile of the same one-device timer; the GPU smoke's host case
# measures the recipe's step with its vision tower: tests/test_gpu_image.py)
LLM_ONLY = ["model.vision.enabled=false", "model.audio.enabled=false"]
LLM_ONLY += [f"data.synthetic.{kind}_fraction=0" for kind in ("image", "multi_image", "audio")]
LLM_ONLY += ["data.synthetic.video_fraction=0"]


@pytest.mark.slow  # ~1 min: compiles the tiny model's step for one device
def test_bench_host_times_the_step_on_a_device_when_asked(tmp_path, monkeypatch):
    """Rows of other worker counts plan the same buckets: they share one compiled step (a
    recipe's compiles for minutes on a GPU)."""
    built = []

    class Counted(bench_host.DeviceTimer):
        def __init__(self, cfg):
            built.append(cfg)
            super().__init__(cfg)

    monkeypatch.setattr(bench_host, "DeviceTimer", Counted)
    out = tmp_path / "rows.json"
    args = [
        "--config",
        "configs/tiny.yaml",
        "--data",
        "synthetic",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--workers",
        "0,1",
        "--measure-device",
        "--json",
        str(out),
    ]
    sets = [*TINY, *LLM_ONLY, f"train.output_dir={tmp_path}"]
    assert bench_host.main(args + [f"--set={s}" for s in sets]) == 0
    rows = json.loads(out.read_text())
    assert [row["workers"] for row in rows] == [0, 1] and len(built) == 1
    for row in rows:
        assert row["device_from"] == "measured" and 0 < row["device_s"] < 60
