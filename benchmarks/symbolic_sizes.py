"""Step time of a model whose spatial sizes are static next to the same model with them
symbolic (read at run time in the backward graph), in one run.

    python benchmarks/symbolic_sizes.py [--batch 64] [--length 256] [--channels 32]
                                        [--steps 30] [--repeats 5] [--out results.json]

One Conv1d + MaxPool1d + AvgPool1d network (``ConvPool1d``, widened to ``--channels``) is
exported by ``torch.onnx.export`` (TorchScript) twice: with only the batch axis symbolic (the
backward graph keeps every spatial size as a constant, the graph ngdist builds for static
models) and with the batch and the length symbolic (Conv and pooling gradients read the length
with Shape and fit their windows with Pad/Slice; the Conv weight gradient takes the single-Conv
form instead of one MatMul per tap). Both train through ``ngdist.compile(path,
strategy="local")`` on the same batches; their steps are interleaved, ``--steps`` per repeat,
and the table gives the median milliseconds per step and the ratio of the symbolic form to the
static one. The first steps (session building) are not timed.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

logger = logging.getLogger("symbolic_sizes")


def build(channels: int):
    import torch

    nn = torch.nn

    class ConvPool1d(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.pool1 = nn.Conv1d(3, channels, 3, padding=1), nn.MaxPool1d(2)
            self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
            self.pool2, self.fc = nn.AvgPool1d(2), nn.Linear(channels, 4)

        def forward(self, x):
            x = self.pool1(torch.relu(self.conv1(x)))
            x = self.pool2(torch.relu(self.conv2(x)))
            return self.fc(x.mean(-1))

    torch.manual_seed(0)
    return ConvPool1d()


def export(module, example: np.ndarray, path: str, length: bool) -> None:
    import torch

    axes = {0: "batch", 2: "length"} if length else {0: "batch"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.from_numpy(example),), path, dynamo=False,
                          input_names=["x"], output_names=["logits"], opset_version=18,
                          dynamic_axes={"x": axes, "logits": {0: "batch"}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--channels", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from tqdm import tqdm

    import ngdist

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, 3, args.length)).astype(np.float32)
    y = rng.integers(0, 4, args.batch)
    module = build(args.channels)
    forms = {"static length": False, "symbolic length": True}
    trainers = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, length in forms.items():
            path = str(Path(tmp) / f"{'dynamic' if length else 'static'}.onnx")
            export(module, x[:2], path, length)
            trainers[name] = ngdist.compile(path, loss="softmax_cross_entropy", labels="y",
                                            optimizer=ngdist.optim.SGD(lr=0.01),
                                            strategy="local")
    times: dict[str, list[float]] = {name: [] for name in forms}
    for trainer in trainers.values():
        for _ in range(3):  # sessions are built on the first step
            trainer.step({"x": x, "y": y})
    for _ in tqdm(range(args.repeats), desc="repeats"):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                trainer.step({"x": x, "y": y})
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    base = statistics.median(times["static length"])
    rows = [{"form": name, "ms_per_step": statistics.median(t),
             "ratio": statistics.median(t) / base} for name, t in times.items()]
    table = [f"x [{args.batch}, 3, {args.length}], {args.channels} channels, "
             f"{args.steps} steps x {args.repeats} repeats", "",
             "| form | ms/step (median) | vs static |", "|---|---|---|"]
    table += [f"| {r['form']} | {r['ms_per_step']:.2f} | {r['ratio']:.2f}x |" for r in rows]
    logger.info("\n".join(table))
    if args.out:
        from ngdist.ir.atomic import write_atomic

        write_atomic(args.out, json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                           "rows": rows}, indent=1).encode())


if __name__ == "__main__":
    main()
