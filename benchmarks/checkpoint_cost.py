"""Cost of Trainer checkpoints next to training without them, side by side in one run.

    python benchmarks/checkpoint_cost.py [--ranks 2] [--batch 32] [--steps 50] [--rounds 5]

Launches itself under the venv's mpiexec. Every rank builds one trainer per configuration on
each model (SGD with momentum, allreduce), each with a checkpoint folder of its own in a
temporary directory, then times ``--steps`` steps of each configuration in turn, for
``--rounds`` rounds (so that load changes hit every configuration alike); a block's time is
the slowest rank's. Configurations: ``none`` (no checkpoint folder), ``every 50``,
``every 10``, ``every 1`` (``checkpoint_every=N``: rank 0 writes the .npz and the manifest,
both fsynced, while the others wait on a barrier).

Printed: a markdown table per model with steps/s (median over rounds), the ratio to ``none``,
the time per checkpoint (the extra time of a block over ``none``, per checkpoint written) and
the size of one checkpoint file; then the time a trainer takes to resume from the newest
checkpoint (constructor with the folder next to one without, median of 3).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

import rank_workers  # benchmarks/rank_workers.py, beside this file

MODELS = {"digits MLP 64-128-10": (64, 128, 10), "MLP 64-1024-1024-10": (64, 1024, 1024, 10)}
EVERY = {"none": None, "every 50": 50, "every 10": 10, "every 1": 1}


def worker(args: argparse.Namespace) -> dict:
    from mpi4py import MPI

    import ngdist
    from ngdist import zoo
    from ngdist.data import load_digits

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    x, y, _, _ = load_digits()
    rng = np.random.default_rng(0)
    idx = [rng.choice(len(x), args.batch * size, replace=False) for _ in range(args.steps)]
    mine = slice(rank * args.batch, (rank + 1) * args.batch)
    batches = [{"x": x[i][mine], "y": y[i][mine]} for i in idx]
    results = {}
    for model_name, sizes in MODELS.items():
        def build(folder: str | None, every: int | None):
            return ngdist.compile(zoo.mlp(sizes, seed=0), timeout=600,
                                  optimizer=ngdist.optim.SGD(lr=0.01, momentum=0.9),
                                  checkpoint_dir=folder, checkpoint_every=every)

        folders = {name: str(Path(args.out).parent / f"{model_name}-{name}".replace(" ", "_"))
                   for name in EVERY}
        trainers = {name: build(folders[name] if every else None, every)
                    for name, every in EVERY.items()}
        times, _ = rank_workers.time_rounds(trainers, batches, args.rounds,
                                            f"{model_name} on {size} ranks")
        for tr in trainers.values():
            tr.close()
        base = statistics.median(times["none"])
        row = {}
        for name, every in EVERY.items():
            t = statistics.median(times[name])
            per_block = args.steps // every if every else 0
            files = sorted(Path(folders[name]).glob("step-*.npz")) if every and rank == 0 else []
            row[name] = {"steps_per_s": args.steps / t, "ratio": base / t,
                         "ms_per_checkpoint": (t - base) / per_block * 1e3 if per_block else None,
                         "bytes": files[-1].stat().st_size if files else None}
        resume, fresh = [], []
        for _ in range(3):
            for folder, out in ((folders["every 1"], resume), (None, fresh)):
                world.Barrier()
                t0 = time.perf_counter()
                build(folder, None).close()
                out.append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        row["resume_ms"] = (statistics.median(resume) - statistics.median(fresh)) * 1e3
        results[model_name] = row
    return results


def main() -> None:
    results, args = rank_workers.main(__doc__, worker, __file__)
    if results is None:  # a worker
        return
    print(f"checkpoint cost on {args.ranks} ranks, batch {args.batch} per rank, "
          f"{args.steps} steps per block, median of {args.rounds} rounds\n")
    for model_name, row in results.items():
        print(f"### {model_name}\n")
        print("| checkpoints | steps/s | vs none | ms per checkpoint | file bytes |")
        print("|---|---|---|---|---|")
        for name in EVERY:
            r = row[name]
            ms = f"{r['ms_per_checkpoint']:.2f}" if r["ms_per_checkpoint"] is not None else "-"
            size = f"{r['bytes']:,}" if r["bytes"] else "-"
            print(f"| {name} | {r['steps_per_s']:.1f} | {r['ratio']:.2f}x | {ms} | {size} |")
        print(f"\nresuming (trainer start-up with the folder, less without): "
              f"{row['resume_ms']:.1f} ms\n")


if __name__ == "__main__":
    main()
