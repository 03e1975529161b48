"""How `ngdist rewrite` scales with the size of the model.

    python benchmarks/rewrite_scaling.py [--nodes 1000 10000 100000]

For each N it writes a forward model of one Gemm followed by a chain of N activations
(alternating Relu and Tanh, all on the loss path), then times `ngdist rewrite` on it in a fresh
process (reading, autodiff, the allreduce pass, lowering, writing), and reports the wall time,
the time per forward node, the nodes of the written step and the peak memory of the process.
Linear scaling shows as a constant time per node.
"""
from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnx

from ngdist.zoo import chain

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000, 100000])
    args = ap.parse_args()
    print(f"{'nodes':>8} {'seconds':>8} {'us/node':>8} {'step nodes':>11} {'peak MiB':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.nodes:
            src, out = Path(tmp) / f"chain{n}.onnx", Path(tmp) / f"chain{n}.train.onnx"
            onnx.save(chain(n), src)
            before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "ngdist", "rewrite", str(src), "-o", str(out),
                            "--optimizer", "sgd:lr=0.1"], check=True, cwd=ROOT,
                           stdout=subprocess.DEVNULL)
            seconds = time.perf_counter() - start
            peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            step = onnx.load(out, load_external_data=False).training_info[0].algorithm
            print(f"{n:>8} {seconds:>8.2f} {seconds / n * 1e6:>8.0f} {len(step.node):>11} "
                  f"{max(peak, before) / 1024:>9.0f}", flush=True)


if __name__ == "__main__":
    main()
