"""onnxruntime's memory pattern (or, ``--option reuse``, its memory-reuse plan) on the CPU, on
and off: a step's resident size after each of its first steps, and the step time, the two
alternating in one process (a machine with background work slows both alike).

    python benchmarks/memory_pattern.py [--models mlp tv/resnet18 ...] [--steps 20]
        [--option pattern|reuse]

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
OPTIONS = {"pattern": "enable_mem_pattern", "reuse": "enable_mem_reuse"}  # SessionOptions'


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


def _trainer(name: str, pattern: bool, option: str = "pattern") -> tuple[Any, dict[str, Any]]:
    """A trainer of ``name`` whose sessions are made (at its first step) with the memory
    pattern (``option``: see ``OPTIONS``) on or off."""
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
        setattr(opts, OPTIONS[option], pattern)
        return opts

    sessions.session_options = options
    try:
        trainer.step(feeds, fetch_stats=False)
    finally:
        sessions.session_options = made
    return trainer, feeds


def resident(name: str, pattern: bool, steps: int = 5, option: str = "pattern") -> list[int]:
    """MiB resident after each of the first ``steps`` steps (this process holds only it)."""
    trainer, feeds = _trainer(name, pattern, option)
    sizes = [_resident() // MIB]
    for _ in range(steps - 1):
        trainer.step(feeds, fetch_stats=False)
        sizes.append(_resident() // MIB)
    return sizes


def step_times(name: str, steps: int, option: str = "pattern") -> dict[str, float]:
    """Median step ms of each, the two trainers' steps alternating."""
    pair = {p: _trainer(name, p, option) for p in (True, False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(steps):
        for p, (trainer, feeds) in pair.items():
            start = time.perf_counter()
            trainer.step(feeds, fetch_stats=False)
            times[p].append(time.perf_counter() - start)
    return {f"{option}_ms": statistics.median(times[True]) * 1e3,
            f"no_{option}_ms": statistics.median(times[False]) * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["mlp", "tv/resnet18", "hf/causal/llama"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--option", choices=sorted(OPTIONS), default="pattern")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--pattern", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.one:
        print(json.dumps(resident(args.one, bool(args.pattern), option=args.option)))
        return
    for name in args.models:
        sizes = {}
        for pattern in (1, 0):  # each in a process of its own: resident sizes not mixed
            out = subprocess.run([sys.executable, __file__, "--one", name, "--pattern",
                                  str(pattern), "--option", args.option],
                                 capture_output=True, text=True, check=True)
            sizes[pattern] = json.loads(out.stdout.strip().splitlines()[-1])
        row = {"model": name, f"resident_mib_{args.option}": sizes[1],
               f"resident_mib_no_{args.option}": sizes[0],
               **step_times(name, args.steps, args.option)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
