"""The launch of the benchmarks that run themselves on N ranks: the shared command line
(``--ranks``, ``--batch``, ``--steps``, ``--rounds``) and the relaunch under the venv's mpiexec
with ``--worker --out FILE``; rank 0 writes its results to FILE as JSON (a fresh temporary
folder, which a worker may also use for its own files)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def parser(doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--steps", type=int, default=50, help="timed steps per block")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def run_workers(script: str, args: argparse.Namespace) -> Any:
    """``script --worker`` on ``args.ranks`` ranks; the results rank 0 wrote."""
    from ngdist.comm.launch import mpiexec_cmd

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.json")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        cmd = [*mpiexec_cmd(args.ranks), sys.executable, script, "--worker", "--out", out,
               "--batch", str(args.batch), "--steps", str(args.steps),
               "--rounds", str(args.rounds)]
        subprocess.run(cmd, check=True, env=env, timeout=3600)
        return json.loads(Path(out).read_text())


def time_rounds(trainers: dict[str, Any], batches: list[dict], rounds: int, desc: str
                ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Inside the workers: 3 warm-up steps per trainer (sessions, buffers), then every batch
    on each trainer in turn, ``rounds`` times (so that load changes hit every trainer alike).
    Per trainer: the slowest rank's time of each block, and the bytes sent per step."""
    from mpi4py import MPI
    from tqdm import tqdm

    world = MPI.COMM_WORLD
    for tr in trainers.values():
        for b in batches[:3]:
            tr.step(b, fetch_stats=False)
    times: dict[str, list[float]] = {name: [] for name in trainers}
    sent: dict[str, float] = {}
    todo = [(r, name) for r in range(rounds) for name in trainers]
    for _, name in tqdm(todo, disable=world.Get_rank() != 0, desc=desc):
        tr = trainers[name]
        world.Barrier()
        sent0, t0 = tr.group.bytes_sent, time.perf_counter()
        for b in batches:
            tr.step(b, fetch_stats=False)
        times[name].append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        sent[name] = (tr.group.bytes_sent - sent0) / len(batches)
    return times, sent


def main(doc: str | None, worker: Callable[[argparse.Namespace], Any], script: str
         ) -> tuple[Any, argparse.Namespace]:
    """The benchmark's entry: as a worker, run ``worker(args)`` and write rank 0's return
    value to ``--out`` (then the results are None); else relaunch ``script`` on the ranks
    and return what rank 0 wrote. Also the parsed arguments."""
    args = parser(doc).parse_args()
    if not args.worker:
        return run_workers(script, args), args
    results = worker(args)
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    return None, args
