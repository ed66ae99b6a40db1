"""The device mesh: axes ("data", "stage", "expert", "fsdp", "context", "tensor"), data slowest
(spans hosts), tensor fastest; "stage" (pipeline stages, size 1 unless pipelining) sits between
data and the rest.

`expert` (expert parallelism: a mixture-of-experts decoder's experts split over its devices) is,
for batches, one more data-parallel axis (EP inside DP: its devices hold data-parallel buckets
of their own, and tokens travel to their experts' devices by all-to-all inside the step); for
the experts' weights it is a model axis (each device holds experts / expert of them), for every
other parameter like data (replicated; gradients reduce over it).

`context` splits one LLM row over a group of devices (each holds an equal share of its tokens
and gathers the keys and values of the group, every layer): for batches it is one more
data-parallel axis (every step array's device axis is split over data x fsdp x context), for
parameters it is like data (replicated; gradients reduce over it).

Across processes the devices are laid out host by host (the machine each is on, over every
process of the job: one process driving a node's 8 GPUs, or 8 one-GPU processes as under SLURM),
so the fast axes stay inside a host: with L devices a host and expert * fsdp * context * tensor
dividing L, every `tensor`, `context`, `fsdp` and `expert` group is one host's devices (NVLink /
shared memory), each host holds L / (expert * fsdp * context * tensor) whole `data` rows, and
only the data-parallel gradient reduction crosses the network. A layout where they do not
divide L still works but puts model-parallel (and the context groups' key/value) traffic on the
network; `make_mesh` warns (`spans_hosts`).
Pipeline stages may span hosts: what crosses a stage boundary is one microbatch's activations
per tick (point to point), far less than the gradient reduction.

The mesh config is anything with ``data``, ``stage``, ``expert``, ``fsdp``, ``context`` and
``tensor`` sizes, as attributes (e.g. ``jaxmllm.config.MeshConfig``) or as mapping keys (a
missing key: its default). One of them may be -1: the remaining devices.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

log = logging.getLogger("jaxmllm")

# mesh axis names, slowest to fastest
AXES = ("data", "stage", "expert", "fsdp", "context", "tensor")
DATA_AXES = ("data", "expert", "fsdp", "context")  # the axes a batch is split over
CONTEXT_AXIS = "context"  # the axis an LLM row is split over (a context group)
STAGE_AXIS = "stage"  # pipeline stages: a batch is replicated over it, stacked layers split
EXPERT_AXIS = "expert"  # experts split over it (a batch is split over it too: EP inside DP)
# as MeshConfig
DEFAULT_SIZES = {"data": -1, "stage": 1, "expert": 1, "fsdp": 1, "context": 1, "tensor": 1}


class ShardingError(ValueError):
    """A mesh, rule table or array layout that cannot work; the message says what to change."""


def make_mesh(mesh_cfg: Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the ("data", "stage", "expert", "fsdp", "context", "tensor") mesh over all (or the
    given) devices.

    Args:
      mesh_cfg: Axis sizes as attributes or keys ``data``, ``stage``, ``expert``, ``fsdp``,
        ``context``, ``tensor``; at most one -1.
      devices: Devices to use, all of them; default ``jax.devices()``.

    Returns:
      A mesh with Auto axis types, so plain ``jit``, ``NamedSharding`` and
      ``with_sharding_constraint`` work without explicit-sharding annotations.

    Raises:
      ShardingError: The sizes do not multiply to the device count, or two axes are -1.
    """
    devices = list(jax.devices() if devices is None else devices)
    on_cpu = all(d.platform == "cpu" for d in devices)
    shape = resolve_axis_sizes(mesh_cfg, len(devices), on_cpu=on_cpu)
    types = (AxisType.Auto,) * len(AXES)
    if len({d.process_index for d in devices}) == 1:
        return jax.make_mesh(shape, AXES, axis_types=types, devices=devices)
    # Several processes: host by host, process by process, so tensor, context, fsdp and expert
    # groups stay inside a host.
    devices.sort(key=lambda d: (host_of(d), d.process_index, d.id))
    problem = spans_hosts(devices, shape)
    if problem:
        log.warning("%s", problem)
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES, axis_types=types)


def host_of(device: jax.Device) -> int:
    """The machine a device is on: XLA numbers the hosts of a multi-process job by their boot
    id (`slice_index`: every process of one machine alike, e.g. the 8 one-GPU processes a
    SLURM node runs); where a backend gives none, each process counts as its own host."""
    index = getattr(device, "slice_index", None)
    return device.process_index if index is None else index


