"""onnxruntime's memory pattern on the CPU, on and off: a step's resident size after each of
its first steps, and the step time, the two alternating in one process (a machine with
background work slows both alike).

    python benchmarks/memory_pattern.py [--models mlp tv/resnet18 ...] [--steps 20]

``mlp``: 3 hidden layers of 512, batch 2048; any other name is a case of the model sweep
(benchmarks/model_sweep.py: its module, batch and loss). AdamW, one onnxruntime thread.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

MIB = 1 << 20


def _resident() -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) << 10  # type: ignore[union-attr]


def _case(name: str) -> tuple[Any, dict[str, Any], Any]:
    import torch

    if name == "mlp":
        torch.manual_seed(0)
        layers = [m for _ in range(3) for m in (torch.nn.Linear(512, 512), torch.nn.GELU())]
        module = torch.nn.Sequential(*layers, torch.nn.Linear(512, 10))
        feeds = {"input": torch.randn(2048, 512).numpy(),
                 "y": torch.randint(0, 10, (2048,)).numpy()}
        return module, feeds, torch.nn.CrossEntropyLoss()
    from model_sweep import find_case

    return find_case(name, name).make()


def _trainer(name: str, pattern: bool) -> tuple[Any, dict[str, Any]]:
    """A trainer of ``name`` whose sessions are made (at its first step) with the memory
    pattern on or off."""
    import torch
    from sweep_check import _tensors, module_inputs

    import ngdist
    from ngdist.runtime import sessions

    module, feeds, loss_fn = _case(name)
    inputs = module_inputs(feeds, loss_fn)
    trainer = ngdist.compile(module, _tensors(inputs), loss=loss_fn,
                             optimizer=torch.optim.AdamW(module.parameters(), lr=1e-4),
                             strategy="local", intra_op_threads=1, input_names=list(inputs))
    made = sessions.session_options

    def options(*args: Any, **kwargs: Any) -> Any:
        opts = made(*args, **kwargs)
        opts.enable_mem_pattern = pattern
        return opts

    sessions.session_options = options
    try:
        trainer.step(feeds, fetch_stats=False)
    finally:
        sessions.session_options = made
    return trainer, feeds


def resident(name: str, pattern: bool, steps: int = 5) -> list[int]:
    """MiB resident after each of the first ``steps`` steps (this process holds only it)."""
    trainer, feeds = _trainer(name, pattern)
    sizes = [_resident() // MIB]
    for _ in range(steps - 1):
        trainer.step(feeds, fetch_stats=False)
        sizes.append(_resident() // MIB)
    return sizes


def step_times(name: str, steps: int) -> dict[str, float]:
    """Median step ms of each, the two trainers' steps alternating."""
    pair = {p: _trainer(name, p) for p in (True, False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(steps):
        for p, (trainer, feeds) in pair.items():
            start = time.perf_counter()
            trainer.step(feeds, fetch_stats=False)
            times[p].append(time.perf_counter() - start)
    return {"pattern_ms": statistics.median(times[True]) * 1e3,
            "no_pattern_ms": statistics.median(times[False]) * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["mlp", "tv/resnet18", "hf/causal/llama"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--pattern", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.one:
        print(json.dumps(resident(args.one, bool(args.pattern))))
        return
    for name in args.models:
        sizes = {}
        for pattern in (1, 0):  # each in a process of its own: resident sizes not mixed
            out = subprocess.run([sys.executable, __file__, "--one", name, "--pattern",
                                  str(pattern)], capture_output=True, text=True, check=True)
            sizes[pattern] = json.loads(out.stdout.strip().splitlines()[-1])
        row = {"model": name, "resident_mib_pattern": sizes[1],
               "resident_mib_no_pattern": sizes[0], **step_times(name, args.steps)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
