"""The lengths index at scale: columns every host maps, the build as a map over shards (this
process, local worker processes, Ray), and what no build or start-up may do: hang on a dead
worker, publish half an index, train on a damaged one, run out of file descriptors."""

import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jaxmllm.config import ConfigError, load_config
from jaxmllm.data import index_build
from jaxmllm.data.columnar import Strings
from jaxmllm.data.index import build_index
from jaxmllm.data.lengths import Mixture
from jaxmllm.data.source import open_source
from jaxmllm.plan.shuffle import IndexShuffle
from jaxmllm.plan.stream import MixtureStream, SampleStream

from runs import child_env

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

SETTINGS = [
    "data.source=jsonl",
    "data.eval.source=none",
    "data.image_min_pixels=256",
    "data.image_max_pixels=1024",
]


def config(path, *extra):
    return load_config("configs/tiny.yaml", [*SETTINGS, f"data.path={path}", *extra])


def write_manifest(path: Path, n: int = 120, extra: tuple = ()) -> Path:
    """`n` records (text, every 10th with a PNG), then `extra` lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((24, 40, 3), 90, np.uint8)).save(path.parent / "a.png")
    lines = []
    for i in range(n):
        rec = {"id": f"r{i}", "text": "word " * (1 + i % 13)}
        if i % 10 == 3:
            rec = {"id": f"r{i}", "text": "<image> a picture", "images": ["a.png"]}
        lines.append(json.dumps(rec))
    path.write_text("\n".join([*lines, *extra]) + "\n")
    return path


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def index_cli(path, *args, index_kill=None, timeout=240, extra=()):
    """`python -m jaxmllm.data.index` on `path` in a child process."""
    sets = [x for s in (*SETTINGS, f"data.path={path}", *extra) for x in ("--set", s)]
    cmd = [sys.executable, "-m", "jaxmllm.data.index", "--config", "configs/tiny.yaml", *sets]
    return subprocess.run(
        [*cmd, *args],
        env=child_env(index_kill=index_kill),
        timeout=timeout,
        capture_output=True,
        text=True,
    )


# ----------------------------------------------------------------------------- storage


def test_strings_keep_any_text_at_its_own_length():
    texts = ["", "a", "é" * 3, "\udcff raw byte", "x" * 100_000, "emoji \U0001f600", ""]
    col = Strings.of(texts)
    assert col.tolist() == texts and len(col.data) < 100_100
    assert col[1:4].tolist() == texts[1:4] and col[-1] == ""
    both = Strings.concat([col[2:5], col[:2]])
    assert both.tolist() == texts[2:5] + texts[:2] and both.offsets[0] == 0


def test_the_index_shuffle_is_every_epoch_a_permutation():
    for n in (1, 2, 3, 7, 1000, 4097):
        assert sorted(IndexShuffle(n, [5, 1])(np.arange(n)).tolist()) == list(range(n))
    stream = SampleStream(1000, 3, "index")
    got = stream.take(0, 3000)
    for e in range(3):
        assert sorted(got[e * 1000 : (e + 1) * 1000].tolist()) == list(range(1000))
    assert not np.array_equal(got[:1000], got[1000:2000])  # (each epoch its own order)
    # Any position alone is the same sample: a resumed stream reads on where it stopped.
    pos = np.array([2999, 5, 1500, 1000])
    assert np.array_equal(SampleStream(1000, 3, "index").at(pos), got[pos])
    assert np.array_equal(SampleStream(1000, 3, "index").take(1234, 500), got[1234:1734])
    mix = Mixture.of(["a", "b"], [300, 50], [1.0, 1.0])
    rounds = MixtureStream(mix, 0, "index").take(0, 4 * 350)
    for r in range(4):  # each round: every source its draws; each source's epochs whole
        part = rounds[r * 350 : (r + 1) * 350]
        assert (part < 300).sum() == mix.draws[0] and (part >= 300).sum() == mix.draws[1]
    # 4 rounds draw 700 of b's 50 samples (14 epochs: each 14 times) and 700 of a's 300
    # (2 epochs and a third: each twice, 100 of them three times)
    counts = np.bincount(rounds, minlength=350)
    assert (counts[300:] == 14).all()
    assert sorted(np.bincount(counts[:300]).nonzero()[0].tolist()) == [2, 3]
    assert (counts[:300] == 3).sum() == 100
    assert np.array_equal(MixtureStream(mix, 0, "index").take(500, 300), rounds[500:800])


# ----------------------------------------------------------------------------- building


def test_the_index_is_the_same_bytes_however_it_is_built(tmp_path, monkeypatch):
    extra = ('{"id": "r5", "text": "a repeated id"}', '{"broken', '{"id": "x", "text": ""}')
    path = write_manifest(tmp_path / "m.jsonl", 150, extra)
    cfg = config(path)
    out = tmp_path / "ix"
    summary = build_index(cfg, path, out, progress=False)
    assert summary["rejects"] == {"duplicate_id": 1, "empty_sample": 1, "malformed_line": 1}
    assert summary["examples"]["duplicate_id"]["where"] == "record 150"  # (was None)
    want = digest(out)
    monkeypatch.setattr(index_build, "shard_size", lambda records, workers: 7)
    build_index(cfg, path, out, progress=False)
    assert digest(out) == want  # shards of 7 records
    build_index(cfg, path, out, progress=False, workers=2)
    assert digest(out) == want  # in two worker processes
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing left beside


@pytest.mark.slow
def test_ray_builds_the_same_bytes_and_retries_a_killed_task(tmp_path, monkeypatch):
    """Ray's local cluster: the same index as local processes; a task whose worker is killed
    once is retried by Ray, the index unchanged."""
    ray = pytest.importorskip("ray")
    path = write_manifest(tmp_path / "m.jsonl", 150, ('{"id": "r5", "text": "again"}',))
    cfg = config(path)
    out = tmp_path / "ix"
    # (built in this process: the same bytes as in worker processes, the test above)
    build_index(cfg, path, out, progress=False)
    want = digest(out)
    kill = {"record": "r77", "how": "kill", "once": str(tmp_path / "killed-once")}
    for key, value in child_env(index_kill=kill).items():  # (Ray's workers start from these)
        monkeypatch.setenv(key, value)
    # Ray's session files in a folder of the test's, not /tmp/ray (tests leave nothing in the
    # temporary folder); short, as Ray's sockets live in it (a socket path has 107 bytes).
    sessions = tempfile.mkdtemp(prefix="ray-")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=sessions)
    try:
        build_index(cfg, path, out, progress=False, ray="auto")
    finally:
        ray.shutdown()
        shutil.rmtree(sessions, ignore_errors=True)
    assert (tmp_path / "killed-once").exists()  # (the hook did kill a Ray worker)
    assert digest(out) == want


@pytest.mark.parametrize("how", ["kill", "abort"])
def test_a_worker_that_dies_on_a_record_is_a_counted_reject(tmp_path, how):
    """A worker killed for memory, or aborted in native code, on one record: the build names
    the record (`record_crashed`) and goes on; it never waits on the dead worker."""
    path = write_manifest(tmp_path / "m.jsonl", 60)
    done = index_cli(path, "--workers", "2", index_kill={"record": "r17", "how": how})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "record_crashed" in done.stdout and "m.jsonl line 18" in done.stdout
    (out,) = Path(f"{path}.index").iterdir()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accepted"] == 59 and summary["rejects"] == {"record_crashed": 1}
    (reject,) = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert reject["id"] == "m.jsonl:18" and reject["row"] == 17


def test_a_worker_killed_once_rejects_its_record_without_trying_it_again(tmp_path):
    """A record on which a worker died once (here killed once, then harmless: as if another
    process had taken the memory) is still a reject naming it: a death is never retried, as
    its cause is not known; every other record of its shard is indexed as without the kill."""
    path = write_manifest(tmp_path / "m.jsonl", 60)
    clean = index_cli(path, "--workers", "2")
    assert clean.returncode == 0, clean.stderr[-3000:]
    (out,) = Path(f"{path}.index").iterdir()
    want = np.load(out / "text.npy")
    once = {"record": "r40", "how": "kill", "once": str(tmp_path / "once")}
    done = index_cli(path, "--workers", "2", index_kill=once)
    assert done.returncode == 0 and (tmp_path / "once").exists(), done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accepted"] == 59 and summary["rejects"] == {"record_crashed": 1}
    (reject,) = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert reject["id"] == "m.jsonl:41" and reject["row"] == 40
    assert np.array_equal(np.load(out / "text.npy"), np.delete(want, 40))


@pytest.mark.slow
def test_an_abort_in_the_rust_tokenizer_names_the_record(tmp_path):
    """A 12 MB chat turn under a 2 GiB address-space cap: the tokenizers library's allocation
    fails and it aborts the process (SIGABRT, no exception to catch); the record is rejected,
    named, and the build ends with the others indexed."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(tmp_path / "tokenizer.json"))
    huge = {
        "id": "huge",
        "messages": [
            {"role": "user", "content": "a " * (6 << 20)},
            {"role": "assistant", "content": "b"},
        ],
    }
    path = write_manifest(tmp_path / "m.jsonl", 20, (json.dumps(huge),))
    cap = "import resource; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))"
    sets = [
        *SETTINGS,
        f"data.path={path}",
        f"data.tokenizer={tmp_path / 'tokenizer.json'}",
        "model.llm.vocab_size=300",
    ]
    code = f"{cap}; import sys; from jaxmllm.data.index import main; sys.exit(main(sys.argv[1:]))"
    args = [
        "--config",
        "configs/tiny.yaml",
        "--workers",
        "1",
        *[x for s in sets for x in ("--set", s)],
    ]
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=child_env(),
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "record_crashed" in done.stdout and "m.jsonl line 21" in done.stdout
    assert "20 accepted, 1 rejected" in done.stdout


