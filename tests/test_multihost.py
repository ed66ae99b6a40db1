"""Multi-host: job start-up, per-host bucketizing, and launched multi-process runs.

The fast tests check the pieces in one process (a plan's slices for 2, 4 and 8 hosts). The
slow ones launch real jobs with `python -m jaxmllm.launch` (gloo collectives between processes
on this CPU): 2 processes x 4 devices must train exactly like one process with 8, each sample's
text and every image and clip trained by exactly one process; killing one process stops the
job with a clear message, and rerunning resumes it.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from jaxmllm.batch.bucketize import bucketize
from jaxmllm.config import ConfigError, DistributedConfig, load_config
from jaxmllm.feed.iterator import local_media, local_parts
from jaxmllm.launch import free_port
from jaxmllm.loop import ledger
from jaxmllm.loop.metrics import read_metrics
from jaxmllm.process.distributed import describe_mismatch, resolve_job
from jaxmllm.resolve.run import resolve_run

from runs import NO_EVAL, child_env, train_cmd

# ----------------------------------------------------------------------------- job start-up


def test_no_job_means_one_process():
    assert resolve_job(DistributedConfig(), env={}) is None
    one = {"JAXMLLM_NUM_PROCESSES": "1", "JAXMLLM_PROCESS_ID": "0"}
    assert resolve_job(DistributedConfig(), env=one) is None


def test_job_from_environment_and_config():
    env = {
        "JAXMLLM_COORDINATOR": "10.0.0.1:1234",
        "JAXMLLM_NUM_PROCESSES": "4",
        "JAXMLLM_PROCESS_ID": "3",
    }
    job = resolve_job(DistributedConfig(), env=env)
    assert (job.coordinator, job.num_processes, job.process_id) == ("10.0.0.1:1234", 4, 3)
    # The config wins over the environment.
    job = resolve_job(DistributedConfig(process_id=1), env=env)
    assert job.process_id == 1


def test_incomplete_or_bad_job_settings_are_named():
    with pytest.raises(ConfigError, match=r"missing distributed\.process_id"):
        resolve_job(DistributedConfig(coordinator="h:1", num_processes=2), env={})
    with pytest.raises(ConfigError, match=r"process_id=5 is outside 0\.\.1"):
        resolve_job(DistributedConfig(coordinator="h:1", num_processes=2, process_id=5), env={})
    with pytest.raises(ConfigError, match=r"JAXMLLM_NUM_PROCESSES='two' must be an integer"):
        resolve_job(DistributedConfig(), env={"JAXMLLM_NUM_PROCESSES": "two"})
    with pytest.raises(ConfigError, match="must be host:port"):
        DistributedConfig(coordinator="localhost")


def test_slurm_and_open_mpi_jobs_are_detected():
    slurm = {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "1",
    }
    job = resolve_job(DistributedConfig(), env={**slurm, "SLURM_PROCID": "1"})
    assert (job.coordinator, job.num_processes, job.process_id, job.detected) == (
        None,
        2,
        1,
        "SLURM",
    )
    # An allocation without a multi-task step (e.g. sbatch's own shell) is one process.
    assert resolve_job(DistributedConfig(), env={**slurm, "SLURM_NTASKS": "1"}) is None
    mpi = {"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"}
    assert resolve_job(DistributedConfig(), env=mpi).process_id == 2


def test_disagreeing_processes_are_described():
    ref = {
        "config": {"optim.lr": 0.001, "batch.llm_rows": 1},
        "local_devices": 4,
        "platform": "cpu",
    }
    same = json.loads(json.dumps(ref))
    assert describe_mismatch(ref, same) == ""
    other = {
        "config": {"optim.lr": 0.002, "batch.llm_rows": 1},
        "local_devices": 2,
        "platform": "cpu",
    }
    msg = describe_mismatch(ref, other)
    assert "local_devices: 4 -> 2" in msg and "optim.lr: 0.001 -> 0.002" in msg


MESH_OF_TWO_PROCESSES = """
import logging, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_num_cpu_devices", 2)
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
logging.basicConfig(level=logging.WARNING)
import sharding
mesh = sharding.make_mesh({"data": 1, "fsdp": 4})
print("hosts", sorted({d.slice_index for d in jax.devices()}), dict(mesh.shape))
"""


def test_two_processes_of_one_machine_are_one_host_to_the_mesh():
    """Two processes of two devices each on this machine (as a SLURM node runs one process a
    GPU): fsdp 4 over both keeps its group on one host, so make_mesh says nothing (the check
    once counted one process's devices and warned on every such job)."""
    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-c", MESH_OF_TWO_PROCESSES, address]
    env = {**child_env(), "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen([*cmd, str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for i in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err.decode()[-2000:]
        assert "hosts [0]" in out.decode() and "'fsdp': 4" in out.decode()
        assert "span hosts" not in err.decode(), err.decode()[-2000:]


# ----------------------------------------------------------------------------- per-host batches


@pytest.fixture(scope="module")
def planned():
    run = resolve_run(load_config("configs/tiny.yaml", ["data.synthetic.num_samples=512"]))
    cfg, source, index, caps = run.cfg, run.source, run.index, run.caps
    planner = run.planner()
    plans = [planner.plan() for _ in range(3)]
    samples = {int(i): source[int(i)] for p in plans for i in np.unique(p.samples)}
    return cfg, caps, index, plans, samples, source


@pytest.mark.parametrize("hosts", [2, 4, 8])
def test_each_host_fills_exactly_its_slice_of_the_batch(planned, hosts):
    cfg, caps, index, plans, samples, source = planned
    crossing = 0
    for plan in plans:
        full = bucketize(plan, samples, cfg, caps, index=index)
        per = 8 // hosts
        host_of = np.arange(8) // per
        crossing += int(
            (
                host_of[plan.items["vision"].device]
                != host_of[plan.device[plan.items["vision"].owner]]
            ).sum()
        )
        texts, items = [], []
        for h in range(hosts):
            positions = np.arange(h * per, (h + 1) * per)
            parts = local_parts(plan, positions, 8)
            # Nothing else is loaded, and of it only the media encoded here.
            media = local_media(parts)
            mine = {i: source.load(i, media[i]) for i in parts["read"].tolist()}
            local = bucketize(plan, mine, cfg, caps, positions, index)
            assert local.keys() == full.keys()
            for key, value in full.items():
                np.testing.assert_array_equal(local[key], value[:, positions], err_msg=key)
            texts.append(parts["text"])
            items += [tuple(x) for x in parts["vision"]]
        # Every sample's text on exactly one host; every image encoded on exactly one host.
        np.testing.assert_array_equal(np.sort(np.concatenate(texts)), np.sort(plan.samples))
        assert len(items) == len(set(items)) == len(plan.items["vision"].owner)
    assert crossing > 0  # the plans do route images between hosts: the test has teeth


def test_a_sample_that_fails_on_one_host_keeps_the_routing_aligned(planned):
    """A load failure on the text's host only must not shift the other items' exchange slots."""
    cfg, caps, index, plans, samples, _ = planned
    plan = plans[0]
    host_of = np.arange(8) // 4
    away = host_of[plan.items["vision"].device] != host_of[plan.device[plan.items["vision"].owner]]
    # a sample whose images are all encoded on the other host (none beside its text)
    n_items = np.bincount(plan.items["vision"].owner, minlength=len(plan.samples))
    n_away = np.bincount(plan.items["vision"].owner, away, minlength=len(plan.samples))
    owner = int(np.flatnonzero((n_items > 0) & (n_away == n_items))[0])
    victim = int(plan.samples[owner])
    text_host = int(host_of[plan.device[owner]])
    full = bucketize(plan, samples, cfg, caps, index=index)
    for h in range(2):
        positions = np.arange(h * 4, (h + 1) * 4)
        mine = {i: samples[i] for i in local_parts(plan, positions, 8)["read"].tolist()}
        if h == text_host:
            mine[victim] = None  # e.g. the file vanished on this host's mount
        local = bucketize(plan, mine, cfg, caps, positions, index)
        # The other host's arrays are untouched; the failing host only loses the victim's rows.
        if h != text_host:
            for key, value in full.items():
                np.testing.assert_array_equal(local[key], value[:, positions], err_msg=key)
        else:
            same = local["vision_send"] == full["vision_send"][:, positions]
            assert same.all()


# ----------------------------------------------------------------------------- launched jobs

STEPS = 6
OVERRIDES = [
    f"train.steps={STEPS}",
    "train.log_every=1",
    "train.checkpoint_every=2",
    "train.ledger=true",
    "train.progress_bar=false",
    "data.synthetic.num_samples=256",
    "distributed.heartbeat_timeout_s=15",
    "batch.devices_per_host=2",  # (the same plans whatever the processes: auto is a process's)
]


# A held-out evaluation at steps 3 and 6 (a small set, two short answers): its metrics are the
# job's whatever the processes, like the loss (the one-process run and the two-process one)
EVAL = [
    "data.eval.source=synthetic",
    "data.eval.samples=24",
    "data.eval.questions=2",
    "data.eval.max_new_tokens=4",
    "train.eval_every=3",
]

# Context groups of 2 (data 2 x fsdp 2 x context 2: each process holds two whole groups). The
# held-out set goes through the training feed, which takes a host's context groups: a copy of
# it that did not (its local parts without the context) left the host of groups 2 and 3 no text
# to load. Rows of 96 tokens a device, 192 a group.
CONTEXT = ["mesh.data=2", "mesh.fsdp=2", "mesh.context=2", "batch.llm_row_len=96"]


def _launch(processes, out, *extra, kill=None):
    cmd = train_cmd(
        out, *OVERRIDES, *extra, module="jaxmllm.launch", args=("--processes", str(processes))
    )
    proc = subprocess.Popen(
        cmd, env=child_env(kill), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        text, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        text, _ = proc.communicate()
        pytest.fail(f"the job hung (killed after 900 s):\n{text[-3000:]}")
    return proc.returncode, text


def _losses(out):
    rows = {}
    for r in read_metrics(out):
        rows[r["step"]] = r["loss"]  # a redone step: its last value
    return [rows[s] for s in sorted(rows)]


def _in_process(out, *extra):
    """The reference: one process with 8 devices, this one (the launcher adds nothing for one
    process but a child: its start-up)."""
    from jaxmllm.train import main

    main(
        load_config("configs/tiny.yaml", [*NO_EVAL, *OVERRIDES, *extra, f"train.output_dir={out}"])
    )


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    _in_process(out, *EVAL, *CONTEXT)
    return out


def _check_ledger(out, processes):
    assert not ledger.check_replays(out)
    steps = ledger.read_ledger(out)
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert all(sorted(v) == list(range(processes)) for v in steps.values())
    return ledger.audit(out, range(1, STEPS + 1))


@pytest.mark.slow  # ~150 s: a 2-process job killed after step 3 and relaunched; the reference
def test_two_processes_train_like_one_and_a_killed_one_stops_the_job_for_a_relaunch(
    one_process, tmp_path
):
    """2 processes x 4 devices train like one process with 8 (the data state in a file per
    process), their held-out evaluation too, and the metrics are the whole job's, with context
    groups (`CONTEXT`). Process 1
    SIGKILLs itself after step 3, once checkpoint 2 is committed (whatever the machine's speed):
    the launcher must stop process 0, which waits on it (_launch fails on a hang). The
    relaunch resumes at step 2 and ends as the one process does.

    (Four processes of 2 devices ran the same job once more: every process's code is the same
    for 2 and 4; the per-host slices of a plan are held for 2, 4 and 8 hosts in
    test_each_host_fills_exactly_its_slice_of_the_batch.)"""
    kill = {"at": "step", "step": 3, "committed": 2, "process": 1}
    code, text = _launch(2, tmp_path, *EVAL, *CONTEXT, kill=kill)
    assert "killpoints: SIGKILL after step 3" in text, text[-3000:]
    assert code != 0
    assert "process 1 failed (killed by SIGKILL)" in text, text[-3000:]
    code, again = _launch(2, tmp_path, *EVAL, *CONTEXT)
    assert code == 0, again[-3000:]
    assert "resumed from checkpoint at step 2 in" in again, again[-3000:]
    np.testing.assert_allclose(_losses(tmp_path), _losses(one_process), rtol=1e-5)
    got, ref = _check_ledger(tmp_path, 2), _check_ledger(one_process, 1)
    # The union of what the processes trained is the planned set, none of it twice.
    for part in ("text", "vision", "audio"):
        assert got[part] == ref[part], part
        assert set(got[part].values()) <= {1, 2}  # 256 samples, ~4 steps an epoch
    assert sum(got["text"].values()) == sum(ref["text"].values())
    # The metrics are the whole job's, not process 0's share (a redone step: its last row).
    rows, ref_rows = read_metrics(tmp_path), read_metrics(one_process)
    for a, b in zip(rows, ref_rows, strict=True):
        assert a["samples"] == b["samples"]
        assert a["padding/llm"] == pytest.approx(b["padding/llm"], abs=1e-6)
        for key in [k for k in b if k.startswith("eval/")]:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    assert [r["step"] for r in rows if "eval/loss" in r] == [3, 6]
    data = tmp_path / "checkpoints" / str(STEPS) / "data"
    assert sorted(p.name for p in data.glob("process_*")) == [
        f"process_{i}-of-2.json" for i in range(2)
    ]


@pytest.mark.slow
def test_processes_with_different_configs_all_stop_with_the_difference(tmp_path):
    """No launcher: the environment names the job; every process stops, naming the key."""
    port = free_port()  # not a fixed one: other jobs on the machine may hold it
    procs = []
    for pid, lr in ((0, "0.003"), (1, "0.002")):
        env = child_env()
        env.update(
            JAXMLLM_COORDINATOR=f"127.0.0.1:{port}",
            JAXMLLM_NUM_PROCESSES="2",
            JAXMLLM_PROCESS_ID=str(pid),
        )
        cmd = train_cmd(tmp_path, f"optim.lr={lr}")
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 2, out[-3000:]
        assert "process 1: optim.lr: 0.003 -> 0.002" in out, out[-3000:]


GRPO = [
    "train.objective=grpo",
    "data.synthetic.image_fraction=1.0",
    *(f"data.synthetic.{k}_fraction=0" for k in ("audio", "video", "multi_image")),
    "rl.prompts_per_step=4",
    "rl.group_size=2",
    "rl.max_new_tokens=6",
    "train.steps=2",
    "train.checkpoint_every=2",
]


@pytest.mark.slow  # a launched job and one in-process, of 2 GRPO steps, each compiling its programs
def test_grpo_on_two_processes_samples_scores_and_trains_like_one(tmp_path):
    """train.objective: grpo on 2 processes x 4 devices: every process generates the whole
    rollout as one SPMD program, scores and plans it, and trains its own rows; the rollouts'
    rewards and lengths and the losses are one process's with 8 devices."""
    _in_process(tmp_path / "1", *GRPO)
    code, text = _launch(2, tmp_path / "2", *GRPO)
    assert code == 0, text[-3000:]
    keys = ("rl/reward", "rl/completion_len_mean", "rl/steps_per_rollout", "samples")
    one, two = read_metrics(tmp_path / "1"), read_metrics(tmp_path / "2")
    assert [[r[k] for k in keys] for r in two] == [[r[k] for k in keys] for r in one]
    np.testing.assert_allclose(_losses(tmp_path / "2"), _losses(tmp_path / "1"), rtol=1e-5)
