"""Sharded data parallelism: optimizer-state memory per rank and steps/s of ``shard=`` against
plain allreduce, in one run, side by side.

The ranks train the same MLP (64-H-H-10, default H = 1024: 1.2 M parameters) with AdamW (two
state tensors per parameter) under ``none`` (allreduce), ``optimizer`` (ZeRO-1) and
``gradients`` (ZeRO-2). The table gives each rank's optimizer-state bytes (the state tensors
the trainer holds, the step count left out), steps/s over the slowest rank's wall time and its
ratio to ``none``, and the MB each rank sent (StepStats.bytes_sent). Variants alternate
``--repeats`` times; the best run of each counts.

    python benchmarks/sharding.py [--ranks 2] [--hidden 1024] [--steps 50] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import ranks  # noqa: E402

VARIANTS = ("none", "optimizer", "gradients")


def worker(args: argparse.Namespace) -> None:
    import ngdist
    from ngdist import zoo
    from ngdist.data import load_digits

    x, y, _, _ = load_digits()
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name in VARIANTS:
            tr = ngdist.compile(zoo.mlp((64, args.hidden, args.hidden, 10), seed=0),
                                optimizer=ngdist.optim.AdamW(lr=1e-3, weight_decay=0.01),
                                strategy="allreduce", intra_op_threads=1, timeout=300,
                                shard=name)
            rank = tr.rank
            feed = {"x": x[rank * args.batch:(rank + 1) * args.batch],
                    "y": y[rank * args.batch:(rank + 1) * args.batch]}
            state = sum(tr.values[n].numpy().nbytes for n in tr.meta.names("state")
                        if n != "ngdist.step")
            steps_s, sent = ranks.timed_steps(tr, feed, args.warmup, args.steps)
            tr.close()
            run = {"steps_s": steps_s, "MB": sent / args.steps / 1e6,
                   "state_MB": state / 1e6}
            if name not in best or run["steps_s"] > best[name]["steps_s"]:
                best[name] = run
    if ngdist.rank() == 0:
        Path(args.out).write_text(json.dumps(best))


def show(best: dict[str, dict]) -> None:
    print("| shard | optimizer state per rank (MB) | / none | steps/s | / none | MB sent per "
          "rank and step |")
    print("|---|---|---|---|---|---|")
    base = best["none"]
    for name, run in best.items():
        print(f"| {name} | {run['state_MB']:.2f} | {run['state_MB'] / base['state_MB']:.2f}x | "
              f"{run['steps_s']:.1f} | {run['steps_s'] / base['steps_s']:.2f}x | "
              f"{run['MB']:.2f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ranks.mlp_arguments(p)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    print(f"{args.ranks} ranks on {os.cpu_count()} CPU cores (load average "
          f"{os.getloadavg()[0]:.1f} at start); MLP 64-{args.hidden}-{args.hidden}-10, AdamW, "
          f"batch {args.batch}/rank, {args.steps} timed steps, best of {args.repeats}")
    show(ranks.launch(__file__, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
