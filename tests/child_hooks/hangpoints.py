"""Hang a training step on purpose, for the watchdog tests (not part of the product).

`JAXMLLM_TEST_HANG` holds {"step": N}: the program's N-th train step gets a host callback that
blocks forever on its non-finite flag, so the device's work of that step never completes and
the loop, which waits on that flag a step later, hangs there as on a collective that never
completes. The callback prints `hangpoints: step N blocks` first, so a test knows the hang has
begun.

{"at": "start-up"}: building the step program blocks instead, forever, after printing
`hangpoints: start-up blocks`: a signal sent then finds the trainer in its start-up (where a
large model compiles for minutes), whatever the machine's speed.
"""

from __future__ import annotations

import json
import os
import sys
import threading


def install_from_env() -> None:
    spec = json.loads(os.environ["JAXMLLM_TEST_HANG"])
    import jax
    from jax.experimental import io_callback

    from jaxmllm.step.stages import program

    if spec.get("at") == "start-up":

        def build_blocked(cfg, mesh):
            print("hangpoints: start-up blocks", file=sys.stderr, flush=True)
            threading.Event().wait()  # (a signal's handler runs, and may raise, in the wait)

        program.build_program = build_blocked
        return

    def block(x):
        print(f"hangpoints: step {spec['step']} blocks", file=sys.stderr, flush=True)
        threading.Event().wait()
        return x

    hang = jax.jit(lambda x: io_callback(block, jax.ShapeDtypeStruct(x.shape, x.dtype), x))
    build = program.build_program

    def build_program(cfg, mesh):
        prog = build(cfg, mesh)
        step, calls = prog.step, [0]

        def stepped(state, batch):
            state, metrics = step(state, batch)
            calls[0] += 1
            if calls[0] == spec["step"]:
                metrics = {**metrics, "nonfinite": hang(metrics["nonfinite"])}
            return state, metrics

        prog.step = stepped
        return prog

    program.build_program = build_program
