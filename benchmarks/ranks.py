"""What the multi-rank benchmarks share: launching this benchmark's own script on N ranks
under mpiexec (optionally through network namespaces, benchmarks/netns.py) and taking a time
over the ranks."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def slowest(value: float) -> float:
    """The largest ``value`` over the ranks (called on every rank)."""
    from mpi4py import MPI

    buf = np.array([value]), np.empty(1)
    MPI.COMM_WORLD.Allreduce(buf[0], buf[1], op=MPI.MAX)
    return float(buf[1][0])


def mlp_arguments(p: argparse.ArgumentParser) -> None:
    """The options of a benchmark that times an MLP 64-H-H-10 on ``--ranks`` ranks."""
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32, help="samples per rank")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)


def timed_steps(trainer: Any, feed: dict[str, Any], warmup: int, steps: int
                ) -> tuple[float, int]:
    """``warmup`` steps, a barrier, then ``steps`` timed steps on ``feed`` (called on every
    rank): (steps/s over the slowest rank's wall time, bytes this rank sent)."""
    for _ in range(warmup):
        trainer.step(feed)
    trainer.group.barrier().wait()
    sent = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        sent += trainer.step(feed).bytes_sent
    return steps / slowest(time.perf_counter() - t0), sent


def launch(script: str, args: argparse.Namespace, extra_mpiexec: list[str] | None = None,
           env: dict[str, str] | None = None) -> Any:
    """Run ``script --worker --out FILE`` plus this command's own arguments (``--netns``
    left out) on ``args.ranks`` ranks; what rank 0 wrote to FILE, as JSON."""
    from ngdist.comm.launch import mpiexec_cmd

    out = Path(f"/tmp/ngdist-{Path(script).stem}-{os.getpid()}.json")
    forward = [a for a in sys.argv[1:] if a != "--netns"]
    cmd = [*mpiexec_cmd(args.ranks), *(extra_mpiexec or []), sys.executable,
           str(Path(script).resolve()), "--worker", "--out", str(out), *forward]
    full_env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                "OMP_NUM_THREADS": "1", **(env or {})}
    subprocess.run(cmd, check=True, env=full_env)
    try:
        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)


def launch_in_namespaces(script: str, args: argparse.Namespace) -> tuple[Any, int] | None:
    """:func:`launch` with every rank its own "host": a network namespace with a ``tbf`` link
    of ``args.rate`` (benchmarks/netns.py), MPICH over TCP. Returns (rank 0's result, bytes
    counted on the veths), or None after printing why namespaces cannot be made here."""
    import netns

    why = netns.available()
    if why:
        print(f"netns mode skipped: {why}")
        return None
    with netns.namespaces(args.ranks, args.rate) as mpiexec_args:
        before = netns.veth_bytes(args.ranks)
        result = launch(script, args, mpiexec_args, {"UCX_TLS": "tcp",
                                                     "MPICH_CH4_NETMOD": "ucx"})
        return result, netns.veth_bytes(args.ranks) - before


def veths_carried(moved: int, payload: int) -> bool:
    """Whether the veths counted at least 90% of the ``payload`` bytes; warns otherwise."""
    if moved >= 0.9 * payload:
        return True
    print("WARNING: less traffic on the veths than the payload: the ranks did not (only) "
          "talk TCP through the namespaces")
    return False
