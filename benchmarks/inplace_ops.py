"""Elementwise results written in place, against onnxruntime's own buffers.

Part 1, onnxruntime alone: three chained ``Mul`` by a scalar over ``--mib`` MiB of float32,
one intra-op thread, each result in a buffer onnxruntime allocates (the default) and each
result bound (IOBinding) to the input's own memory.

Part 2, training steps: ``ngdist.compile(..., strategy="local", intra_op_threads=1)`` on
models of ``ngdist.zoo_vision`` (8 images of 64x64, ``torch.optim.AdamW``) with the update
written in place (the default) and with the executor given no donated values (every result
in a new buffer), the same weights and batch, alternating rounds of ``--steps`` steps; the
best round of each is kept, and eager PyTorch's step beside them.

    python benchmarks/inplace_ops.py [--mib 128] [--models resnet mobilenet_v2]
        [--steps 6] [--rounds 3]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _timed(fn, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def chain(mib: int, repeat: int = 10) -> tuple[float, float]:
    """Seconds for three chained Muls: (onnxruntime's buffers, written in place)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from ngdist.ir.model import IR_VERSION
    from ngdist.runtime.sessions import make_session

    n = mib * 2 ** 20 // 4
    nodes = [helper.make_node("Mul", [a, "s"], [b])
             for a, b in (("x", "t0"), ("t0", "t1"), ("t1", "z"))]
    times = []
    for in_place in (False, True):
        outs = ["t0", "t1", "z"] if in_place else ["z"]
        graph = helper.make_graph(
            nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n]),
                             helper.make_tensor_value_info("s", TensorProto.FLOAT, [1])],
            [helper.make_tensor_value_info(o, TensorProto.FLOAT, [n]) for o in outs])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                                  ir_version=IR_VERSION)
        sess = make_session(model, intra_op_threads=1)
        x = ort.OrtValue.ortvalue_from_numpy(np.ones(n, np.float32))
        binding = sess.io_binding()
        binding.bind_ortvalue_input("x", x)
        binding.bind_ortvalue_input("s", ort.OrtValue.ortvalue_from_numpy(
            np.array([1.0], np.float32)))
        for o in outs:
            if in_place:
                binding.bind_ortvalue_output(o, x)
            else:
                binding.bind_output(o, "cpu")
        sess.run_with_iobinding(binding)
        times.append(_timed(lambda: sess.run_with_iobinding(binding), repeat))
    return times[0], times[1]


def steps(name: str, args: argparse.Namespace) -> tuple[float, float, float]:
    """Seconds per step: (ngdist in place, ngdist without donated values, eager PyTorch)."""
    import torch

    import ngdist
    from ngdist import zoo_vision as vz
    from ngdist.runtime import executor as executor_module
    from ngdist.runtime import trainer as trainer_module

    feeds = vz.batch(name, size=8, full=True)
    example = {k: v[:2] for k, v in feeds.items()}
    real = executor_module.Executor

    def make(in_place: bool):
        module = vz.build(name, full=True)
        if not in_place:
            trainer_module.Executor = lambda *a, donate=None, **kw: real(*a, **kw)
        try:
            return ngdist.compile(module, vz.tensors(example), loss=None,
                                  optimizer=torch.optim.AdamW(module.parameters(), lr=1e-4,
                                                              weight_decay=0.01),
                                  strategy="local", intra_op_threads=1)
        finally:
            trainer_module.Executor = real

    fast, plain = make(True), make(False)
    eager = vz.build(name, full=True)
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-4, weight_decay=0.01)
    tensors = vz.tensors(feeds)

    def torch_step() -> None:
        opt.zero_grad()
        eager(*tensors).backward()
        opt.step()

    runs = [lambda: fast.step(feeds, fetch_stats=False),
            lambda: plain.step(feeds, fetch_stats=False), torch_step]
    for run in runs:
        _timed(run, 2)
    best = [float("inf")] * 3
    for _ in range(args.rounds):
        for i, run in enumerate(runs):
            best[i] = min(best[i], _timed(run, args.steps))
    return best[0], best[1], best[2]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=128, help="size of the chained tensor")
    p.add_argument("--models", nargs="*", default=["resnet", "mobilenet_v2"],
                   help="ngdist.zoo_vision models for the step comparison (none: skip it)")
    p.add_argument("--steps", type=int, default=6, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; best is kept")
    args = p.parse_args(argv)

    import logging

    import torch
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    own, in_place = chain(args.mib)
    print(f"3 chained Mul over {args.mib} MiB, 1 thread: onnxruntime's buffers "
          f"{own * 1e3:.1f} ms, in place {in_place * 1e3:.1f} ms, ratio {own / in_place:.2f}")
    if args.models:
        print(f"{'model':<14} {'in place ms':>12} {'new buffers ms':>15} {'ratio':>6} "
              f"{'torch ms':>9} {'in place / torch':>17}")
    for name in args.models:
        fast, plain, eager = steps(name, args)
        print(f"{name:<14} {fast * 1e3:>12.2f} {plain * 1e3:>15.2f} {plain / fast:>6.2f} "
              f"{eager * 1e3:>9.2f} {fast / eager:>17.2f}", flush=True)


if __name__ == "__main__":
    main()
