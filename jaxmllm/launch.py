"""Start the processes of a multi-process training job on this machine and watch them.

    python -m jaxmllm.launch --processes 2 --config configs/tiny.yaml [--set k=v ...]

starts 2 processes of `python -m jaxmllm.train` with the same arguments, tells each who it is
(JAXMLLM_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID, see jaxmllm/process/distributed.py) and
prefixes their output with `[pN]`. On CPU the config's `mesh.cpu_devices` are shared out
between them (gloo collectives); with `--gpus`, process i sees GPU i only (CUDA_VISIBLE_DEVICES).

Several machines: run the same command on each with `--nodes`, `--node-rank` and the
`--coordinator` (node 0's address); see launch/multinode.sh. If a process dies, the launcher
says which, stops the others (they cannot continue without it) and exits non-zero; rerunning
the command resumes every process from the latest checkpoint. SIGTERM / Ctrl-C are passed on,
so the job checkpoints and stops cleanly.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxmllm.config.command import run

EXIT_PEER_FAILED = 5


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's own options (processes, nodes, rank, coordinator, --gpus, grace) and the
    arguments it passes on to `python -m jaxmllm.train` untouched."""
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--processes", type=int, default=2, help="processes on this machine")
    p.add_argument("--nodes", type=int, default=1, help="machines in the job")
    p.add_argument("--node-rank", type=int, default=0, help="this machine, 0 .. nodes-1")
    p.add_argument(
        "--coordinator",
        default="",
        help="host:port of node 0 (default: 127.0.0.1 and a free port, one machine only)",
    )
    p.add_argument("--gpus", action="store_true", help="one GPU per process (CUDA_VISIBLE_DEVICES)")
    p.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds the other processes get to exit after one fails, before they are killed",
    )
    args, train_args = p.parse_known_args(argv)
    if args.processes < 1 or args.nodes < 1 or not 0 <= args.node_rank < args.nodes:
        p.error("need --processes >= 1, --nodes >= 1 and 0 <= --node-rank < --nodes")
    if args.nodes > 1 and not args.coordinator:
        p.error("--nodes > 1 needs --coordinator host:port (node 0's address)")
    if "--config" not in train_args:
        p.error("pass the training arguments too, e.g. --config configs/tiny.yaml")
    return args, train_args


def free_port() -> int:
    """A TCP port free on this machine now, for the coordinator of a one-machine job (another
    program could take it before the coordinator binds it: rare, and the job then fails at
    start-up)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NOISE = b"Expected number of connected peer ranks"  # gloo's start-up chatter, every collective


def _pump(stream, prefix: str, out) -> None:
    """Copies a child's output to `out` line by line with its `prefix` ('[p1] '), leaving out
    gloo's start-up chatter (NOISE); returns when the child closes it."""
    for line in iter(stream.readline, b""):
        if NOISE in line:
            continue
        out.buffer.write(prefix.encode() + line)
        out.flush()
    stream.close()


def main(argv: list[str] | None = None) -> int:
    """Starts this machine's training processes with their rank and the coordinator, forwards
    SIGTERM and SIGINT to them (a second signal kills), and stops the others when one fails
    (their next collective would hang). Returns the job's exit code: the failed process's,
    EXIT_PEER_FAILED for a kill by a signal, 0 when all finished."""
    args, train_args = parse_args(argv)
    coordinator = args.coordinator or f"127.0.0.1:{free_port()}"
    total = args.processes * args.nodes
    procs: dict[int, subprocess.Popen] = {}
    pumps = []
    for local in range(args.processes):
        rank = args.node_rank * args.processes + local
        env = dict(
            os.environ,
            JAXMLLM_COORDINATOR=coordinator,
            JAXMLLM_NUM_PROCESSES=str(total),
            JAXMLLM_PROCESS_ID=str(rank),
            PYTHONUNBUFFERED="1",
        )
        if args.gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(local)
        cmd = [sys.executable, "-m", "jaxmllm.train", *train_args]
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        procs[rank] = proc
        t = threading.Thread(target=_pump, args=(proc.stdout, f"[p{rank}] ", sys.stdout))
        t.start()
        pumps.append(t)
    pids = ", ".join(f"p{rank} pid {proc.pid}" for rank, proc in procs.items())
    print(
        f"launch: {len(procs)} of {total} processes on this machine ({pids}), "
        f"coordinator {coordinator}",
        file=sys.stderr,
        flush=True,
    )

    stopping = []

    def forward(signum, frame):  # preemption: every process checkpoints and exits
        """Passes a preemption signal on: the first as SIGTERM (each process checkpoints and
        exits), any later one as SIGKILL."""
        stopping.append(signum)
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM if len(stopping) == 1 else signal.SIGKILL)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    failed: tuple[int, int] | None = None
    try:
        while any(p.poll() is None for p in procs.values()):
            for rank, proc in procs.items():
                code = proc.poll()
                if code not in (None, 0) and failed is None and not stopping:
                    failed = (rank, code)
                    _stop_others(procs, rank, code, args.grace)
            time.sleep(0.2)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for t in pumps:
            t.join(timeout=5)
    codes = {rank: proc.returncode for rank, proc in procs.items()}
    if failed is not None:
        rank, code = failed
        print(
            f"launch: process {rank} failed ({_describe(code)}); the job stopped. Exit codes: "
            f"{codes}. Rerun the same command to resume from the latest checkpoint.",
            file=sys.stderr,
        )
        return code if code > 0 else EXIT_PEER_FAILED
    bad = {r: c for r, c in codes.items() if c != 0}
    if bad:
        print(f"launch: processes exited with {bad}", file=sys.stderr)
        return next(iter(bad.values())) if next(iter(bad.values())) > 0 else EXIT_PEER_FAILED
    return 0


def _stop_others(procs: dict[int, subprocess.Popen], rank: int, code: int, grace: float) -> None:
    """Interrupts every process but `rank` (twice: stop at once) after it exited with `code`, and
    kills those still running after `grace` seconds."""
    print(
        f"launch: process {rank} exited ({_describe(code)}); stopping the other processes, "
        "which cannot go on without it",
        file=sys.stderr,
        flush=True,
    )
    others = [p for r, p in procs.items() if r != rank and p.poll() is None]
    for p in others:  # their next collective would hang: no point finishing the step
        p.send_signal(signal.SIGINT)
        p.send_signal(signal.SIGINT)  # a second interrupt stops at once
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in others):
        time.sleep(0.2)
    for p in others:
        if p.poll() is None:
            p.kill()
            p.wait()


def _describe(code: int) -> str:
    """A process's exit status in words: 'exit code 2', 'killed by SIGKILL'."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


if __name__ == "__main__":
    sys.exit(run(main))
