"""A scale simulator for the balance bench (`python -m jaxmllm.bench.balance --simulate`).

A step's predicted time is the sum over its microbatches of, phase by phase in the order the
step runs them (vision encoder, audio encoder, the exchange of their output rows, the LLM), the
slowest device's time for that phase:

    compute  max over devices of the phase's FLOPs (`jaxmllm.cost.model.CostModel`, every item
             the device computes) / a device's sustained FLOP/s
    exchange per encoder phase that routes, max over devices of
             bytes within the host / intra-host bandwidth + bytes across hosts / inter-host
             bandwidth, the larger of what it sends and what it receives, plus the latency

The ragged exchange moves only the real rows of the plan; the dense one moves its whole padded
buffer, `route_pair_capacity` rows to every other device, whatever the plan routes. A row is the
LLM width in bf16 (2 bytes a value). Nothing overlaps: compute and exchange add up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxmllm.plan.contract import Capacities, StepPlan, item_rows

ENC = ("vision", "audio")


@dataclass(frozen=True)
class Machine:
    """What a device computes and moves per second (defaults: an H100 node, bf16)."""

    flops: float = 400e12  # sustained FLOP/s of one device
    intra_bw: float = 450e9  # bytes/s one device moves to others of its host (NVLink)
    inter_bw: float = 50e9  # bytes/s one device moves to other hosts (one NIC a GPU)
    latency: float = 10e-6  # seconds an exchange takes whatever it moves
    row_bytes: int = 2048  # bytes of one encoder output row (LLM width x 2)


def compute_time(cost_md: dict[str, np.ndarray], machine: Machine) -> np.ndarray:
    """Per microbatch, the seconds its phases compute: the sum over phases of the slowest
    device's FLOPs ([M, D] per phase) / FLOP/s."""
    return sum(c.max(1) for c in cost_md.values()) / machine.flops


def link_time(intra: np.ndarray, inter: np.ndarray, machine: Machine) -> np.ndarray:
    """Seconds a device needs to move `intra` bytes within its host and `inter` across hosts
    (any shape: elementwise), latency not included."""
    return intra / machine.intra_bw + inter / machine.inter_bw


def exchange_time(traffic: dict[str, np.ndarray], machine: Machine) -> np.ndarray:
    """Per microbatch, the seconds of the exchanges: per phase, from its [4, M, D] rows (sent
    within the host, sent across, received within, received across), the slowest device's
    larger of sending and receiving, plus the latency; phases with no array do not exchange."""
    total = 0.0
    for t in traffic.values():
        b = t * float(machine.row_bytes)
        slowest = np.maximum(link_time(b[0], b[1], machine), link_time(b[2], b[3], machine))
        total = total + slowest.max(1) + machine.latency
    return np.asarray(total, np.float64)


def dense_traffic(caps: Capacities, phases: list[str]) -> dict[str, np.ndarray]:
    """The dense exchange's rows per device ([4, M, D] per routed phase): its whole buffer,
    `route_pair_capacity` rows to and from every other device, within and across hosts."""
    d_n, c = caps.devices, caps.route_pair_capacity
    per_host = min(caps.devices_per_host or d_n, d_n)
    intra, inter = (per_host - 1) * c, (d_n - per_host) * c
    one = np.array([intra, inter, intra, inter], np.float64)[:, None, None]
    return {p: np.broadcast_to(one, (4, caps.microbatches, d_n)) for p in phases}


def plan_traffic(plan: StepPlan, index, caps: Capacities) -> dict[str, np.ndarray]:
    """The real encoder output rows a plan routes, per encoder phase with items: [4, M, D]
    (sent within the host, sent across hosts, received within, received across)."""
    m_n, d_n = caps.microbatches, caps.devices
    per_host = caps.devices_per_host or d_n
    out = {}
    for p in ENC:
        it = plan.items[p]
        if not len(it.owner):
            continue
        rows = item_rows(plan, index, caps, p).astype(np.float64)
        src, dst, m = it.device, plan.device[it.owner], plan.micro[it.owner]
        remote = src != dst
        across = remote & (src // per_host != dst // per_host)
        t = np.zeros((4, m_n * d_n))
        for k, (who, mask) in enumerate(
            ((src, remote & ~across), (src, across), (dst, remote & ~across), (dst, across))
        ):
            t[k] = np.bincount(m[mask] * d_n + who[mask], rows[mask], m_n * d_n)
        out[p] = t.reshape(4, m_n, d_n)
    return out


def step_times(
    cost_md: dict[str, np.ndarray],
    traffic: dict[str, np.ndarray],
    dense: dict[str, np.ndarray],
    machine: Machine,
) -> dict[str, float]:
    """One step's predicted seconds: compute, the ragged and the dense exchange, and the step
    with each (compute + that exchange), summed over microbatches."""
    compute = float(compute_time(cost_md, machine).sum())
    ragged = float(exchange_time(traffic, machine).sum()) if traffic else 0.0
    padded = float(exchange_time(dense, machine).sum()) if dense else 0.0
    return {
        "compute": compute,
        "exchange_ragged": ragged,
        "exchange_dense": padded,
        "step_ragged": compute + ragged,
        "step_dense": compute + padded,
    }


def plan_times(plan: StepPlan, index, caps: Capacities, cost_md: dict, machine: Machine) -> dict:
    """A plan's predicted step (`step_times`, seconds) from its FLOPs per phase and device
    ([M, D] each) and the rows it routes (none when the route capacity is 0)."""
    traffic = plan_traffic(plan, index, caps) if caps.route_pair_capacity else {}
    dense = dense_traffic(caps, list(traffic)) if traffic else {}
    return step_times(cost_md, traffic, dense, machine)