def spans_hosts(devices: Sequence[jax.Device], shape: Sequence[int]) -> str:
    """'' when every model-parallel group (expert x fsdp x context x tensor, the mesh's
    fastest axes) of `devices`, laid out host by host in this order, lies within one host;
    else what is wrong and what to change. Hosts and their devices are counted over every
    process of the job, not one process's devices (one process per GPU is the usual SLURM
    layout, and its groups still share a machine)."""
    inner = math.prod(shape[2:])  # expert x fsdp x context x tensor
    hosts = [host_of(d) for d in devices]
    split = sum(len(set(hosts[k : k + inner])) > 1 for k in range(0, len(hosts), inner))
    if not split:
        return ""
    per_host = sorted({hosts.count(h) for h in set(hosts)})
    return (
        f"mesh.expert x mesh.fsdp x mesh.context x mesh.tensor = {inner} devices a group, but "
        f"the job's {len(set(hosts))} hosts have {' or '.join(map(str, per_host))} devices "
        f"each: {split} of {len(hosts) // inner} model-parallel groups span hosts (slow: "
        "their gathers cross the network); make the group divide a host's devices"
    )


def resolve_axis_sizes(mesh_cfg: Any, n_devices: int, on_cpu: bool = False) -> tuple[int, ...]:
    """Returns (data, stage, expert, fsdp, context, tensor) with a -1 replaced by the remaining
    devices.

    Raises:
      ShardingError: Naming the ``mesh.*`` keys and the device count when sizes do not fit (and,
        `on_cpu`, ``mesh.cpu_devices``: a CPU host splits into as many devices as it is told).
    """
    sizes = _read_sizes(mesh_cfg)
    free = [axis for axis, size in sizes.items() if size == -1]
    if len(free) > 1:
        keys = " and ".join(f"mesh.{axis}" for axis in free)
        raise ShardingError(f"{keys} are both -1 ({_show(sizes)}); at most one axis may be -1")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if n_devices % fixed:
            raise ShardingError(
                f"{_show(sizes)}: the fixed axes ({fixed} devices) do not divide "
                f"the {n_devices} devices available; change {_keys(sizes)}"
                + _cpu_hint(fixed, on_cpu)
            )
        sizes[free[0]] = n_devices // fixed
    if math.prod(sizes.values()) != n_devices:
        raise ShardingError(
            f"{_show(sizes)} = {math.prod(sizes.values())} devices, but "
            f"{n_devices} devices are available; change {_keys(sizes)} "
            "(or set one of them to -1)" + _cpu_hint(math.prod(sizes.values()), on_cpu)
        )
    return tuple(sizes[axis] for axis in AXES)


def data_parallel_size(mesh: Mesh) -> int:
    """Number of data-parallel positions (a step array's device buckets):
    data * expert * fsdp * context."""
    return math.prod(mesh.shape[axis] for axis in DATA_AXES if axis in mesh.shape)


def expert_size(mesh: Mesh) -> int:
    """Devices the experts are split over (1: every device holds every expert)."""
    return mesh.shape[EXPERT_AXIS] if EXPERT_AXIS in mesh.shape else 1


def context_size(mesh: Mesh) -> int:
    """Devices a context group splits one LLM row over (1: no context parallelism)."""
    return mesh.shape[CONTEXT_AXIS] if CONTEXT_AXIS in mesh.shape else 1


def varying_axes(x: Any) -> frozenset[str]:
    """The manual mesh axes `x` varies over inside a shard_map that checks them (none outside
    one, or under check_vma=False). jax < 0.11 names them `manual_axis_type.varying`, later
    versions `vma`."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def varying_as(tree: Any, *inputs: Any) -> Any:
    """`tree`'s arrays made to vary over every manual axis any of `inputs` varies over.

    For values made from constants (a scan's initial carry) or returned by an inner shard_map
    that does not check them: inside a shard_map that does (a pipeline stage), scan and cond
    want the same types in and out, and a carry that its body adds varying values to varies.
    """
    axes = frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(inputs)))

    def one(x):
        """`x` cast to vary over the manual axes it is missing (a no-op when it varies over all)."""
        missing = tuple(sorted(axes - varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree) if axes else tree


def _read_sizes(mesh_cfg: Any) -> dict[str, int]:
    """Reads the six sizes from a mapping or an object, checking each is >= 1 or -1."""
    get = mesh_cfg.get if isinstance(mesh_cfg, Mapping) else lambda k, d: getattr(mesh_cfg, k, d)
    sizes = {axis: get(axis, DEFAULT_SIZES[axis]) for axis in AXES}
    for axis, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ShardingError(f"mesh.{axis}={size!r}: must be a positive integer or -1")
    return sizes


def _cpu_hint(devices: int, on_cpu: bool) -> str:
    """On CPU, the key that makes the devices the mesh asks for: a host's CPU is one device
    unless `mesh.cpu_devices` splits it."""
    if not on_cpu:
        return ""
    return f", or on this CPU set mesh.cpu_devices: {devices} (the devices it is split into)"


def _show(sizes: dict[str, int]) -> str:
    """Mesh sizes as the config keys that set them: 'mesh.data=2 x mesh.fsdp=4'."""
    return " x ".join(f"mesh.{axis}={size}" for axis, size in sizes.items())


def _keys(sizes: dict[str, int]) -> str:
    """The config keys of these mesh axes, comma-separated, for a message naming what to change."""
    return ", ".join(f"mesh.{axis}" for axis in sizes)
