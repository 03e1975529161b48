"""Cost of the training metrics (``log_dir``) next to training without them, in one run.

    python benchmarks/metrics_overhead.py [--ranks 2] [--batch 32] [--steps 100] [--rounds 5]

Launches itself under the venv's mpiexec. Every rank builds one trainer per configuration on
the digits MLP 64-128-10 (a step of well under a millisecond, so that a per-step cost shows),
then times ``--steps`` steps of each configuration in turn, for ``--rounds`` rounds (load
changes hit every configuration alike); a block's time is the slowest rank's. Every
configuration fetches the loss (``fetch_stats=True``), so the difference is the metrics alone:

* ``no log``: no ``log_dir``;
* ``log_every=k``: ``log_dir`` set, the step statistics reduced over the ranks every ``k``
  steps (one allreduce of ``k x 6`` float64) and written by rank 0 (CSV rows, TensorBoard
  events when tensorboard is installed).

Printed: a markdown table with steps/s (median over rounds) and the ratio to ``no log``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EVERY = (1, 10, 100)


def worker(args: argparse.Namespace) -> None:
    from mpi4py import MPI
    from tqdm import tqdm

    import ngdist
    from ngdist import zoo
    from ngdist.data import load_digits

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    x, y, _, _ = load_digits(test_fraction=0.0)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(x), (args.steps, args.batch * size))  # same on every rank
    mine = slice(rank * args.batch, (rank + 1) * args.batch)
    batches = [{"x": x[i][mine], "y": y[i][mine]} for i in idx]
    configs: dict[str, dict] = {"no log": {}}
    for k in EVERY:
        configs[f"log_every={k}"] = {"log_dir": str(Path(args.dir) / f"every{k}"),
                                     "log_every": k}
    trainers = {name: ngdist.compile(zoo.mlp((64, 128, 10), seed=0), timeout=600,
                                     optimizer=ngdist.optim.SGD(lr=0.01, momentum=0.9), **opts)
                for name, opts in configs.items()}
    for tr in trainers.values():  # warm-up: sessions, buffers, files
        for b in batches[:3]:
            tr.step(b)
    times: dict[str, list[float]] = {name: [] for name in trainers}
    todo = [(r, name) for r in range(args.rounds) for name in trainers]
    for _, name in tqdm(todo, disable=rank != 0, desc=f"metrics on {size} ranks"):
        tr = trainers[name]
        world.Barrier()
        t0 = time.perf_counter()
        for b in batches:
            tr.step(b)
        times[name].append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    for tr in trainers.values():
        tr.close()
    if rank == 0:
        Path(args.out).write_text(json.dumps(
            {name: args.steps / statistics.median(t) for name, t in times.items()}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--steps", type=int, default=100, help="timed steps per block")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    from ngdist.comm.launch import mpiexec_cmd

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.json")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        cmd = [*mpiexec_cmd(args.ranks), sys.executable, __file__, "--worker", "--out", out,
               "--dir", tmp, "--batch", str(args.batch), "--steps", str(args.steps),
               "--rounds", str(args.rounds)]
        subprocess.run(cmd, check=True, env=env, timeout=3600)
        results = json.loads(Path(out).read_text())
    base = results["no log"]
    print(f"\n**digits MLP 64-128-10**, {args.ranks} ranks, batch {args.batch}/rank, median of "
          f"{args.rounds} rounds of {args.steps} steps\n")
    print("| configuration | steps/s | vs no log |")
    print("|---|---:|---:|")
    for name, rate in results.items():
        print(f"| {name} | {rate:.1f} | {rate / base:.2f} |")


if __name__ == "__main__":
    main()
