"""A config resolved once into a `Run`: what the trainer, evaluation, the benches, the tools and
the tests take, so that no entry point repeats the sequence of start-up resolution.

    run = resolve_run(cfg)               # over every device: the mesh, the source, the sizes
    run = resolve_run(cfg, 64)           # planned for 64 data-parallel buckets, no mesh (benches)
    run = resolve_run(cfg, 8, data=(source, index))   # a source opened once, for several runs
    run = resolve_run(cfg, resume=out)   # a resumed run keeps its checkpoints' sizes

In the order of the start-up, each check once and named: the backend (`check_backend`), the
attention kernel for the devices (`resolve_attention`, `check_attention`), the calibrated cost
model (`calibrated_cost`: a bad train.cost_file stops here, not in the data thread), the source
and its lengths index (`make_source`: the index checked against the config and the files, the
oversize policy applied with the bucket spec's limits on a sample), a resumed run's sizes
(`keep_resolved`), the batch's sizes from the data (`resolve_batch`: dry runs of the planner,
which refuses a sample no bucket holds; `mesh.context_steps: auto` chosen before them,
`jaxmllm.resolve.degree`), this process's data-parallel positions
(`host_positions`). Then the bucket spec and the planner's capacities derived from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

import sharding
from jaxmllm.config import Config, ConfigError
from jaxmllm.config.spec import BatchSpec
from jaxmllm.cost.model import CostModel, calibrated_cost
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.data.source import make_source
from jaxmllm.plan.contract import Capacities, Planner
from jaxmllm.plan.registry import make_planner
from jaxmllm.resolve.attention import check_attention, resolve_attention
from jaxmllm.resolve.degree import resolve_sizes
from jaxmllm.resolve.resumed import keep_resolved


@dataclass(frozen=True)
class Run:
    """A config resolved for the devices and the data.

    Holds the config with every `auto` settled (`model.attention`, the batch's sizes), the
    mesh (None for a run planned for a number of buckets only), the source (`source[i]` -> a
    Sample) and its lengths index, the bucket spec and the planner's capacities over the data-
    parallel buckets, the FLOP cost model and the calibrated one (train.cost_file, or None),
    and this process's data-parallel positions in a multi-process job (None with one process).

    Holds no model, program or parameters (`jaxmllm.step` builds them from `cfg` and `mesh`),
    no checkpoint manager and no iterator: each use opens its own feed on the run (training,
    evaluation, a bench), and JAX's distributed start is the command's, before this.
    """

    cfg: Config
    mesh: Any
    source: Any
    index: LengthsIndex
    spec: BatchSpec
    caps: Capacities
    cost: CostModel
    calibrated: CostModel | None
    positions: np.ndarray | None = None
    # preference.reference: precomputed: every pair's reference log-prob sums [samples, 2] of
    # the training set ("train") and the eval set ("eval"), set before the feeds open
    # (`jaxmllm.loop.reference_pass`)
    reference_logps: dict[str, np.ndarray] | None = None

    @property
    def devices(self) -> int:
        """The data-parallel buckets a step is planned for."""
        return self.caps.devices

    def planner(self, index: LengthsIndex | None = None) -> Planner:
        """The planner `batch.planner` names, at the run's capacities, over the run's index (or
        another, e.g. the eval set's), from `data.seed`'s first step."""
        index = self.index if index is None else index
        return make_planner(self.cfg.batch.planner, index, self.caps, self.cfg.data.seed)


def resolve_run(
    cfg: Config,
    devices: Sequence[jax.Device] | int | None = None,
    *,
    resume: str | Path | None = None,
    data: tuple[Any, LengthsIndex] | None = None,
) -> Run:
    """The run of `cfg` (see the module's docstring).

    Args:
      cfg: The config as loaded.
      devices: The devices to build the mesh over (default: every device); or a number of
        data-parallel buckets to plan for without a mesh (a bench or a test planning steps
        that run elsewhere: `auto` is resolved for this machine's devices, and the checks of
        what the devices run, `check_backend` and `check_attention`, are left to the run).
      resume: The output folder of a run this one resumes: it keeps the sizes its checkpoints
        were planned with.
      data: (source, lengths index) as `make_source(cfg)` opened them, to share one opening
        between runs of the same data (a bench's rows); default: opened here.

    Raises:
      ConfigError: (or another UserError) a check that failed, naming the key or file.
    """
    mesh = None
    if isinstance(devices, int):  # (planned here, run elsewhere: no device checks)
        buckets, present = devices, jax.devices()
    else:
        mesh = sharding.make_mesh(cfg.mesh, devices)
        buckets, present = sharding.data_parallel_size(mesh), list(mesh.devices.flat)
        check_backend(cfg, present)
    cfg = resolve_attention(cfg, present)  # auto: the kernel for these devices (logged)
    if mesh is not None:
        check_attention(cfg, present)  # a kernel these devices cannot run stops the run here
    calibrated = calibrated_cost(cfg)
    source, index = make_source(cfg) if data is None else data  # (the data decides `auto`)
    asked = cfg.mesh
    if resume is not None:
        cfg = keep_resolved(cfg, Path(resume))  # (a resumed run: as it was planned)
    cfg = resolve_sizes(cfg, index, buckets)  # (mesh.context_steps: auto chosen first)
    if mesh is not None and cfg.mesh != asked:  # (auto chose no groups, or resumed so: the
        # same devices without a context axis, the same data-parallel positions)
        mesh = sharding.make_mesh(cfg.mesh, present)
        assert sharding.data_parallel_size(mesh) == buckets
    spec = BatchSpec.of(cfg)
    multi = mesh is not None and jax.process_count() > 1
    return Run(
        cfg=cfg,
        mesh=mesh,
        source=source,
        index=index,
        spec=spec,
        caps=Capacities.of(spec, buckets),
        cost=CostModel.from_model(cfg.model),
        calibrated=calibrated,
        positions=host_positions(mesh) if multi else None,
    )


def check_backend(cfg: Config, devices: Sequence[jax.Device]) -> None:
    """Refuses what the devices' backend does not implement, naming the key."""
    if cfg.batch.exchange == "ragged" and devices[0].platform == "cpu":
        raise ConfigError(
            "batch.exchange=ragged: XLA:CPU does not implement ragged_all_to_all; use "
            "batch.exchange: dense on CPU (ragged is for GPU backends)"
        )


def host_positions(mesh) -> np.ndarray:
    """This process's data-parallel positions; they must be one contiguous run (the mesh
    lays devices out process by process), which is what make_global_batch assembles, and hold
    whole context groups."""
    positions = sharding.local_dp_indices(mesh)
    if len(positions) == 0 or (positions != positions[0] + range(len(positions))).any():
        raise sharding.ShardingError(
            f"process {jax.process_index()} holds data-parallel positions {positions.tolist()}, "
            "not one contiguous run; use a mesh whose fsdp x tensor fits within a host"
        )
    context = sharding.context_size(mesh)
    if positions[0] % context or len(positions) % context:  # (a group's rows: one host's)
        raise sharding.ShardingError(
            f"process {jax.process_index()} holds part of a context group of {context} "
            "devices; mesh.context must divide the devices of a process"
        )
    return positions
