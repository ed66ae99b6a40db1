"""XLA:CPU's thread pool, sized so a process's devices' collectives can never starve it.

A process split into several CPU devices (`mesh.cpu_devices`, the tests' 8 forced devices) runs
every device's share of a step on one XLA:CPU thread pool. Three facts of jaxlib 0.10.2 make
that pool a deadlock waiting to happen when it is as small as XLA makes it:

- XLA:CPU's in-process collectives block the thread that runs them until every participant
  has arrived (`InProcessCommunicator`: a rendezvous, then a barrier).
- Its thunk executor orders one device's collectives by *scheduling* edges only
  (`ExecutionGraph::NodeEdge::KindOf(kCollectiveCommunicator)`; XLA's comment: "the
  execution of operations can overlap and finish in any order"): a loop whose body went
  asynchronous releases the collectives after it, so collectives with no data between them
  are in flight on one device at the same time, each on its own thread of the pool.
- The pool holds max(cores, devices) threads (`GetPjRtCpuClient`): 8 for 8 devices on a
  2-core machine.

So one device with two collectives in flight leaves another device without a thread for the
collective everyone waits for. Seen in test_hf_train's recipes (gdb on three hung runs,
2026-11-25): all 8 threads blocked in rendezvous, 6 in the routed all-to-all inside an
asynchronous loop, one in an all-gather released beside it, one in an all-gather of a loop's
first iteration; 0% CPU until XLA's terminate timeout aborted the process. 3 runs in 8 hung
beside a CPU burner with that pool, none in 8 with this one.

`size_pool` sets `PJRT_NPROC` (which XLA reads once, when JAX starts its CPU backend) to
POOL_THREADS before that happens, when a process is split into more than one device and the
user has not set it. A deadlock needs every thread blocked in a rendezvous at once; 256
threads (XLA's cap on its intra-op pool, `kMaxIntraOpThreads`) leave room for 32 collectives
in flight per device over 8 devices, against the one-a-device-plus-one that stopped the step.
Idle threads cost nothing measurable: test_hf_train's stage-1 recipe, 6 steps over 8 devices,
18.3 s wall with the default pool and 18.7 s with 256 threads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

log = logging.getLogger("jaxmllm")

POOL_THREADS = 256  # XLA:CPU caps its intra-op pool here (cpu_client.cc, kMaxIntraOpThreads)
VARIABLE = "PJRT_NPROC"  # read by XLA's DefaultThreadPoolSize() when the CPU client starts


def size_pool(devices: int, env: MutableMapping[str, str] = os.environ) -> bool:
    """Sets PJRT_NPROC to POOL_THREADS for a process about to start `devices` (> 1) CPU
    devices, unless the user set it (then left as set; a warning when it is smaller). Call it
    before JAX starts its backends. Returns whether it set the variable."""
    if devices <= 1:
        return False
    given = env.get(VARIABLE, "")
    if given:
        if given.isdigit() and int(given) < POOL_THREADS:
            log.warning(
                "%s=%s: XLA:CPU's pool for %d devices has %s threads; fewer than %d can "
                "deadlock a step whose collectives overlap (see jaxmllm.process.cpu_pool)",
                VARIABLE,
                given,
                devices,
                max(int(given), devices),
                POOL_THREADS,
            )
        return False
    env[VARIABLE] = str(POOL_THREADS)
    return True