@pytest.mark.parametrize("at", ["merge", "publish", "between_renames"])
def test_a_build_killed_at_any_point_leaves_the_old_index_or_none(tmp_path, at):
    path = write_manifest(tmp_path / "m.jsonl", 80)
    cfg = config(path)
    out = Path(build_index(cfg, path, progress=False)["index"])
    before = digest(out)
    killed = index_cli(path, "--workers", "0", index_kill={"at": at})
    assert killed.returncode == -9, killed.stderr[-3000:]
    if at == "between_renames":
        assert not out.exists()
        with pytest.raises(ConfigError, match="no lengths index"):
            open_source(cfg)
    else:
        assert digest(out) == before and len(open_source(cfg)) == 80
    build_index(cfg, path, progress=False)  # the next build clears what the killed one left
    assert digest(out) == before
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def test_a_build_that_fails_midway_keeps_the_previous_index(tmp_path, monkeypatch):
    """An error past the measure stage (the probe's: a preprocessing value that overflows as
    the summary is made) leaves the previous index as it was, and nothing beside it."""
    from jaxmllm.data import index

    path = write_manifest(tmp_path / "m.jsonl", 40)
    cfg = config(path)
    out = Path(build_index(cfg, path, progress=False)["index"])
    before = digest(out)

    def overflow(*args, **kwargs):
        raise OverflowError("Python int too large to convert to C long")

    monkeypatch.setattr(index, "summarize", overflow)
    with pytest.raises(OverflowError):
        build_index(cfg, path, progress=False)
    assert digest(out) == before and [p.name for p in out.parent.iterdir()] == [out.name]


