"""Steps/s of ngdist (allreduce) next to PyTorch DDP (gloo) on the same MLP, data and settings.

MLP 64-1024-1024-10, batch 128 per rank, SGD with momentum 0.9, one intra-op thread per rank,
scikit-learn's digits (bundled). Both systems are launched with the same mpiexec, on 1 and 2
ranks, in one run; the table gives steps/s and the ratio ngdist / DDP.

    python benchmarks/mlp_allreduce.py [--steps 100] [--warmup 10] [--ranks 1 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SIZES = (64, 1024, 1024, 10)
BATCH = 128


def batches(rank: int, size: int, steps: int):
    from ngdist.data import load_digits

    x, y, _, _ = load_digits(test_fraction=0.0)
    rng = np.random.default_rng(0)
    g = BATCH * size
    for _ in range(steps):
        idx = rng.integers(0, len(x), g)  # the same global batch on every rank
        sl = slice(rank * BATCH, (rank + 1) * BATCH)
        yield x[idx][sl], y[idx][sl]


def run_ngdist(steps: int, warmup: int) -> dict:
    import ngdist
    from ngdist import zoo

    tr = ngdist.compile(zoo.mlp(SIZES, seed=0), optimizer=ngdist.optim.SGD(lr=0.01, momentum=0.9),
                        intra_op_threads=1)
    times, comm, wait = [], 0.0, 0.0
    for i, (x, y) in enumerate(batches(tr.rank, tr.size, steps + warmup)):
        s = tr.step({"x": x, "y": y})
        if i >= warmup:
            times.append(s.step_time)
            comm += s.comm_time
            wait += s.wait_time
    tr.close()
    return {"rank": tr.rank, "size": tr.size, "time": sum(times), "steps": len(times),
            "comm": comm, "wait": wait}


def run_ddp(steps: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    rank, size = int(os.environ.get("PMI_RANK", 0)), int(os.environ.get("PMI_SIZE", 1))
    dist.init_process_group("gloo", rank=rank, world_size=size,
                            init_method=f"tcp://127.0.0.1:{os.environ['NGDIST_BENCH_PORT']}")
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(nn.ReLU())
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    times = []
    for i, (x, y) in enumerate(batches(rank, size, steps + warmup)):
        t0 = time.perf_counter()
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(xt), yt)
        loss.backward()
        opt.step()
        loss.detach().item()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return {"rank": rank, "size": size, "time": sum(times), "steps": len(times)}


def worker(args: argparse.Namespace) -> None:
    result = run_ngdist(args.steps, args.warmup) if args.system == "ngdist" else \
        run_ddp(args.steps, args.warmup)
    Path(args.out).joinpath(f"{args.system}_{result['size']}_{result['rank']}.json").write_text(
        json.dumps(result))


def launch(system: str, n: int, args: argparse.Namespace, out: str, port: int) -> dict:
    from ngdist.comm.launch import mpiexec_cmd

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "NGDIST_BENCH_PORT": str(port)}
    cmd = [*mpiexec_cmd(n), sys.executable, __file__, "--worker", system, "--out", out,
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    subprocess.run(cmd, check=True, env=env, timeout=900)
    results = [json.loads(Path(out, f"{system}_{n}_{r}.json").read_text()) for r in range(n)]
    slowest = max(r["time"] for r in results)
    return {"steps_per_s": results[0]["steps"] / slowest,
            "comm_ms": 1e3 * results[0].get("comm", 0) / results[0]["steps"],
            "wait_ms": 1e3 * results[0].get("wait", 0) / results[0]["steps"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3, help="alternating runs; the best is kept")
    p.add_argument("--worker", choices=["ngdist", "ddp"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.system = args.worker
        worker(args)
        return
    rows = []
    with tempfile.TemporaryDirectory() as out:
        port = 29500 + os.getpid() % 1000
        for n in args.ranks:
            best = {"ngdist": None, "ddp": None}
            for rep in range(args.repeats):
                for system in ("ngdist", "ddp"):
                    r = launch(system, n, args, out, port + rep * 2 + (system == "ddp"))
                    if best[system] is None or r["steps_per_s"] > best[system]["steps_per_s"]:
                        best[system] = r
            rows.append((n, best["ngdist"], best["ddp"]))
    print(f"MLP {'-'.join(map(str, SIZES))}, batch {BATCH}/rank, SGD momentum, 1 thread/rank, "
          f"{args.steps} timed steps, best of {args.repeats}")
    print("| ranks | ngdist steps/s | DDP (gloo) steps/s | ngdist / DDP | ngdist comm ms/step | "
          "ngdist wait ms/step |")
    print("|---|---|---|---|---|---|")
    for n, a, b in rows:
        print(f"| {n} | {a['steps_per_s']:.1f} | {b['steps_per_s']:.1f} | "
              f"{a['steps_per_s'] / b['steps_per_s']:.2f} | {a['comm_ms']:.2f} | {a['wait_ms']:.2f} |")


if __name__ == "__main__":
    main()
