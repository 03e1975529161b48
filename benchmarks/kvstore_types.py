"""ngdist.kvstore types side by side: time of one push + pull round over all keys.

    python benchmarks/kvstore_types.py            # 2 ranks (relaunches itself under mpiexec)
    python benchmarks/kvstore_types.py -n 4

Keys: the parameters of an MLP 64-1024-1024-10 (6 tensors, 1.13 M float32, 4.5 MB), pushed as
gradients and pulled back every round, SGD momentum 0.9 as the store's optimizer (server-side on
the owner for dist_sync, on every replica for dist_allreduce, on the numerator for pushsum).
Every type runs in the same mpiexec job, one after the other; the table (rank 0) gives the
median ms per round over ``--rounds`` rounds after 3 warm-up rounds, and the ratio to
dist_allreduce.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np


def bench(kind: str, rounds: int, shapes: list[tuple[int, ...]]) -> float:
    import ngdist
    from ngdist import kvstore

    kv = kvstore.create(kind, timeout=120)
    rng = np.random.default_rng(0)
    keys = list(range(len(shapes)))
    kv.init(keys, [rng.normal(size=s).astype(np.float32) for s in shapes])
    kv.set_optimizer(ngdist.optim.SGD(lr=0.01, momentum=0.9))
    grads = [rng.normal(size=s).astype(np.float32) for s in shapes]
    outs = [np.empty(s, np.float32) for s in shapes]
    times = []
    for r in range(rounds + 3):
        kv.barrier()
        t0 = time.perf_counter()
        kv.push(keys, grads)
        kv.pull(keys, out=outs)
        if r >= 3:
            times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("-n", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    if "PMI_RANK" not in os.environ:
        from ngdist.comm.launch import mpiexec_cmd

        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return subprocess.call([*mpiexec_cmd(args.n), sys.executable, __file__, "-n",
                                str(args.n), "--rounds", str(args.rounds)], env=env)
    sizes = (64, 1024, 1024, 10)
    shapes = [s for a, b in zip(sizes[:-1], sizes[1:]) for s in ((b, a), (b,))]
    results = {kind: bench(kind, args.rounds, shapes)
               for kind in ("dist_allreduce", "dist_sync", "pushsum", "local")}
    if int(os.environ["PMI_RANK"]) == 0:
        mb = sum(int(np.prod(s)) for s in shapes) * 4 / 1e6
        print(f"{args.n} ranks, {len(shapes)} keys, {mb:.1f} MB per push, median of "
              f"{args.rounds} rounds")
        print(f"{'type':16} {'ms/round':>9} {'vs dist_allreduce':>18}")
        for kind, ms in results.items():
            print(f"{kind:16} {ms:9.2f} {ms / results['dist_allreduce']:18.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
