"""Stochastic Gradient Push vs AllReduce: throughput with a straggler, and accuracy.

``--mode speed`` (default): 4 ranks train the same MLP with ``allreduce``, ``pushsum`` and
``pushsum`` with overlap, side by side in one mpiexec run. At every step one rank, drawn at
random (the same draw on every rank), sleeps ``delay`` ms before its step: a straggler. For each
delay (default 0, 10, 50 ms) the table gives steps/s (steps over the slowest rank's wall time,
overlap rounds still in flight completed inside the timing) and the ratio to allreduce.

``--netns``: the same, but every rank is its own "host": a network namespace joined to the
others by veth + bridge with a ``tbf`` limit of ``--rate`` per direction, MPICH over TCP
(``UCX_TLS=tcp``); the bytes counted on the veths are printed to show the traffic went there.
Needs root; without it the mode prints why and exits 0.

``--mode accuracy``: digits MLP on 4 ranks, ``allreduce`` vs ``pushsum`` (and ``pushsum`` with
overlap) for the same number of epochs and seeds; test accuracy of rank 0's de-biased model (what
``trainer.save`` writes) and the mean over ranks, and the mean over seeds.

    python benchmarks/sgp_vs_allreduce.py [--delays 0,10,50] [--steps 60] [--hidden 256]
    python benchmarks/sgp_vs_allreduce.py --netns [--rate 100mbit]
    python benchmarks/sgp_vs_allreduce.py --mode accuracy [--seeds 0,1,2] [--epochs 10]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import ranks  # noqa: E402
VARIANTS = {  # name -> compile options
    "allreduce": {"strategy": "allreduce"},
    "pushsum": {"strategy": "pushsum"},
    "pushsum+overlap": {"strategy": "pushsum", "overlap": True},
    "pushsum+overlap/sf2": {"strategy": "pushsum", "overlap": True, "synch_freq": 2},
}


# --------------------------------------------------------------------------- rank side

def worker_speed(args: argparse.Namespace) -> None:
    import ngdist
    from ngdist import zoo
    from ngdist.data import load_digits

    x, y, _, _ = load_digits()
    rows = []
    for delay in args.delays:
        row = {"delay_ms": delay}
        for name in args.variants:
            tr = ngdist.compile(zoo.mlp((64, args.hidden, args.hidden, 10), seed=0),
                                optimizer=ngdist.optim.SGD(lr=0.01, momentum=0.9),
                                intra_op_threads=1, timeout=300, **VARIANTS[name])
            rank, n = tr.rank, tr.size
            bx, by = x[rank * args.batch:(rank + 1) * args.batch], y[rank * args.batch:
                                                                    (rank + 1) * args.batch]
            for _ in range(args.warmup):
                tr.step({"x": bx, "y": by})
            tr.flush()
            tr.group.barrier().wait()
            sent0 = tr.group.bytes_sent
            rng = np.random.default_rng(1234 + delay)  # the same straggler on every rank
            t0 = time.perf_counter()
            for _ in range(args.steps):
                if rng.integers(n) == rank and delay:
                    time.sleep(delay / 1000)
                tr.step({"x": bx, "y": by})
            tr.flush()
            elapsed = ranks.slowest(time.perf_counter() - t0)
            row[name] = args.steps / elapsed
            row[f"{name}:MB"] = (tr.group.bytes_sent - sent0) / 1e6
            tr.close()
        rows.append(row)
    if ngdist.rank() == 0:
        Path(args.out).write_text(json.dumps(rows))


def worker_accuracy(args: argparse.Namespace) -> None:
    import ngdist
    from mpi4py import MPI
    from ngdist import zoo
    from ngdist.data import load_digits

    xtr, ytr, xte, yte = load_digits()
    results = []
    for seed in args.seeds:
        for name in args.variants:
            tr = ngdist.compile(zoo.mlp((64, args.hidden, 10), seed=seed), timeout=300,
                                optimizer=ngdist.optim.SGD(lr=args.lr, momentum=0.9),
                                **VARIANTS[name])
            gb = args.batch * tr.size
            for epoch in range(args.epochs):
                perm = np.random.default_rng(seed * 1000 + epoch).permutation(len(xtr))
                for i in range(0, len(xtr) - gb + 1, gb):
                    (bx, by), = tr.shard([(xtr[perm[i:i + gb]], ytr[perm[i:i + gb]])])
                    tr.step({"x": bx, "y": by})
            tr.flush()
            acc = float((tr.predict({"x": xte})[0].argmax(1) == yte).mean())
            accs = np.empty(tr.size)
            MPI.COMM_WORLD.Allgather(np.array([acc]), accs)
            results.append({"seed": seed, "variant": name, "rank0": float(accs[0]),
                            "mean": float(accs.mean()), "min": float(accs.min())})
            tr.close()
    if ngdist.rank() == 0:
        Path(args.out).write_text(json.dumps(results))


# --------------------------------------------------------------------------- driver

def launch(args: argparse.Namespace, extra_mpiexec: list[str] | None = None,
           env: dict[str, str] | None = None) -> list[dict]:
    return ranks.launch(__file__, args, extra_mpiexec, env)


def print_speed(rows: list[dict], variants: list[str], title: str) -> None:
    print(f"\n{title}")
    print("| straggler delay | " + " | ".join(f"{v} steps/s" for v in variants) + " | " +
          " | ".join(f"{v} / allreduce" for v in variants if v != "allreduce") + " |")
    print("|" + "---|" * (len(variants) * 2))
    for r in rows:
        base = r.get("allreduce")
        cells = [f"{r[v]:.1f}" for v in variants]
        ratios = [f"{r[v] / base:.2f}x" if base else "-" for v in variants if v != "allreduce"]
        print(f"| {r['delay_ms']} ms | " + " | ".join(cells + ratios) + " |")
    mb = {v: rows[0][f"{v}:MB"] for v in variants}
    print("MB sent per rank over the timed steps (rank 0): " +
          ", ".join(f"{v} {m:.1f}" for v, m in mb.items()))


def print_accuracy(results: list[dict], variants: list[str]) -> None:
    print("\n| seed | " + " | ".join(f"{v} (rank 0 / mean of ranks)" for v in variants) + " |")
    print("|---|" + "---|" * len(variants))
    for seed in sorted({r["seed"] for r in results}):
        cells = []
        for v in variants:
            (r,) = [r for r in results if r["seed"] == seed and r["variant"] == v]
            cells.append(f"{100 * r['rank0']:.2f} / {100 * r['mean']:.2f}")
        print(f"| {seed} | " + " | ".join(cells) + " |")
    means = {v: 100 * np.mean([r["rank0"] for r in results if r["variant"] == v])
             for v in variants}
    print("| mean | " + " | ".join(f"{means[v]:.2f}" for v in variants) + " |")
    if "allreduce" in means:
        for v in variants:
            if v != "allreduce":
                d = means[v] - means["allreduce"]
                print(f"{v} - allreduce: {d:+.2f} points (rank 0's model, mean of seeds); "
                      f"within 1.2 points: {'yes' if abs(d) <= 1.2 else 'NO'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["speed", "accuracy"], default="speed")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--delays", type=lambda s: [int(v) for v in s.split(",")], default=[0, 10, 50])
    p.add_argument("--variants", type=lambda s: s.split(","), default=None,
                   help=f"comma-separated, from {list(VARIANTS)}")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--hidden", type=int, default=None,
                   help="hidden width (speed: 2 layers, default 256; accuracy: 1, default 256)")
    p.add_argument("--batch", type=int, default=None, help="per rank (speed 32, accuracy 16)")
    p.add_argument("--seeds", type=lambda s: [int(v) for v in s.split(",")], default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--netns", action="store_true", help="ranks in separate network namespaces")
    p.add_argument("--rate", default="1gbit", help="tbf limit per veth direction (netns mode)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.hidden = args.hidden or 256
    args.batch = args.batch or (32 if args.mode == "speed" else 16)
    args.variants = args.variants or (list(VARIANTS) if args.mode == "speed"
                                      else ["allreduce", "pushsum", "pushsum+overlap"])
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if args.worker:
        (worker_speed if args.mode == "speed" else worker_accuracy)(args)
        return 0
    load = os.getloadavg()[0]
    print(f"{args.ranks} ranks on {os.cpu_count()} CPU cores (load average {load:.1f} at start)")
    if args.mode == "accuracy":
        print(f"digits MLP 64-{args.hidden}-10, SGD lr {args.lr} momentum 0.9, batch "
              f"{args.batch}/rank, {args.epochs} epochs, seeds {args.seeds}")
        print_accuracy(launch(args), args.variants)
        return 0
    print(f"MLP 64-{args.hidden}-{args.hidden}-10, batch {args.batch}/rank, {args.steps} timed "
          f"steps, one straggler per step (random rank, same draw on every rank)")
    if not args.netns:
        print_speed(launch(args), args.variants, "shared memory (one host)")
        return 0
    launched = ranks.launch_in_namespaces(__file__, args)
    if launched is None:
        return 0
    rows, moved = launched
    print_speed(rows, args.variants, f"network namespaces, veth + bridge, tbf {args.rate} per "
                f"direction, MPICH ch4:ucx over TCP")
    sent = sum(r[f"{v}:MB"] for r in rows for v in args.variants) * args.ranks
    print(f"bytes through the veths: {moved / 1e6:.1f} MB (ngdist payload, timed steps only, "
          f"estimated from rank 0 x {args.ranks}: {sent:.1f} MB)")
    return 0 if ranks.veths_carried(moved, int(sent * 1e6)) else 1


if __name__ == "__main__":
    sys.exit(main())
