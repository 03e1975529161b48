"""The AllReduce inside a training step next to raw mpi4py ``Allreduce`` of the same bytes.

    python benchmarks/step_comm_cost.py [--ranks 2] [--sizes 4 16 64] [--rounds 5]
        [--overlap | --no-overlap] [--momentum 0.9]

Run plainly, it launches itself under the venv's mpiexec. For each size S (MiB of float32
gradients) it builds an MLP 64-h-10 whose parameters take S MiB, compiles it twice in the same
processes, with ``strategy="allreduce"`` (default buckets of 25 MiB) and with
``strategy="local"`` (the same step without communication), one intra-op thread per rank, and
times, alternating in rounds:

* ``allreduce``: one training step; ``local``: the same step with no communication;
* ``mpi4py``: ``COMM_WORLD.Allreduce(IN_PLACE, buf, SUM)`` of a float32 buffer of the same
  bytes as all the gradients, no ngdist code at all, call after call (a barrier between);
* ``local+mpi4py``: the ``local`` step and then that Allreduce, timed together: the compute of
  a step in one piece followed by one MPI call of all the gradient bytes, the least that any
  program which communicates after computing can spend (the Allreduce meets the caches a step
  leaves and ranks that arrive at slightly different times, as a step's Allreduce does).

The communication cost inside the step is ``allreduce - local``: in each round, the median of
its ``allreduce`` steps minus the median of its ``local`` steps (the slowest rank's time of
each step), then the median of those differences over the rounds. A machine whose speed drifts
from second to second (a shared virtual machine) moves the medians of rounds apart by more
than the cost itself; within a round the two run back to back, each on caches warmed by its
own steps as in training. The step columns show the best round's median of each, for scale;
``mpi4py`` is the best round's median too (the fastest the MPI library did it, the harder bar).
Each round also times ``steps`` pairs of an ``allreduce`` step and a ``local`` step right
after it, and ``paired`` is the median of those differences over all rounds (likewise
``local+mpi4py`` against ``local`` for the least program); alternating the two trainers step
by step, each meets caches the other's step has filled. The ratios printed:

* ``vs mpi4py`` = ``mpi4py / (allreduce - local)``, ``paired vs mpi4py`` = ``mpi4py /
  paired``: 1.0 means the step's communication costs what the MPI library's own Allreduce of
  those bytes costs call after call (above 1 when the step overlaps communication with compute
  on spare cores, or reduces through shared memory without MPI's copies);
* ``vs compute+mpi4py`` = ``(local+mpi4py - local) / (allreduce - local)`` and its paired
  form: 1.0 means the step costs no more than its uncut compute plus one Allreduce. The
  ``bound`` column gives ``mpi4py / (local+mpi4py - local)``, the first ratio of that least
  program itself.
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


def worker(sizes: list[int], rounds: int, steps: int, batch: int,
           overlap: bool | None, momentum: float) -> None:
    from allreduce_algs import _max  # the slowest rank's time (this script's folder)
    from mpi4py import MPI

    import ngdist
    from ngdist import zoo

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    rng = np.random.default_rng(rank)
    rows = []
    for mib in sizes:
        hidden = (mib << 20) // 4 // (64 + 1 + 10)
        model = zoo.mlp((64, hidden, 10), seed=0)
        trainers = {s: ngdist.compile(model, loss="softmax_cross_entropy", labels="y",
                                      optimizer=ngdist.optim.SGD(lr=1e-4, momentum=momentum),
                                      strategy=s, intra_op_threads=1, overlap=overlap)
                    for s in ("allreduce", "local")}
        nbytes = sum(v.nbytes for v in trainers["local"].parameters().values())
        buf = np.ones(nbytes // 4, np.float32)
        x = rng.standard_normal((batch, 64)).astype(np.float32)
        y = rng.integers(0, 10, batch).astype(np.int64)

        def step(name: str) -> None:
            trainers[name].step({"x": x, "y": y}, fetch_stats=False)

        def raw() -> None:
            world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

        def local_then_raw() -> None:
            step("local")
            raw()

        runs = {"allreduce": lambda: step("allreduce"), "local": lambda: step("local"),
                "mpi4py": raw, "local+mpi4py": local_then_raw}
        for fn in runs.values():  # warm-up: sessions, arenas, buffers
            fn(), fn()

        def timed(fn) -> float:  # the slowest rank's time of one call, ranks started together
            world.Barrier()
            t0 = time.perf_counter()
            fn()
            return _max(world, time.perf_counter() - t0)

        best: dict[str, float] = {}
        medians: dict[str, list[float]] = {name: [] for name in runs}
        pairs: dict[str, list[float]] = {"allreduce": [], "local+mpi4py": []}
        for _ in range(rounds):
            for name, fn in runs.items():
                times = [timed(fn) for _ in range(steps)]
                medians[name].append(statistics.median(times))
                best[name] = min(best.get(name, float("inf")), medians[name][-1])
            for _ in range(steps):  # each against a local step right after it
                for name in pairs:
                    pairs[name].append(timed(runs[name]) - timed(runs["local"]))

        def minus_local(name: str) -> float:  # the median over rounds of the round's difference
            return statistics.median(a - b for a, b in zip(medians[name], medians["local"]))

        cost = minus_local("allreduce")
        least = minus_local("local+mpi4py")
        paired = statistics.median(pairs["allreduce"])
        paired_least = statistics.median(pairs["local+mpi4py"])
        rows.append({"MiB": mib, "bytes": nbytes, **{f"{k}_ms": v * 1e3 for k, v in best.items()},
                     "comm_in_step_ms": cost * 1e3, "least_ms": least * 1e3,
                     "paired_ms": paired * 1e3, "paired_least_ms": paired_least * 1e3,
                     "ratio": best["mpi4py"] / cost, "ratio_least": least / cost,
                     "ratio_paired": best["mpi4py"] / paired,
                     "ratio_paired_least": paired_least / paired,
                     "bound": best["mpi4py"] / least})
        for t in trainers.values():
            t.close()
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64], help="MiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round")
    ap.add_argument("--batch", type=int, default=32, help="samples per rank")
    ap.add_argument("--overlap", action="store_true",
                    help="comm nodes on a thread of their own (default: the library's choice, "
                         "on only with more than one core per rank)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="run comm nodes in program order on the main thread")
    ap.add_argument("--momentum", type=float, default=0.0,
                    help="SGD momentum (default 0: plain SGD, whose reduced gradient is the "
                         "step's state and so stays on MPI's AllReduce; with momentum the "
                         "buckets of ranks on one host go through shared memory)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.overlap and args.no_overlap:
        ap.error("--overlap and --no-overlap exclude each other")
    overlap = True if args.overlap else False if args.no_overlap else None
    flag = {True: ["--overlap"], False: ["--no-overlap"], None: []}[overlap]
    if args.worker:
        worker(args.sizes, args.rounds, args.steps, args.batch, overlap, args.momentum)
        return 0
    from ngdist.comm.launch import mpiexec_cmd

    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    cmd = [*mpiexec_cmd(args.ranks), sys.executable, __file__, "--worker", "--rounds",
           str(args.rounds), "--steps", str(args.steps), "--batch", str(args.batch),
           "--sizes", *map(str, args.sizes), "--momentum", str(args.momentum), *flag]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        sys.stderr.write(proc.stdout + proc.stderr)
        return proc.returncode or 1
    rows = json.loads(line[7:])
    how = {True: "on", False: "off", None: "as the library chooses"}[overlap]
    print(f"{args.ranks} ranks, one intra-op thread each, batch {args.batch} per rank, "
          f"SGD momentum {args.momentum:g}, overlap {how}")
    print("| gradients | step allreduce | step local | comm in step | paired | mpi4py Allreduce "
          "| local+mpi4py - local | vs mpi4py | paired vs mpi4py | vs compute+mpi4py "
          "| paired vs compute+mpi4py | bound |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['MiB']} MiB | {r['allreduce_ms']:.2f} ms | {r['local_ms']:.2f} ms | "
              f"{r['comm_in_step_ms']:.2f} ms | {r['paired_ms']:.2f} ms | {r['mpi4py_ms']:.2f} ms "
              f"| {r['least_ms']:.2f} ms | {r['ratio']:.2f} | {r['ratio_paired']:.2f} "
              f"| {r['ratio_least']:.2f} | {r['ratio_paired_least']:.2f} | {r['bound']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
