"""Bus bandwidth of each ``all_reduce_alg`` next to raw mpi4py ``Allreduce``, in one run.

    python benchmarks/allreduce_algs.py [--ranks 2 4] [--max-mb 64] [--out results.json]

Run plainly, it launches itself under the venv's mpiexec once per rank count and prints one
markdown table per rank count. Inside MPI, for every float32 buffer from 4 KiB to 64 MiB
(factors of 4) it times, on the same buffer contents:

* ``mpi4py``: ``COMM_WORLD.Allreduce(buf, out, SUM)``, the MPI library's own algorithm, no
  ngdist code at all (the baseline);
* ``ngdist:<alg>``: the ``ngdist.AllReduce`` kernel on an input it may not reduce in place
  (so it copies it first; a training step hands it its bucket to reduce in place), every
  wait bounded by the watchdog, with ``algorithm`` = ``mpi``, ``ring``,
  ``recursive_doubling``, ``hierarchical``. benchmarks/step_comm_cost.py measures the
  AllReduce inside a training step.

Each cell is the median over repetitions of the slowest rank's time, turned into bus
bandwidth as nccl-tests define it, ``busbw = 2 (p - 1) / p * bytes / time``, so that the
numbers of different rank counts compare. The result of every method is checked against
mpi4py's before it is timed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["mpi4py", "ngdist:mpi", "ngdist:ring", "ngdist:recursive_doubling",
           "ngdist:hierarchical"]


def sizes(max_mb: int) -> list[int]:
    out, n = [], 4 << 10
    while n <= max_mb << 20:
        out.append(n)
        n *= 4
    return out


def worker(max_mb: int, budget: float) -> None:
    from mpi4py import MPI
    from tqdm import tqdm

    from ngdist.comm import world_group
    from ngdist.kernels import CommNode, get_kernel

    world = MPI.COMM_WORLD
    rank, p = world.Get_rank(), world.Get_size()
    comm = world_group(timeout=600)
    kernel = get_kernel("AllReduce")
    rows = []
    todo = [(n, m) for n in sizes(max_mb) for m in METHODS]
    bar = tqdm(todo, disable=rank != 0, desc=f"allreduce algorithms on {p} ranks", unit="cell")
    for nbytes, method in bar:
        data = np.random.default_rng(rank).standard_normal(nbytes // 4).astype(np.float32)
        if method == "mpi4py":
            out = np.empty_like(data)

            def run() -> np.ndarray:
                world.Allreduce(data, out, op=MPI.SUM)
                return out
        else:
            node = CommNode("AllReduce", f"bench/{method}",
                            {"algorithm": method.split(":")[1], "reduction": "sum"})

            def run() -> np.ndarray:
                return kernel(comm, node, [data])[0]
        check = data.copy()
        world.Allreduce(MPI.IN_PLACE, check, op=MPI.SUM)
        got = run()
        err = float(np.max(np.abs(got - check)) / np.max(np.abs(check)))
        assert err < 1e-5, (method, nbytes, err)
        # repetitions: enough for ~budget seconds per cell, the same count on every rank
        t0 = time.perf_counter()
        run()
        once = _max(world, time.perf_counter() - t0)
        reps = int(min(200, max(3, budget / max(once, 1e-9))))
        times = []
        for _ in range(reps):
            world.Barrier()
            t0 = time.perf_counter()
            run()
            times.append(_max(world, time.perf_counter() - t0))
        t = statistics.median(times)
        rows.append({"ranks": p, "bytes": nbytes, "method": method, "time_s": t, "reps": reps,
                     "busbw_GBps": 2 * (p - 1) / p * nbytes / t / 1e9})
    bar.close()
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def _max(world, value: float) -> float:
    from mpi4py import MPI

    buf = np.array([value])
    world.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return float(buf[0])


def table(rows: list[dict]) -> str:
    p = rows[0]["ranks"]
    lines = [f"**{p} ranks**, bus bandwidth in GB/s (time per allreduce in parentheses)", "",
             "| size | " + " | ".join(METHODS) + " |",
             "|---:|" + "---:|" * len(METHODS)]
    for nbytes in sorted({r["bytes"] for r in rows}):
        cells = {r["method"]: r for r in rows if r["bytes"] == nbytes}
        label = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
        lines.append(f"| {label} | " + " | ".join(
            f"{cells[m]['busbw_GBps']:.2f} ({_t(cells[m]['time_s'])})" for m in METHODS) + " |")
    return "\n".join(lines)


def _t(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.1f} ms"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--max-mb", type=int, default=64)
    ap.add_argument("--budget", type=float, default=0.4, help="seconds of timing per cell")
    ap.add_argument("--out", help="also write the rows as JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.max_mb, args.budget)
        return 0
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    all_rows = []
    for p in args.ranks:
        proc = subprocess.run([str(mpiexec), "-n", str(p), sys.executable, __file__, "--worker",
                               "--max-mb", str(args.max_mb), "--budget", str(args.budget)],
                              stdout=subprocess.PIPE, text=True, env=env)
        if proc.returncode != 0:
            print(proc.stdout)
            return proc.returncode
        rows = json.loads(next(line for line in proc.stdout.splitlines()
                               if line.startswith("RESULT "))[len("RESULT "):])
        all_rows += rows
        print(table(rows) + "\n", flush=True)
    print(f"machine: {os.cpu_count()} CPU core(s); ranks share them (oversubscribed when more "
          "ranks than cores)")
    if args.out:
        Path(args.out).write_text(json.dumps(all_rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
