"""The balance bench's scale simulator (jaxmllm.bench.simulate): its arithmetic by hand."""

from __future__ import annotations

import numpy as np
import pytest

from jaxmllm.bench import simulate
from jaxmllm.plan.contract import Capacities, ItemPlan, StepPlan

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

MACHINE = simulate.Machine(flops=100.0, intra_bw=10.0, inter_bw=1.0, latency=0.5, row_bytes=2)


def caps(devices: int = 4, per_host: int = 2, pair: int = 3) -> Capacities:
    return Capacities(
        microbatches=1,
        devices=devices,
        llm_rows=1,
        llm_row_len=64,
        units={"vision": 64, "audio": 0},
        per_token={"vision": 4, "audio": 4},
        per_row={"vision": 1, "audio": 4},
        route_pair_capacity=pair,
        devices_per_host=per_host,
    )


def test_compute_is_the_slowest_device_per_phase_summed():
    cost = {"vision": np.array([[100.0, 300.0]]), "llm": np.array([[500.0, 200.0]])}
    assert simulate.compute_time(cost, MACHINE) == pytest.approx([(300 + 500) / 100])


def test_exchange_counts_links_bytes_and_latency():
    # [4, M=1, D=2]: sent within, sent across, received within, received across (rows)
    t = np.zeros((4, 1, 2))
    t[0, 0, 0], t[1, 0, 0] = 5, 1  # device 0 sends 10 bytes within, 2 across: 1 + 2 s
    t[3, 0, 1] = 3  # device 1 receives 6 bytes across: 6 s (the slowest)
    assert simulate.exchange_time({"vision": t}, MACHINE) == pytest.approx([6 + 0.5])
    # two phases exchange one after the other: latency twice
    both = simulate.exchange_time({"vision": t, "audio": np.zeros((4, 1, 2))}, MACHINE)
    assert both == pytest.approx([6 + 0.5 + 0.5])


def test_dense_exchange_moves_its_whole_buffer():
    # 4 devices, 2 a host, 3 rows a pair: 1 peer within (3 rows), 2 across (6 rows)
    t = simulate.dense_traffic(caps(), ["vision"])["vision"]
    assert t.shape == (4, 1, 4) and (t[:, 0, :].T == [3, 6, 3, 6]).all()
    want = 3 * 2 / 10 + 6 * 2 / 1 + 0.5
    assert simulate.exchange_time({"vision": t}, MACHINE) == pytest.approx([want])
    one_host = simulate.dense_traffic(caps(per_host=0), ["vision"])["vision"]
    assert (one_host[:, 0, 0] == [9, 0, 9, 0]).all()


def test_plan_traffic_splits_rows_within_and_across_hosts():
    from jaxmllm.bench.mixes import from_arrays

    # three samples with texts on devices 0, 0, 3; images of 8, 4, 12 patches (2, 1, 3 rows)
    index = from_arrays(
        np.array([5, 5, 5]),
        [np.array([8]), np.array([4]), np.array([12])],
        [np.zeros(0, np.int64)] * 3,
    )
    z = np.zeros(3, np.int64)
    plan = StepPlan(
        step=0,
        samples=np.arange(3),
        micro=z,
        device=np.array([0, 0, 3]),
        row=z,
        offset=z,
        items={"vision": ItemPlan(np.arange(3), z, np.array([1, 2, 3]), z)},
    )
    t = simulate.plan_traffic(plan, index, caps())["vision"][:, 0, :]
    # sample 0: 1 -> 0 within host 0 (2 rows); sample 1: 2 -> 0 across (1 row); 2: at home
    assert (t == [[0, 2, 0, 0], [0, 0, 1, 0], [2, 0, 0, 0], [1, 0, 0, 0]]).all()
    times = simulate.step_times(
        {"llm": np.array([[100.0, 0, 0, 0]])}, {"vision": t[:, None]}, {}, MACHINE
    )
    assert times["compute"] == pytest.approx(1.0)
    # device 0 receives 4 bytes within, 2 across: the slowest
    assert times["step_ragged"] == pytest.approx(1.0 + 4 / 10 + 2 / 1 + 0.5)
    assert times["exchange_dense"] == 0.0
