"""Peak memory of one training step of zoo.cnn(), next to a forward pass and to PyTorch.

Each measurement runs in a fresh process: build the model (and trainer), reset the kernel's
peak-RSS counter (``/proc/self/clear_refs``), run three times and read ``VmHWM`` (peak resident
set) against the ``VmRSS`` before the first run: what running needs on top of the built model
(activations, gradients, arenas, lazily created sessions); then time further runs (median
milliseconds per call, at least 10 calls and 1 s), so that the arena's memory is weighed
against its speed in the same process. Rows: ngdist's training
step (``strategy="local"``, one rank, one intra-op thread), the same with onnxruntime's CPU
memory arena off (the graph's own need, without the arena's power-of-two growth), the same
with one shared arena that grows by exactly what is asked (``kSameAsRequested``), the forward
pass alone (``Trainer.predict`` on the eval graph), and the same step in PyTorch 2 (same layers,
SGD with momentum, training-mode BatchNorm). ``activations`` is the size of the forward pass's
intermediate tensors (conv, BN, Relu, pool outputs and MaxPool indices), what a backward pass
that keeps them must hold.

    python benchmarks/cnn_step_memory.py [--batch 256 1024 4096]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHANNELS = (32, 32)


def _kib(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1])
    raise KeyError(key)


def _peak_of(fn, runs: int = 3) -> tuple[float, float]:
    """(peak RSS - RSS before, RSS before) in MiB over ``runs`` calls of ``fn``."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current RSS
    before = _kib("VmRSS")
    for _ in range(runs):
        fn()
    return (_kib("VmHWM") - before) / 1024, before / 1024


def _batch(n: int):
    import numpy as np

    from ngdist.data import load_digits
    x, y, _, _ = load_digits(test_fraction=0.0, images=True)
    idx = np.arange(n) % len(x)
    return x[idx], y[idx]


def _without_arena() -> None:
    """Every onnxruntime session ngdist creates from now on allocates without the CPU arena
    (the user-facing switch, NGDIST_CPU_ARENA=0)."""
    import os

    os.environ["NGDIST_CPU_ARENA"] = "0"


def _arena_same_as_requested() -> None:
    """Sessions share one CPU arena that grows by what is asked (kSameAsRequested), not by
    powers of two."""
    import onnxruntime as ort

    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                             ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 1, -1, -1))

    class Options(ort.SessionOptions):
        def __init__(self) -> None:
            super().__init__()
            self.add_session_config_entry("session.use_env_allocators", "1")

    ort.SessionOptions = Options


def measure(kind: str, batch: int) -> dict:
    x, y = _batch(batch)
    if kind.endswith("-no-arena"):
        _without_arena()
        kind = kind[:-len("-no-arena")]
    if kind.endswith("-exact-arena"):
        _arena_same_as_requested()
        kind = kind[:-len("-exact-arena")]
    if kind == "torch":
        import torch
        torch.set_num_threads(1)
        c1, c2 = CHANNELS
        net = torch.nn.Sequential(
            torch.nn.Conv2d(1, c1, 3, padding=1), torch.nn.BatchNorm2d(c1), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2), torch.nn.Conv2d(c1, c2, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Flatten(), torch.nn.Linear(c2 * 16, 10))
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)

        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xt), yt).backward()
            opt.step()
        run = step
    else:
        import ngdist
        from ngdist import zoo
        trainer = ngdist.compile(zoo.cnn(channels=CHANNELS), optimizer=ngdist.optim.SGD(
            lr=0.01, momentum=0.9), strategy="local", intra_op_threads=1)
        if kind == "ngdist-step":
            def run() -> None:
                trainer.step({"x": x, "y": y})
        else:
            def run() -> None:
                trainer.predict({"x": x})
    peak, base = _peak_of(run)
    return {"kind": kind, "batch": batch, "peak_mib": peak, "base_mib": base,
            "ms": _median_ms(run)}


def _median_ms(fn, min_calls: int = 10, min_s: float = 1.0) -> float:
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_s:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def activations_mib(batch: int) -> float:
    c1, c2 = CHANNELS
    per_sample = 4 * (3 * c1 * 64 + c1 * 16 + 3 * c2 * 16) + 8 * c1 * 16  # float32 + int64
    return batch * per_sample / 2 ** 20


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]))))
        return 0
    kinds = ["ngdist-step", "ngdist-step-no-arena", "ngdist-step-exact-arena", "ngdist-forward"]
    try:
        import torch  # noqa: F401
        kinds.append("torch")
    except ImportError:
        print("torch not installed: PyTorch column skipped", file=sys.stderr)
    print("| batch | activations (MiB) | ngdist step peak (MiB) | same, no arena (MiB) "
          "| same, exact-growth arena (MiB) | ngdist forward peak (MiB) | PyTorch step peak (MiB) "
          "| ngdist / PyTorch | no arena / PyTorch "
          "| step ms: arena / no arena / exact-growth arena / PyTorch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for batch in args.batch:
        rows = {}
        for kind in kinds:
            out = subprocess.run([sys.executable, __file__, "--child", kind, str(batch)],
                                 capture_output=True, text=True, check=True, cwd=ROOT)
            rows[kind] = json.loads(out.stdout.strip().splitlines()[-1])
        step, bare = rows["ngdist-step"]["peak_mib"], rows["ngdist-step-no-arena"]["peak_mib"]
        torch_row = rows.get("torch")
        torch_peak = torch_row["peak_mib"] if torch_row else None
        exact = rows["ngdist-step-exact-arena"]
        ms = (f"{rows['ngdist-step']['ms']:.1f} / {rows['ngdist-step-no-arena']['ms']:.1f} / "
              f"{exact['ms']:.1f} / " + (f"{torch_row['ms']:.1f}" if torch_row else "-"))
        print(f"| {batch} | {activations_mib(batch):.1f} | {step:.1f} | {bare:.1f} | "
              f"{exact['peak_mib']:.1f} | "
              f"{rows['ngdist-forward']['peak_mib']:.1f} | " +
              (f"{torch_peak:.1f} | {step / torch_peak:.2f}x | {bare / torch_peak:.2f}x | "
               if torch_peak else "- | - | - | ") + ms + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
