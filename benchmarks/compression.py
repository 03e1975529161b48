"""Gradient compression: steps/s with and without ``compression`` in one run, side by side.

The ranks train the same MLP (64-H-H-10, default H = 1024: 1.2 M parameters, 4.7 MB of float32
gradients) with, in turn: ``none`` (float32 over MPI's Allreduce), ``ring`` (float32 over
ngdist's ring: the same algorithm the 16-bit sums use, so its ratio isolates the wire format),
``fp16``, ``bf16`` and ``fp16+ef`` (error feedback). The table gives steps/s over the slowest
rank's wall time, the ratio to ``none`` and to ``ring``, and the MB each rank sent
(StepStats.bytes_sent). Variants alternate ``--repeats`` times; the best run of each counts.

``--netns``: the same, but every rank is its own "host": a network namespace joined to the
others by veth + bridge with a ``tbf`` limit of ``--rate`` per direction, MPICH over TCP
(``UCX_TLS=tcp``; benchmarks/netns.py); the bytes counted on the veths are printed to show the
traffic went there. Needs root; without it the mode prints why and exits 0.

    python benchmarks/compression.py [--ranks 2] [--hidden 1024] [--steps 50] [--repeats 3]
    python benchmarks/compression.py --netns [--rate 100mbit]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import ranks  # noqa: E402
VARIANTS = {  # name -> compile options
    "none": {},
    "ring": {"all_reduce_alg": "ring"},
    "fp16": {"compression": "fp16"},
    "bf16": {"compression": "bf16"},
    "fp16+ef": {"compression": "fp16", "compression_error_feedback": True},
}


def worker(args: argparse.Namespace) -> None:
    import ngdist
    from ngdist import zoo
    from ngdist.data import load_digits

    x, y, _, _ = load_digits()
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name in args.variants:
            tr = ngdist.compile(zoo.mlp((64, args.hidden, args.hidden, 10), seed=0),
                                optimizer=ngdist.optim.SGD(lr=0.01, momentum=0.9),
                                strategy="allreduce", intra_op_threads=1, timeout=300,
                                **VARIANTS[name])
            rank = tr.rank
            feed = {"x": x[rank * args.batch:(rank + 1) * args.batch],
                    "y": y[rank * args.batch:(rank + 1) * args.batch]}
            steps_s, sent = ranks.timed_steps(tr, feed, args.warmup, args.steps)
            tr.close()
            run = {"steps_s": steps_s, "MB": sent / 1e6}
            if name not in best or run["steps_s"] > best[name]["steps_s"]:
                best[name] = run
    if ngdist.rank() == 0:
        Path(args.out).write_text(json.dumps(best))


def show(best: dict[str, dict], title: str) -> None:
    print(f"\n{title}")
    print("| variant | steps/s | / none | / ring | MB sent per rank |")
    print("|---|---|---|---|---|")
    for name, run in best.items():
        ratios = [f"{run['steps_s'] / best[b]['steps_s']:.2f}x" if b in best else "-"
                  for b in ("none", "ring")]
        print(f"| {name} | {run['steps_s']:.1f} | {' | '.join(ratios)} | {run['MB']:.1f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ranks.mlp_arguments(p)
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS),
                   help=f"comma-separated, from {list(VARIANTS)}")
    p.add_argument("--netns", action="store_true", help="ranks in separate network namespaces")
    p.add_argument("--rate", default="100mbit", help="tbf limit per veth direction (netns)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if args.worker:
        worker(args)
        return 0
    print(f"{args.ranks} ranks on {os.cpu_count()} CPU cores (load average "
          f"{os.getloadavg()[0]:.1f} at start); MLP 64-{args.hidden}-{args.hidden}-10, batch "
          f"{args.batch}/rank, {args.steps} timed steps, best of {args.repeats}")
    if not args.netns:
        show(ranks.launch(__file__, args), "shared memory (one host)")
        return 0
    launched = ranks.launch_in_namespaces(__file__, args)
    if launched is None:
        return 0
    best, moved = launched
    show(best, f"network namespaces, veth + bridge, tbf {args.rate} per direction, MPICH "
         "over TCP")
    timed = sum(r["MB"] for r in best.values()) * args.ranks
    print(f"bytes through the veths: {moved / 1e6:.1f} MB (all runs, warm-up and set-up "
          f"included; the best runs' timed steps alone: {timed:.1f} MB)")
    return 0 if ranks.veths_carried(moved, int(timed * 1e6)) else 1


if __name__ == "__main__":
    sys.exit(main())
