"""Where a sweep model's gradients part from torch float64: every parameter's gradient error,
ngdist's and torch float32's, from the loss back, and the first tensor past 10x torch's.

A model of the sweep (benchmarks/model_sweep.py: its module, batch and loss), optionally after
``--sgd-steps`` steps of ngdist's SGD (lr 1e-2, momentum 0.9: the sweep's SGD stage, so a
failure at step N is looked at from the state before it): ngdist's gradients (the torch
frontend's training model, one step) against torch autograd in float64, beside torch's own
float32 gradients (its default run, one thread). Parameters are listed in reverse
registration order, which for most models is nearest the loss first. Per tensor: the error
relative to its largest float64 entry, torch float32's, their ratio, and how many slices along
axis 0 are past 10x torch's error of the tensor (a kink: one slice of the tensor next to it;
the tensors before it inherit it in many).

    python benchmarks/grad_walk.py tv/resnet50
    python benchmarks/grad_walk.py tv/regnet_x_800mf --sgd-steps 1 --top 20
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent),
                str(Path(__file__).resolve().parents[1] / "tests")]

from sweep_steps import FACTOR, finite_max, max_off  # noqa: E402


def trained(name: str, sgd_steps: int) -> tuple[Any, dict[str, np.ndarray], Any]:
    """The case's (module, feeds, loss), the module after ``sgd_steps`` of ngdist's SGD."""
    import torch
    from model_sweep import find_case
    from sweep_check import module_inputs, tensors_of

    import ngdist

    module, feeds, loss_fn = find_case(name, name).make()
    if sgd_steps:
        inputs = module_inputs(feeds, loss_fn)
        optimizer = torch.optim.SGD(module.parameters(), lr=1e-2, momentum=0.9)
        trainer = ngdist.compile(module, tensors_of(inputs), loss=loss_fn, optimizer=optimizer,
                                 strategy="local", intra_op_threads=1, input_names=list(inputs))
        for _ in range(sgd_steps):
            trainer.step(feeds, fetch_stats=False)
        trainer.to_torch()
    return module, feeds, loss_fn


def walk(module: Any, feeds: dict[str, np.ndarray], loss_fn: Any) -> list[dict[str, Any]]:
    """Per parameter, nearest the loss first: its errors from float64, whether it is past
    ``FACTOR`` x torch float32's error (``over``), and its slices past that."""
    from step_probe import run_step
    from sweep_check import _slice_count, module_inputs, tensors_of
    from sweep_oracle import torch_grads

    from ngdist.frontends import torch as tfront

    inputs = module_inputs(feeds, loss_fn)
    model, _ = tfront.training_model(copy.deepcopy(module), tensors_of(inputs), loss=loss_fn,
                                     input_names=list(inputs), optimizer="sgd:lr=0.01")
    got = run_step(model, feeds)
    del model
    g64 = torch_grads(module, feeds, loss_fn, True)[1]
    g32 = torch_grads(module, feeds, loss_fn, False)[1]
    rows = []
    for name in reversed(list(g64)):
        exact, ours = g64[name], got[f"{name}.grad"]
        scale = max(finite_max(exact), 1e-30)
        error, theirs = max_off(ours, exact) / scale, max_off(g32[name], exact) / scale
        bound = FACTOR * max(theirs, 1e-7)
        counted = _slice_count(ours, exact, scale, bound)
        past, slices = counted[:2] if counted else (int(error > bound), 1)
        rows.append({"tensor": name, "ngdist": error, "torch32": theirs, "over": error > bound,
                     "past": past, "slices": slices})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name", help="a sweep case: tv/resnet50, timm/dla34, hf/causal/llama")
    p.add_argument("--sgd-steps", type=int, default=0,
                   help="ngdist SGD steps first (the sweep's SGD stage; 0: the initial state)")
    p.add_argument("--top", type=int, default=0, help="print only the first N tensors")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rows = walk(*trained(args.name, args.sgd_steps))
    first = next((r for r in rows if r["over"]), None)
    for r in rows[:args.top or None]:
        mark = f"  <- first past {FACTOR:g}x torch" if r is first else ""
        print(f"{r['tensor']:60s} ngdist {r['ngdist']:.1e}  torch f32 {r['torch32']:.1e}  "
              f"x{r['ngdist'] / max(r['torch32'], 1e-30):8.1f}  past {r['past']}/{r['slices']}"
              f"{mark}")
    name = first["tensor"] if first else "none"
    print(f"first tensor past {FACTOR:g}x torch's float32 error: {name}")


if __name__ == "__main__":
    main()