# ----------------------------------------------------------------------------- loading


def _fewer_rows(out):
    np.save(out / "text.npy", np.load(out / "text.npy")[:-1])


def _string_counts(out):
    np.save(out / "text.npy", np.load(out / "text.npy").astype(str))


def _negative_count(out):
    text = np.load(out / "text.npy")
    text[7] = -5
    np.save(out / "text.npy", text)


def _absurd_patches(out):
    sizes = np.load(out / "vision.sizes.npy")
    sizes[0] = 10**9
    np.save(out / "vision.sizes.npy", sizes)


def _negative_offsets(out):
    starts = np.load(out / "scan.starts.npy")
    starts[3] = -100
    np.save(out / "scan.starts.npy", starts)


def _rows_out_of_order(out):
    row = np.load(out / "row.npy")
    row[[4, 5]] = row[[5, 4]]
    np.save(out / "row.npy", row)


def _another_format(out):
    summary = json.loads((out / "summary.json").read_text())
    summary["format"] = "parquet"
    (out / "summary.json").write_text(json.dumps(summary))


def _another_index_format(out):
    summary = json.loads((out / "summary.json").read_text())
    summary["index_format"] = "jaxmllm-lengths-0"
    (out / "summary.json").write_text(json.dumps(summary))


def _half_written_summary(out):
    text = (out / "summary.json").read_text()
    (out / "summary.json").write_text(text[: len(text) // 2])


def _half_written_column(out):
    data = (out / "text.npy").read_bytes()
    (out / "text.npy").write_bytes(data[: 128 + (len(data) - 128) // 2])


def _column_missing(out):
    (out / "id.bytes.npy").unlink()


def _older_jsonl_index(out):
    for p in out.iterdir():
        p.unlink()
    (out / "lengths.jsonl").write_text('{"text": 3, "id": "r0", "row": 0, "line": 1}\n')


DAMAGE = {
    "fewer_rows": (_fewer_rows, "text.npy"),
    "string_counts": (_string_counts, "text.npy"),
    "negative_count": (_negative_count, "text.npy"),
    "absurd_patches": (_absurd_patches, "vision.sizes.npy"),
    "negative_offsets": (_negative_offsets, "scan.starts.npy"),
    "rows_out_of_order": (_rows_out_of_order, "row.npy"),
    "another_format": (_another_format, "parquet"),
    "another_index_format": (_another_index_format, "summary.json"),
    "half_written_summary": (_half_written_summary, "summary.json"),
    "half_written_column": (_half_written_column, "text.npy"),
    "column_missing": (_column_missing, "id.bytes.npy"),
    "older_jsonl_index": (_older_jsonl_index, "lengths.jsonl"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_index_stops_the_run_naming_the_file(tmp_path, damage):
    """Never a run that trains on nothing and exits 0, nor a traceback: a start-up error that
    names the file and says to rebuild."""
    path = write_manifest(tmp_path / "m.jsonl", 60)
    cfg = config(path)
    out = Path(build_index(cfg, path, progress=False)["index"])
    tamper, named = DAMAGE[damage]
    tamper(out)
    with pytest.raises(ConfigError, match="Rebuild it") as e:
        open_source(cfg)
    assert named in str(e.value)


def test_thousands_of_data_files_under_a_low_descriptor_limit(tmp_path):
    """One open file per data file per process, never closed, ran out of descriptors: 300
    one-line files under `ulimit -n 128` are indexed and loaded whole."""
    folder = tmp_path / "shards"
    folder.mkdir()
    for i in range(300):
        (folder / f"part-{i:04d}.jsonl").write_text(json.dumps({"id": f"r{i}", "text": "hi"}))
    code = f"""
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
from jaxmllm.config import load_config
from jaxmllm.data.index import build_index
from jaxmllm.data.source import open_source
cfg = load_config("configs/tiny.yaml", {[*SETTINGS, f"data.path={folder}"]!r})
summary = build_index(cfg, progress=False)
source = open_source(cfg)
loaded = sum(source[i] is not None for i in range(len(source)))
print("accepted", summary["accepted"], "loaded", loaded)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), timeout=300, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "accepted 300 loaded 300" in done.stdout


def test_long_member_names_cost_their_own_bytes(tmp_path):
    """One 60,000-character member name among 300, under the tar header cap
    (webdataset.MAX_HEADER_BYTES; a fixed-width array of names: 72 MB)."""
    shard = tmp_path / "data.tar"
    long_key = "k" * 60_000
    with tarfile.open(shard, "w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(300):
            key = long_key if i == 150 else f"s{i:05d}"
            data = json.dumps({"text": f"sample {i}"}).encode()
            info = tarfile.TarInfo(f"{key}.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    cfg = config(shard, "data.format=webdataset", "data.source=files")
    summary = build_index(cfg, shard, progress=False)
    assert summary["accepted"] == 300
    out = Path(summary["index"])
    assert sum(p.stat().st_size for p in out.iterdir()) < 1_000_000
    source = open_source(cfg)
    assert source.record_id(150) == long_key and source[150] is not None


def test_a_mapped_index_plans_every_sample_once_across_a_restart(tmp_path):
    """The planner on a mapped index (its epochs in the index shuffle's order): a planner
    restarted from the state saved after step 5 plans what the uninterrupted one plans, and
    every stream position it has taken is trained exactly once or still deferred."""
    from collections import Counter

    from jaxmllm.plan.stream import stream_of
    from jaxmllm.resolve.run import resolve_run

    path = write_manifest(tmp_path / "m.jsonl", 256)
    cfg = config(path)
    build_index(cfg, path, progress=False)
    run = resolve_run(cfg, 8)
    assert run.index.shuffle == "index"
    whole = run.planner()
    want = [whole.plan().samples for _ in range(12)]
    first = run.planner()
    got = [first.plan().samples for _ in range(5)]
    again = run.planner()
    again.set_state(json.loads(json.dumps(first.get_state())))
    got += [again.plan().samples for _ in range(7)]
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    state = again.get_state()
    taken = Counter(stream_of(run.index, cfg.data.seed).take(0, state["cursor"]).tolist())
    waiting = Counter(sample for sample, _ in state["deferred"])
    trained = Counter(np.concatenate(got).tolist())
    assert trained + waiting == taken and len(taken) == 256


@pytest.mark.slow
def test_every_sample_of_a_mapped_index_trains_once_an_epoch_across_a_kill(tmp_path):
    """The trainer on a mapped index, killed after step 3 and resumed, trains what the
    uninterrupted run trains, step for step (the sample ledger)."""
    from jaxmllm.loop import ledger

    from runs import train_cmd

    path = write_manifest(tmp_path / "data" / "m.jsonl", 256)
    build_index(config(path), path, progress=False)
    sets = [*SETTINGS, f"data.path={path}", "train.steps=6", "train.log_every=1"]
    sets += ["train.checkpoint_every=2", "train.ledger=true", "train.progress_bar=false"]

    def run(out, kill=None):
        done = subprocess.run(
            train_cmd(out, *sets), env=child_env(kill), timeout=900, capture_output=True, text=True
        )
        return done.returncode, done.stdout + done.stderr

    ref, out = tmp_path / "ref", tmp_path / "out"
    code, log = run(ref)
    assert code == 0, log[-3000:]
    code, log = run(out, {"at": "step", "step": 3, "committed": 2})
    assert code == -9, log[-3000:]
    code, log = run(out)
    assert code == 0, log[-3000:]
    assert ledger.check_replays(out) == []  # (step 3, trained again, trained the same)
    assert ledger.read_ledger(out) == ledger.read_ledger(ref)
    assert ledger.audit(out, range(1, 7))["missing_steps"] == []


def test_a_source_goes_to_its_worker_processes_as_its_folder(tmp_path):
    """data.workers' processes receive the source pickled: the index's folder, mapped again
    there, never its columns (a copy of the whole index per worker)."""
    import pickle

    path = write_manifest(tmp_path / "m.jsonl", 3000)
    cfg = config(path)
    build_index(cfg, path, progress=False)
    source = open_source(cfg)
    blob = pickle.dumps(source)
    assert len(blob) < 20_000  # (the columns: over 300 kB)
    again = pickle.loads(blob)
    assert np.array_equal(again.index.text, source.index.text)
    assert again.record_id(2999) == "r2999" and np.array_equal(again[5].tokens, source[5].tokens)


def test_a_preprocessing_value_no_image_can_have_is_refused_before_indexing(tmp_path):
    """The probe's preprocessor_config.json min_pixels of 1e30 killed the index midway (counts
    past int64); it is refused when the config loads, naming the key."""
    path = write_manifest(tmp_path / "m.jsonl", 10)
    with pytest.raises(ConfigError, match="data.image_min_pixels"):
        config(path, f"data.image_min_pixels={10**30}", f"data.image_max_pixels={10**30}")
