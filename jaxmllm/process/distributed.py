"""Multi-process start-up: who is in the job, `jax.distributed`, and agreement between processes.

Every process of a job runs the same command. Before JAX starts its backends, `start` reads the
job's shape from `distributed.*` in the config or the environment (what `launch/` sets):

  JAXMLLM_COORDINATOR=host:port  JAXMLLM_NUM_PROCESSES=N  JAXMLLM_PROCESS_ID=i

or, with none of those, JAX's own cluster detection when a SLURM step or an Open MPI job has more
than one task. It splits CPU-only hosts into `mesh.cpu_devices / N` devices each (gloo
collectives between processes), calls `jax.distributed.initialize`, and then checks that every
process loaded the same config and sees the same number of devices, naming what differs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping

import jax

from jaxmllm.config import Config, ConfigError, DistributedConfig, to_dict
from jaxmllm.config.sections import MAX_CPU_DEVICES_PER_CORE
from jaxmllm.process import cpu_pool, xla_flags

log = logging.getLogger("jaxmllm")

ENV_COORDINATOR = "JAXMLLM_COORDINATOR"
ENV_NUM_PROCESSES = "JAXMLLM_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXMLLM_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class Job:
    """The shape of a multi-process job as this process sees it before JAX starts."""

    num_processes: int
    process_id: int
    coordinator: str | None  # None: JAX's cluster auto-detection finds it
    detected: str = ""  # the cluster environment JAX will read ("SLURM", "Open MPI"), if any


def resolve_job(cfg: DistributedConfig, env: Mapping[str, str] | None = None) -> Job | None:
    """The job this process belongs to, or None for a single-process run.

    Config fields win over the environment. Explicit settings must be complete: a coordinator
    without a process count or id (or the reverse) is an error naming what is missing.
    """
    env = os.environ if env is None else env
    coordinator = cfg.coordinator or env.get(ENV_COORDINATOR, "")
    num = cfg.num_processes if cfg.num_processes != -1 else _env_int(env, ENV_NUM_PROCESSES)
    pid = cfg.process_id if cfg.process_id != -1 else _env_int(env, ENV_PROCESS_ID)
    given = {
        "distributed.coordinator (or $" + ENV_COORDINATOR + ")": bool(coordinator),
        "distributed.num_processes (or $" + ENV_NUM_PROCESSES + ")": num is not None,
        "distributed.process_id (or $" + ENV_PROCESS_ID + ")": pid is not None,
    }
    if any(given.values()):
        missing = [k for k, ok in given.items() if not ok]
        if missing and not (num == 1 and not coordinator):
            raise ConfigError(
                f"a multi-process run needs all of coordinator, num_processes and process_id; "
                f"missing {', '.join(missing)}"
            )
        if num == 1:
            return None
        if not 0 <= pid < num:
            raise ConfigError(
                f"distributed.process_id={pid} is outside 0..{num - 1} "
                f"(distributed.num_processes={num})"
            )
        return Job(num, pid, coordinator)
    cluster = _detect_cluster(env)
    if cluster is not None:
        name, num, pid = cluster
        return Job(num, pid, None, detected=name)
    return None


def start(cfg: Config) -> Job | None:
    """Starts JAX for this process of the job (before any JAX backend is up). Idempotent."""
    xla_flags.apply(cfg.train.xla_gpu_flags)  # (before any backend starts: XLA reads it once)
    job = resolve_job(cfg.distributed)
    n = job.num_processes if job else 1
    if cfg.mesh.cpu_devices:
        if cfg.mesh.cpu_devices % n:
            raise ConfigError(
                f"mesh.cpu_devices={cfg.mesh.cpu_devices} (devices in all) does not split "
                f"evenly over {n} processes; make it a multiple of {n}"
            )
        split_cpu(cfg.mesh.cpu_devices // n)
    if job is None:
        return None
    from jax._src import distributed as jax_distributed

    if jax_distributed.global_state.client is None:
        # CPU hosts talk through gloo; GPU and TPU backends ignore this setting.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        d = cfg.distributed
        log.info(
            "process %d of %d: joining %s",
            job.process_id,
            job.num_processes,
            job.coordinator or f"the {job.detected} job",
        )
        try:
            jax.distributed.initialize(
                coordinator_address=job.coordinator,
                num_processes=job.num_processes if job.coordinator else None,
                process_id=job.process_id if job.coordinator else None,
                initialization_timeout=d.init_timeout_s,
                heartbeat_timeout_seconds=d.heartbeat_timeout_s,
            )
        except Exception as e:  # XLA raises plain RuntimeErrors/XlaRuntimeErrors here
            raise ConfigError(
                f"process {job.process_id} of {job.num_processes} could not join the job at "
                f"{job.coordinator or job.detected} within distributed.init_timeout_s="
                f"{d.init_timeout_s}: {str(e).splitlines()[0] if str(e) else type(e).__name__}. "
                "Start every process with the same coordinator and process count"
            ) from e
    if jax.process_count() != job.num_processes:
        raise ConfigError(
            f"JAX reports {jax.process_count()} processes but the job has {job.num_processes}; "
            "was jax.distributed initialised elsewhere with other settings?"
        )
    check_agreement(cfg)
    return job


_round = [0]  # a fresh key-value namespace per check (a process may train more than once)


def check_agreement(cfg: Config) -> None:
    """Every process must run the same config on the same number of local devices.

    Each process publishes what it loaded in the coordination service's key-value store and
    compares it with process 0's; a mismatch stops every process with the keys that differ.
    """
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None or jax.process_count() == 1:
        return
    _round[0] += 1
    prefix = f"jaxmllm/startup/{_round[0]}"
    mine = {
        "config": flatten({k: v for k, v in to_dict(cfg).items() if k != "distributed"}),
        "local_devices": jax.local_device_count(),
        "platform": jax.devices()[0].platform,
    }
    mine = json.loads(json.dumps(mine))  # (as process 0's comes back: a tuple is a list)
    client.key_value_set(f"{prefix}/{jax.process_index()}", json.dumps(mine))
    timeout_ms = cfg.distributed.init_timeout_s * 1000
    ref = json.loads(client.blocking_key_value_get(f"{prefix}/0", timeout_ms))
    # Every process publishes its verdict and reads everyone's, so all of them stop together
    # (one stopping alone would leave the others waiting on it until a timeout).
    problems = describe_mismatch(ref, mine)
    client.key_value_set(f"{prefix}/verdict/{jax.process_index()}", problems or "ok")
    verdicts = {
        p: client.blocking_key_value_get(f"{prefix}/verdict/{p}", timeout_ms)
        for p in range(jax.process_count())
    }
    bad = {p: v for p, v in verdicts.items() if v != "ok"}
    if bad:
        detail = "; ".join(f"process {p}: {v}" for p, v in sorted(bad.items())[:4])
        raise ConfigError(
            f"{len(bad)} of {jax.process_count()} processes disagree with process 0 ({detail}). "
            "Start every process with the same config file, the same --set overrides and the "
            "same number of devices"
        )


def describe_mismatch(ref: dict, mine: dict) -> str:
    """'' when they agree, else what differs (process 0's value -> this process's)."""
    out = []
    for key in ("local_devices", "platform"):
        if ref[key] != mine[key]:
            out.append(f"{key}: {ref[key]} -> {mine[key]}")
    a, b = ref["config"], mine["config"]
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    out += [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys[:6]]
    if len(keys) > 6:
        out.append(f"and {len(keys) - 6} more config keys")
    return "; ".join(out)


def split_cpu(count: int) -> None:
    """Splits this host's CPU into `count` devices, if JAX has not started its backends yet.

    Raises:
      ConfigError: more devices than the machine's cores can carry (`max_cpu_devices`).
    """
    if not count:
        return
    most = max_cpu_devices()
    if count > most:
        raise ConfigError(
            f"mesh.cpu_devices asks for {count} devices in this process, but this machine has "
            f"{os.cpu_count()} CPU cores: at most {most} (MAX_CPU_DEVICES_PER_CORE="
            f"{MAX_CPU_DEVICES_PER_CORE} per core, 256 at least; each device adds threads and "
            "memory, and XLA crashes in the tens of thousands). Lower mesh.cpu_devices"
        )
    from jax._src import xla_bridge  # no public way to ask whether backends are up

    if not xla_bridge.backends_are_initialized():
        cpu_pool.size_pool(count)  # (before the backend starts: XLA reads it once)
        jax.config.update("jax_num_cpu_devices", count)
    elif jax.default_backend() == "cpu" and jax.local_device_count() != count:
        log.warning(
            "mesh.cpu_devices: %d devices per process ignored: JAX already started with %d",
            count,
            jax.local_device_count(),
        )


def max_cpu_devices() -> int:
    """The most devices `mesh.cpu_devices` may split one process's CPU into here."""
    return max(256, MAX_CPU_DEVICES_PER_CORE * (os.cpu_count() or 1))


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "")
    if raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"${name}={raw!r} must be an integer") from None


def _detect_cluster(env: Mapping[str, str]) -> tuple[str, int, int] | None:
    """(name, processes, this process) for a multi-task SLURM step or Open MPI job.

    The same variables JAX's cluster detection reads (jax/_src/clusters): under srun every task
    is a process and gets GPU number SLURM_LOCALID; under mpirun the same with Open MPI's ranks.
    """
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(k in env for k in slurm):
        n = int(env["SLURM_NTASKS"])
        if n > 1:
            return "SLURM", n, int(env["SLURM_PROCID"])
    if "OMPI_MCA_orte_hnp_uri" in env:
        n = int(env.get("OMPI_COMM_WORLD_SIZE", "1"))
        if n > 1:
            return "Open MPI", n, int(env.get("OMPI_COMM_WORLD_RANK", "0"))
    return None


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested dicts -> {'a.b.c': value}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
