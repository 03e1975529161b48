"""Sharded data parallelism: memory per rank, steps/s and bytes per step of ``shard=`` against
plain allreduce, in one run, side by side.

``--model mlp`` (default): the ranks train the MLP 64-H-H-10 (H = 1024: 1.2 M parameters)
with AdamW under ``none`` (allreduce), ``optimizer`` (ZeRO-1), ``gradients`` (ZeRO-2) and
``parameters`` (ZeRO-3), variants alternating ``--repeats`` times in the same processes (the
best run of each counts): optimizer-state bytes per rank, steps/s over the slowest rank's wall
time, MB sent (StepStats.bytes_sent).

``--model gpt2``: the transformers zoo's GPT-2 with ``--width`` and ``--layers`` (768 and 8:
57 M parameters) and a small batch (``--batch`` sequences of ``--tokens`` per rank), exported
once to a training model file, then each variant in fresh processes (one mpiexec each), so
that each rank's memory is its own: the peak resident memory of the process (onnxruntime's
arena and Python together, ``VmHWM``) over start-up (load, compile, first step) and,
reset after start-up (garbage collected, ``malloc_trim``, ``/proc/self/clear_refs``), over the
timed steps; the bytes of
parameters and optimizer state a rank holds between steps; steps/s; MB sent per step; the
loss of the first and last step (each rank feeds one fixed batch of random tokens, labels the
inputs, every step). ``--limit-mb M`` runs every variant under ``RLIMIT_AS`` of
the address space after imports plus M MiB, and reports the ones that fail with their error.
``--points``: rank 0's resident memory at points of one more step (:func:`memory_points`).

    python benchmarks/sharding.py [--ranks 2] [--hidden 1024] [--steps 50] [--repeats 3]
    python benchmarks/sharding.py --model gpt2 --ranks 4 --steps 10 [--limit-mb M] [--points]
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import ranks  # noqa: E402

VARIANTS = ("none", "optimizer", "gradients", "parameters")


def _status(key: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmHWM, VmRSS, VmSize)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _held(tr, role: str) -> int:
    return sum(tr.values[n].numpy().nbytes for n in tr.meta.names(role)
               if n not in ("ngdist.step", "ngdist.shard_rank"))


def mlp_worker(args: argparse.Namespace) -> None:
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
            state = _held(tr, "state")
            steps_s, sent = ranks.timed_steps(tr, feed, args.warmup, args.steps)
            tr.close()
            run = {"steps_s": steps_s, "MB": sent / args.steps / 1e6, "state_MB": state / 1e6}
            if name not in best or run["steps_s"] > best[name]["steps_s"]:
                best[name] = run
    if ngdist.rank() == 0:
        Path(args.out).write_text(json.dumps(best))


def memory_points(tr, feed: dict) -> dict:
    """One more step with the resident memory (``VmRSS``) read after each item of the plan:
    at the step's start, after its last forward gather, its largest and at its end (MiB), and
    at the largest, the step's values alive (MiB): all of them, and those gathered by
    AllGather (whole parameters)."""
    ex = tr.executor
    gathered = {o for n in ex.comm_nodes.values() if n.op_type == "AllGather" for o in n.outputs}
    points: list[tuple[str, float, float, float]] = []

    def note(label: str, env: dict) -> None:
        sizes = {name: v.numpy().nbytes for name, v in env.items()}
        points.append((label, _status("VmRSS") / 2**20, sum(sizes.values()) / 2**20,
                       sum(b for n, b in sizes.items() if n in gathered) / 2**20))

    segment, comm = ex._segment, ex._comm

    def on_segment(item, env, times):
        segment(item, env, times)
        note(f"segment {item.index}", env)

    def on_comm(item, env, pending, times):
        comm(item, env, pending, times)
        pending.resolve(list(pending.futures))  # (its result in env: what it holds)
        note(ex.comm_nodes[item.index].name, env)

    start = _status("VmRSS") / 2**20
    ex._segment, ex._comm = on_segment, on_comm
    try:
        tr.step(feed)
    finally:
        del ex._segment, ex._comm
    forward = [i for i, p in enumerate(points) if p[0].endswith("/fwd")]
    top = max(points, key=lambda p: p[1])
    return {"start": start, "after_forward_gathers": points[forward[-1]][1] if forward else None,
            "peak": top[1], "peak_at": top[0], "alive_at_peak": top[2],
            "gathered_at_peak": top[3], "end": points[-1][1]}


def gpt2_worker(args: argparse.Namespace) -> None:
    """One variant on every rank: memory, speed and bytes (module docstring)."""
    import numpy as np

    if args.limit_mb:
        cap = _status("VmSize") + args.limit_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import ngdist
    from ngdist.comm import world_group

    group = world_group(300)
    rng = np.random.default_rng(group.rank)  # one batch per rank, every step: the loss falls
    tokens = rng.integers(2, 64, (args.batch, args.tokens)).astype(np.int64)
    feeds = [{"input_ids": tokens, "labels": tokens}] * (args.warmup + args.steps)
    try:
        tr = ngdist.compile(args.file, shard=args.variant, intra_op_threads=1, timeout=300)
        rank = tr.rank
        losses = [tr.step(feeds[0]).loss]
    except Exception as exc:  # the run under a memory limit reports what failed, and where
        line = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        Path(f"{args.out}.{group.rank}").write_text(json.dumps({"failed": line[:300]}))
        raise
    startup = _status("VmHWM")
    gc.collect()  # what start-up left behind, returned to the system before the steps' peak
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    for feed in feeds[1:args.warmup]:
        losses.append(tr.step(feed).loss)
    tr.group.barrier().wait()
    sent, t0 = 0, time.perf_counter()
    for feed in feeds[args.warmup:]:
        stats = tr.step(feed)
        sent += stats.bytes_sent
        losses.append(stats.loss)
    steps_s = args.steps / ranks.slowest(time.perf_counter() - t0)
    run = {"startup_MB": startup / 2**20, "step_peak_MB": _status("VmHWM") / 2**20,
           "params_MB": _held(tr, "param") / 2**20, "state_MB": _held(tr, "state") / 2**20,
           "steps_s": steps_s, "MB": sent / args.steps / 1e6,
           "loss": [float(np.mean(losses[:1])), float(losses[-1])]}
    if args.points:
        run["points"] = memory_points(tr, feeds[0])
    tr.close()
    Path(f"{args.out}.{rank}").write_text(json.dumps(run))


def export_gpt2(args: argparse.Namespace, path: Path) -> int:
    """The GPT-2 training model (AdamW) written to ``path``; its parameter count."""
    import torch

    from ngdist import zoo_transformers as hfzoo
    from ngdist.frontends.torch import training_model
    from ngdist.ir.model import save_proto

    model = hfzoo.build("gpt2", width=args.width, layers=args.layers)
    example = hfzoo.tensors(hfzoo.batch("gpt2", size=args.batch, length=args.tokens))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    proto, _ = training_model(model, example, loss=None, optimizer=opt,
                              input_names=["input_ids", "labels"])
    save_proto(proto, path)
    return sum(p.numel() for p in model.parameters())


def run_gpt2(args: argparse.Namespace) -> None:
    path = Path(f"/tmp/ngdist-sharding-gpt2-{os.getpid()}.onnx")
    count = export_gpt2(args, path)
    print(f"{args.ranks} ranks on {os.cpu_count()} CPU cores (load average "
          f"{os.getloadavg()[0]:.1f} at start); GPT-2 width {args.width}, {args.layers} "
          f"layers, {count / 1e6:.1f} M parameters, AdamW, {args.batch} x {args.tokens} "
          f"tokens per rank, {args.steps} timed steps after {args.warmup}"
          + (f"; RLIMIT_AS = address space after imports + {args.limit_mb} MiB"
             if args.limit_mb else ""))
    results = {}
    try:
        for name in args.variants:
            out = Path(f"/tmp/ngdist-sharding-{os.getpid()}-{name}.json")
            cmd = [*_mpiexec(args.ranks), sys.executable, str(Path(__file__).resolve()),
                   "--worker", "--variant", name, "--file", str(path), "--out", str(out),
                   *sys.argv[1:]]
            env = {**os.environ, "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            got = [json.loads(Path(f"{out}.{r}").read_text())
                   for r in range(args.ranks) if Path(f"{out}.{r}").exists()]
            for r in range(args.ranks):
                Path(f"{out}.{r}").unlink(missing_ok=True)
            failed = [g["failed"] for g in got if "failed" in g]
            if proc.returncode != 0 or failed or len(got) < args.ranks:
                results[name] = {"failed": failed[0] if failed else
                                 (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
            else:
                results[name] = {k: max(g[k] for g in got) if k not in ("loss", "points")
                                 else got[0][k] for k in got[0]}
            print(name, json.dumps(results[name]), flush=True)
    finally:
        path.unlink(missing_ok=True)
    show_gpt2(results)


def _mpiexec(n: int) -> list[str]:
    from ngdist.comm.launch import mpiexec_cmd
    return mpiexec_cmd(n)


def show_gpt2(results: dict[str, dict]) -> None:
    print("| shard | start-up peak (MiB) | step peak (MiB) | / none | params + state held "
          "(MiB) | steps/s | / none | MB sent per step | loss first -> last |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    base = results.get("none", {})
    for name, r in results.items():
        if "failed" in r:
            print(f"| {name} | failed: {r['failed']} | | | | | | | |")
            continue
        rel = (lambda k: f"{r[k] / base[k]:.2f}x") if "failed" not in base and base else \
            (lambda k: "-")
        print(f"| {name} | {r['startup_MB']:.0f} | {r['step_peak_MB']:.0f} | "
              f"{rel('step_peak_MB')} | {r['params_MB'] + r['state_MB']:.0f} | "
              f"{r['steps_s']:.2f} | {rel('steps_s')} | {r['MB']:.1f} | "
              f"{r['loss'][0]:.3f} -> {r['loss'][1]:.3f} |")


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
    p.add_argument("--model", choices=("mlp", "gpt2"), default="mlp")
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32, help="gpt2: tokens per sequence")
    p.add_argument("--limit-mb", type=int, default=0, help="gpt2: RLIMIT_AS headroom")
    p.add_argument("--points", action="store_true",
                   help="gpt2: rank 0's resident memory at points of one more step")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--file", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        (gpt2_worker if args.model == "gpt2" else mlp_worker)(args)
        return 0
    if args.model == "gpt2":
        run_gpt2(args)
        return 0
    print(f"{args.ranks} ranks on {os.cpu_count()} CPU cores (load average "
          f"{os.getloadavg()[0]:.1f} at start); MLP 64-{args.hidden}-{args.hidden}-10, AdamW, "
          f"batch {args.batch}/rank, {args.steps} timed steps, best of {args.repeats}")
    show(ranks.launch(__file__, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
