"""The model sweep's optimizer steps (benchmarks/sweep_check.py): the trained state's errors
from torch's float64 step, and the torch oracle of one step from the state ngdist reached.

Each tensor's error is relative to its scale: the larger of its largest exact entry and the
largest change of any tensor of its kind (parameters; each kind of running statistic).
AdamW normalises each entry's step (about lr x its gradient's sign at the first step), so an
entry whose float64 gradient is within the gradients stage's bound of zero can move 2 lr the
other way on a gradient that passes that bound: such entries (``noise_entries``) are held
within twice the model's largest update, not compared. The bound is ``FACTOR`` x torch's own
float32 error of the tensor, the largest over torch's float32 runs: the oracle finds them
from the ``default`` run, and over every run (``WIDER``) where a tensor is out of bounds.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from step_probe import chunks
from sweep_oracle import torch_grads, torch_step

TOL = 1e-4
FACTOR = 10.0
WIDER = "noise over every run"  # asked of the step oracle: AdamW's noise entries widened


def scales(exact: dict[str, np.ndarray], before: dict[str, np.ndarray]) -> dict[str, float]:
    """Per tensor: the larger of its largest exact entry and the largest change of any tensor
    of its kind (parameters; each kind of running statistic)."""
    kind = {k: k.rsplit(".", 1)[-1] if "running_" in k else "param" for k in exact}
    moved: dict[str, float] = {}
    for k in exact:
        moved[kind[k]] = max(moved.get(kind[k], 0.0), max_off(exact[k], before[k], finite=True))
    return {k: max(finite_max(exact[k]), moved[kind[k]], 1e-30) for k in exact}


def off(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b|, 0 where the two are equal (an infinite bound that a step leaves infinite:
    timm's Gemma 4 ViT clips activations to parameters that start at +-inf), inf where one
    entry is infinite or NaN and the other is not."""
    with np.errstate(invalid="ignore"):
        return np.where(a == b, 0.0, np.nan_to_num(np.abs(a - b), nan=np.inf, posinf=np.inf))


def finite_max(a: np.ndarray) -> float:
    """The largest finite |entry| of ``a`` (0 where none is)."""
    out = 0.0
    for (part,) in chunks(a):
        out = max(out, float(np.abs(part[np.isfinite(part)]).max(initial=0.0)))
    return out


def max_off(a: np.ndarray, b: np.ndarray, keep: np.ndarray | None = None,
            finite: bool = False) -> float:
    """The largest ``off(a, b)`` over the entries ``keep`` (all by default), of its finite
    entries alone where ``finite``; ``step_probe.CHUNK`` entries at a time."""
    out = 0.0
    for part in chunks(a, b, *(() if keep is None else (keep,))):
        diff = off(part[0], part[1])
        if keep is not None:
            diff = diff[part[2]]
        out = max(out, finite_max(diff) if finite else float(diff.max(initial=0.0)))
    return out


def state_errors(state, exact, before, noise) -> dict[str, float]:
    """Per tensor: max |state - exact| off the noise entries, relative to its ``scales``."""
    scale, out = scales(exact, before), {}
    for k, value in state.items():
        mask = noise.get(k)
        out[k] = max_off(value, exact[k], None if mask is None else ~mask) / scale[k]
    return out


def noise_entries(g64: dict, g32: dict) -> dict[str, np.ndarray]:
    """AdamW's entries whose step direction a gradient within the gradients stage's bound
    does not decide: the float64 gradient is within that bound of zero (``TOL`` of the
    tensor's largest entry, or ``FACTOR`` x the float32 gradient ``g32``'s error of the
    tensor), or within 1e-6 of the model's largest gradient."""
    largest = max(float(np.abs(g).max()) for g in g64.values())
    return {n: np.abs(g) <= max(FACTOR * float(np.abs(g32[n] - g).max()),
                                TOL * float(np.abs(g).max()), 1e-6 * largest)
            for n, g in g64.items()}


def step_oracle(module: Any, optimizer: Any, feeds: dict[str, np.ndarray], loss_fn: Any,
                make_opt: Any, opt: str, before: dict[str, np.ndarray]) -> Any:
    """The torch oracle of one training step from ``module``'s and ``optimizer``'s state
    (``Oracle``'s ``fn``): torch's float64 step and AdamW's noise entries (at the first ask,
    from the ``default`` float32 gradient; with ``WIDER`` asked, from every float32 run
    asked besides), each asked float32 run's errors from float64 (``default``'s state
    too)."""
    memo: dict[str, Any] = {}

    def oracle(asked: tuple[str, ...]) -> dict[str, Any]:
        if not memo:
            if opt == "adamw":
                memo["g64"] = torch_grads(module, feeds, loss_fn, True)[1]
                memo["noise"] = noise_entries(memo["g64"],
                                              torch_grads(module, feeds, loss_fn, False)[1])
            else:
                memo["noise"] = {}
            memo["ref64"] = torch_step(module, optimizer, feeds, loss_fn, make_opt, True)
        runs = [r for r in asked if r != WIDER]
        if WIDER in asked and opt == "adamw":
            for run in runs:
                wider = noise_entries(memo["g64"], torch_grads(module, feeds, loss_fn, False,
                                                               run)[1])
                memo["noise"] = {n: m | wider[n] for n, m in memo["noise"].items()}
        noise, ref64 = memo["noise"], memo["ref64"]
        result: dict[str, Any] = {"runs": {}, "noise": noise}
        if "default" in asked:
            result["ref64"] = ref64
        for run in runs:
            ref32 = torch_step(module, optimizer, feeds, loss_fn, make_opt, False, run)
            result["runs"][run] = state_errors(ref32, ref64, before, noise)
            if run == "default":
                result["ref32"] = ref32
        return result

    return oracle
