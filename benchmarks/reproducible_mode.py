"""Cost of reproducible mode next to ordinary allreduce, side by side in one run.

    python benchmarks/reproducible_mode.py [--ranks 2] [--batch 32] [--steps 50] [--rounds 5]

Launches itself under the venv's mpiexec. Every rank builds one trainer per configuration on
the digits MLP (SGD with momentum, default threads), then times ``--steps`` steps of each
configuration in turn, for ``--rounds`` rounds (so that load changes hit every configuration
alike); a block's time is the slowest rank's. Configurations:

* ``allreduce``: the ordinary path (``all_reduce_alg="mpi"``);
* ``exact sum``: ``all_reduce_alg="exact"`` on each rank's gradient (no micro-batches): the
  cost of the exact reduction alone (exponent MAX allreduce + int64 fixed-point allreduce);
* ``reproducible M=m``: ``reproducible_micro_batch=m``, i.e. ``batch / m`` forward/backward
  passes per rank and step, plus the exact reduction.

Printed: a markdown table per model with steps/s (median over rounds), the ratio to
``allreduce`` and the bytes each rank hands to MPI per step.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

import rank_workers  # benchmarks/rank_workers.py, beside this file

MODELS = {"digits MLP 64-128-10": (64, 128, 10), "MLP 64-1024-1024-10": (64, 1024, 1024, 10)}


def configs(batch: int) -> dict[str, dict]:
    out: dict[str, dict] = {"allreduce": {}, "exact sum": {"all_reduce_alg": "exact"}}
    for m in sorted({batch, 8, 2}, reverse=True):
        if m <= batch and batch % m == 0:
            out[f"reproducible M={m}"] = {"reproducible_micro_batch": m}
    return out


def worker(args: argparse.Namespace) -> dict:
    from mpi4py import MPI

    import ngdist
    from ngdist import zoo
    from ngdist.data import load_digits

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    x, y, _, _ = load_digits(test_fraction=0.0)
    rng = np.random.default_rng(0)
    g = args.batch * size
    idx = rng.integers(0, len(x), (args.steps, g))  # the same global batches on every rank
    mine = slice(rank * args.batch, (rank + 1) * args.batch)
    batches = [{"x": x[i][mine], "y": y[i][mine]} for i in idx]
    results = {}
    for model_name, sizes in MODELS.items():
        trainers = {name: ngdist.compile(zoo.mlp(sizes, seed=0), timeout=600,
                                         optimizer=ngdist.optim.SGD(lr=0.01, momentum=0.9),
                                         **opts)
                    for name, opts in configs(args.batch).items()}
        times, sent = rank_workers.time_rounds(trainers, batches, args.rounds,
                                               f"{model_name} on {size} ranks")
        for tr in trainers.values():
            tr.close()
        results[model_name] = {name: {"steps_per_s": args.steps / statistics.median(t),
                                      "bytes_per_step": sent[name]}
                               for name, t in times.items()}
    return results


def main() -> None:
    results, args = rank_workers.main(__doc__, worker, __file__)
    if results is None:  # a worker
        return
    for model_name, rows in results.items():
        base = rows["allreduce"]["steps_per_s"]
        print(f"\n**{model_name}**, {args.ranks} ranks, batch {args.batch}/rank, "
              f"median of {args.rounds} rounds of {args.steps} steps\n")
        print("| configuration | steps/s | vs allreduce | bytes sent/step/rank |")
        print("|---|---:|---:|---:|")
        for name, r in rows.items():
            print(f"| {name} | {r['steps_per_s']:.1f} | {r['steps_per_s'] / base:.2f} | "
                  f"{r['bytes_per_step']:,.0f} |")


if __name__ == "__main__":
    main()
