"""One model of the sweep (benchmarks/model_sweep.py), checked stage by stage against torch.

Stages: ``build`` (the case's module, batch and loss, and the loss in eager torch: a model
that does not run on the sweep's inputs is not counted as built), ``export`` (the torch frontend's
training model), ``gradients`` (one step's loss and every parameter's gradient, ngdist in
float32 against torch autograd in float64), ``sgd`` and ``adamw`` (3 steps of
``torch.optim.SGD(lr=1e-2, momentum=0.9)`` / ``AdamW(lr=1e-4, weight_decay=0.1)`` through
``ngdist.compile(..., strategy="local")``, each step against torch's step from the state ngdist
reached, every parameter and float buffer), ``timing`` (the AdamW step, ngdist with one onnxruntime intra-op thread
against eager torch with ``torch.set_num_threads(1)``; best of alternating rounds).

Bound, tensor by tensor: 1e-4 relative (to the tensor's largest entry for a gradient; to the
larger of that and the largest change of its kind for the trained state), or 10x torch's own
float32 error of the same tensor from float64 where that is larger (float32 is
ill-conditioned there: the table gives torch's worst float32 error per model), or within
1e-4 of torch's default float32 result (both float32 programs took the same side of a kink).
torch's own float32 error of a tensor is the largest over a fixed set of equally valid torch
float32 runs (sweep_oracle.TORCH32_RUNS: oneDNN on and off, channels-last, two threads, the
float inputs one ulp away; the row lists them, ``torch32_runs``): in an ill-conditioned model
one run's error of a tensor can be small by luck (one ReLU input within rounding of 0 took
torch's side in that run and the other side in the next). AdamW:
entries whose float64 gradient is within the gradients stage's bound of zero (an accepted
gradient error can flip their sign, and a normalised step moves ~lr in the sign's direction)
are bounded by twice the model's largest update, not compared; where a tensor is out of
bounds, they are taken over every torch float32 run, as that bound is (sweep_steps.py).
A failing tensor's message says how many of its slices along axis 0 are off and how close
the rest are (one output channel off alone: an activation within float32's error of a ReLU
kink). A stage whose worst tensor is off in one slice alone, or with another tensor past
10x torch's default float32 error of it in one slice alone (a kink's own channel, which can
stay within the bound while the tensors before it inherit the kink in many slices), is
checked again, every stage, on a second batch of float inputs, the first failure kept.

The torch oracle (float64 and float32 autograd, each step's torch optimizer step) runs in a
forked child process (``Oracle``): the sweep's memory cap is on ngdist and the model, and the
states it keeps are float32 where they are exact (only the float64 oracle's in float64).
"""
from __future__ import annotations

import copy
import gc
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
from sweep_oracle import (Oracle, StageError, float32_runs, forked, loss_of, state_of,
                          tensors_of, to_float64, torch_grads)
from sweep_steps import (FACTOR, TOL, WIDER, finite_max, max_off, off, scales, state_errors,
                         step_oracle)

NGDIST = str(Path(__file__).resolve().parents[1] / "ngdist")
_tensors, _state = tensors_of, state_of  # the names other benchmarks import


def describe(exc: BaseException) -> dict[str, Any]:
    """The failure's one-line message, and where a raw (non-NgdistError) exception raised
    inside ngdist came from: ngdist should have named the op and node instead."""
    from ngdist.errors import NgdistError

    frames = traceback.extract_tb(exc.__traceback__)
    inside = [f for f in frames if f.filename.startswith(NGDIST)
              and "/zoo" not in f.filename]
    message = " ".join(str(exc).split())[:400]
    out: dict[str, Any] = {"error": f"{type(exc).__name__}: {message}"}
    if inside and not isinstance(exc, (NgdistError, StageError)) \
            and frames[-1].filename.startswith(NGDIST):
        last = inside[-1]
        out["raw_in_ngdist"] = f"{Path(last.filename).relative_to(Path(NGDIST).parent)}:" \
                               f"{last.lineno} ({last.name})"
    return out


def missing_package(exc: ImportError) -> str:
    """"needs <package>" for a model whose optional package is not installed (transformers
    says "requires the natten library"), not a failure of ngdist."""
    import re

    found = re.search(r"requires the (\S+) library", str(exc))
    return f"needs {exc.name or (found.group(1) if found else str(exc))}"


def module_inputs(feeds: dict[str, np.ndarray], loss_fn: Any) -> dict[str, np.ndarray]:
    """The feeds the module's forward takes: all of them where it computes its own loss."""
    return dict(feeds) if loss_fn is None else {k: v for k, v in feeds.items() if k != "y"}


def _judge(errors: dict[str, float], own: dict[str, float], vs32: dict[str, float]
           ) -> tuple[float, float, str | None]:
    """(worst error from float64, torch's own worst float32 error, the first tensor out of
    bounds or None). Tensor by tensor: within TOL of float64, or FACTOR x torch's float32
    error of that tensor, or within TOL of torch's float32 result."""
    # (written so that a NaN error is out of bounds: NaN compares false to everything)
    bad = [k for k, e in errors.items()
           if not e <= max(TOL, FACTOR * own.get(k, 0.0)) and not vs32.get(k, 0.0) <= TOL]
    worst = max(errors.values(), default=0.0, key=lambda e: np.inf if np.isnan(e) else e)
    return worst, max(own.values(), default=0.0), max(bad, key=errors.get) if bad else None


def largest_of_runs(runs: dict[str, dict[str, float]]) -> dict[str, float]:
    """torch's own float32 error of each tensor: the largest over torch's float32 runs
    (sweep_oracle.TORCH32_RUNS)."""
    return {k: max(errs[k] for errs in runs.values()) for k in runs["default"]}


def judge_over_runs(errors: dict[str, float], vs32: dict[str, float],
                    runs: dict[str, dict[str, float]], oracle: Oracle,
                    every: tuple[str, ...]) -> tuple[float, float, str | None]:
    """``_judge`` against torch's ``default`` float32 run (in ``runs``); where a tensor is
    out of bounds, against the largest over every run of ``every``, the others asked of
    ``oracle`` then and added to ``runs``."""
    judged = _judge(errors, largest_of_runs(runs), vs32)
    if judged[2] is None or len(every) == len(runs):
        return judged
    runs.update(oracle.ask(tuple(r for r in every if r not in runs))["runs"])
    return _judge(errors, largest_of_runs(runs), vs32)


def spread(errors: dict[str, float], runs: dict[str, dict[str, float]], step: int = 0
           ) -> dict[str, Any]:
    """The tensor nearest its bound against torch's default float32 run alone: ngdist's
    error of it, each float32 run's, and ngdist's error over that bound (``default_ratio``)
    and over the bound from the largest of the runs (``ratio``)."""
    def over(k: str, own: float) -> float:
        return float(np.nan_to_num(errors[k], nan=np.inf)) / max(TOL, FACTOR * own)

    k = max(errors, key=lambda k: over(k, runs["default"][k]))
    return {"tensor": k, **({"step": step} if step else {}), "ngdist": errors[k],
            **{run: errs[k] for run, errs in runs.items()},
            "default_ratio": over(k, runs["default"][k]),
            "ratio": over(k, max(errs[k] for errs in runs.values()))}


def check_gradients(module: Any, feeds: dict[str, np.ndarray], loss_fn: Any,
                    out: dict[str, Any]) -> tuple[dict, dict]:
    from step_probe import gradient_errors, run_step

    from ngdist.frontends import torch as tfront

    inputs = module_inputs(feeds, loss_fn)
    out["stage"] = "export"
    model, exp = tfront.training_model(copy.deepcopy(module), _tensors(inputs), loss=loss_fn,
                                       input_names=list(inputs), optimizer="sgd:lr=0.01")
    out["stage"] = "gradients"
    got = run_step(model, feeds)
    del model  # (the weights' copy in the training model: the oracle's answer comes next)
    runs, memo = float32_runs(module, feeds), {}

    def oracle(asked: tuple[str, ...]) -> dict[str, Any]:
        if not memo:
            memo["loss"], memo["g64"] = torch_grads(module, feeds, loss_fn, True)
        g64, result = memo["g64"], {"runs": {}}
        if "default" in asked:
            result.update(loss=memo["loss"], g64=g64)
        for run in asked:  # one float32 gradient set alive at a time
            loss32, g32 = torch_grads(module, feeds, loss_fn, False, run)
            result["runs"][run] = gradient_errors({f"{n}.grad": g for n, g in g32.items()},
                                                  g64)
            if run == "default":  # (float32 gradients are exact in float32)
                result.update(loss32=loss32, g32={n: g.astype(np.float32) for n, g in g32.items()})
        return result

    with Oracle(oracle) as torch_oracle:
        ref = torch_oracle.ask(runs[:1])
        loss, loss32, g64, g32 = ref["loss"], ref["loss32"], ref["g64"], ref["g32"]
        missing = sorted(set(g64) - set(exp.params))
        if missing:
            raise StageError(f"{len(missing)} parameters with a torch gradient are not "
                             f"trained by ngdist, e.g. {missing[:3]}")
        extra = sorted(n for n in exp.params if n not in g64 and np.any(got.get(f"{n}.grad", 0)))
        if extra:
            raise StageError(f"{len(extra)} parameters that torch gives no gradient (read under "
                             f"torch.no_grad or detached) get one from ngdist, e.g. {extra[:3]}")
        if abs(float(got["loss"]) - loss) > max(TOL * max(abs(loss), 1.0),
                                                FACTOR * abs(loss32 - loss)):
            raise StageError(f"loss {float(got['loss']):.6g}, torch float64 {loss:.6g}, "
                             f"float32 {loss32:.6g}")
        broken = sorted(n for n, g in g64.items() if not np.isfinite(g).all())
        if broken:
            raise StageError(f"no float64 oracle: torch's float64 gradients of {len(broken)} "
                             f"parameters are not finite, e.g. {broken[:3]}")
        errors, vs32 = gradient_errors(got, g64), gradient_errors(got, g32)
        err, own32, bad = judge_over_runs(errors, vs32, ref["runs"], torch_oracle, runs)
    own = largest_of_runs(ref["runs"])
    out.update(grad_err=err, torch32_err=own32, params=len(g64),
               torch32_runs=list(ref["runs"]), grad_spread=spread(errors, ref["runs"]))
    if bad:
        sign = _kink_sign(bad, errors, ref["runs"]["default"],
                          lambda n: (got[f"{n}.grad"], g64[n], 0.0))
        raise StageError(f"gradient of {bad} {errors[bad]:.2e} from float64 (torch float32: "
                         f"{own[bad]:.1e}){sign}")
    return g64, g32


def stages_or_second_batch(module: Any, feeds: dict[str, np.ndarray], loss_fn: Any,
                           out: dict[str, Any]) -> tuple[Any, dict[str, np.ndarray]]:
    """``stages`` (the gradients, SGD's and AdamW's steps); where one fails with a kink's
    sign (``_kink_sign``: a tensor off in one slice alone) and the batch has float
    inputs, all of them once more on a second batch of those (the same shapes, seed 1): an
    activation within float32's error of a kink (a ReLU input, a max-pool window's two
    largest values) is one point of input space, a wrong rule fails there too. The first
    batch's failure stays in the row (``first_batch``). Returns the AdamW trainer and the
    batch the stages passed on."""
    try:
        return stages(module, feeds, loss_fn, out), feeds
    except StageError as exc:
        if "; 1 of " not in str(exc) or not any(v.dtype.kind == "f" for v in feeds.values()):
            raise
        out["first_batch"] = f"{out['stage']}: {exc}"
    gc.collect()  # the first batch's trainers
    rng = np.random.default_rng(1)
    feeds = {k: rng.standard_normal(v.shape).astype(v.dtype) if v.dtype.kind == "f" else v
             for k, v in feeds.items()}
    return stages(module, feeds, loss_fn, out), feeds


def stages(module: Any, feeds: dict[str, np.ndarray], loss_fn: Any, out: dict[str, Any]
           ) -> Any:
    """The gradients, then 3 steps of SGD, then 3 of AdamW; returns the AdamW trainer."""
    check_gradients(module, feeds, loss_fn, out)
    check_training(module, feeds, loss_fn, "sgd", out)
    gc.collect()  # the SGD trainer's sessions, before AdamW's are made
    return check_training(module, feeds, loss_fn, "adamw", out)


def _slices(got: np.ndarray, exact: np.ndarray, scale: float = 0.0) -> str:
    """How many of the gradient's (or trained state's) slices along axis 0 (output channels,
    rows) are out of bound, and how close the others are, relative to ``scale`` (default: the
    exact tensor's largest entry): one channel off says one activation took the other side
    of a kink (a ReLU input within float32's error of 0), not a wrong formula."""
    counted = _slice_count(got, exact, scale, TOL)
    return "" if counted is None else f"; {counted[0]} of {counted[1]} slices along axis 0 " \
                                      f"off, the rest within {counted[2]:.1e}"


def _slice_count(got: np.ndarray, exact: np.ndarray, scale: float, bound: float
                 ) -> tuple[int, int, float] | None:
    """(slices along axis 0 past ``bound``, slices, the largest error of the others), errors
    relative to ``scale`` (default: the exact tensor's largest entry); None for a tensor of
    fewer than 2 slices."""
    if got.ndim < 1 or got.shape[0] < 2:  # (a bias's slices are its entries)
        return None
    scale = max(scale or finite_max(exact), 1e-30)
    per = off(got, exact).reshape(got.shape[0], -1).max(1) / scale
    outside = per > bound
    return int(outside.sum()), got.shape[0], float(per[~outside].max(initial=0.0))


def _kink_sign(worst: str, errors: dict[str, float], default: dict[str, float],
               pair: Any) -> str:
    """``_slices`` of the worst tensor ``worst``; where that is more than one slice, also the
    tensor nearest the loss (last in ``errors``) that is past ``FACTOR`` x torch's default
    float32 error of it in one slice alone: a kink shows in the one channel next to it (an
    error that can stay below the bound of a trained state), the tensors before it inherit
    it in many slices. ``pair(name)`` is (got, exact, scale) of a tensor."""
    found = _slices(*pair(worst))
    if found.startswith("; 1 of "):
        return found
    for name in reversed(errors):
        bound = FACTOR * max(default.get(name, 0.0), 1e-7)
        if name == worst or not errors[name] > bound:
            continue
        counted = _slice_count(*pair(name), bound)
        if counted is not None and counted[0] == 1:
            return f"{found}; 1 of {counted[1]} slices of {name} along axis 0 past {FACTOR:g}x " \
                   f"torch's float32 error ({bound / FACTOR:.1e}), the rest within {counted[2]:.1e}"
    return found


def check_training(module: Any, feeds: dict[str, np.ndarray], loss_fn: Any, opt: str,
                   out: dict[str, Any]) -> Any:
    """3 steps of ``opt`` through ngdist (``trainer.to_torch()`` after each: parameters,
    buffers and the optimizer's state), each against torch's step from the state ngdist
    reached: a float32 trajectory can part from float64 faster than rounding (a kink crossed
    on one side only; measured 30x a step on timm's gernet_s, torch's own float32 as much), so
    whole trajectories would compare chaos. Returns the trainer."""
    import torch

    import ngdist
    from ngdist.runtime.state import release_freed_memory

    make_opt = {"sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
                "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1)}[opt]
    out["stage"] = opt
    mine_module = copy.deepcopy(module)
    optimizer = make_opt(mine_module.parameters())
    inputs = module_inputs(feeds, loss_fn)
    trainer = ngdist.compile(mine_module, _tensors(inputs), loss=loss_fn, optimizer=optimizer,
                             strategy="local", intra_op_threads=1, input_names=list(inputs))
    worst = own_worst = 0.0
    runs = float32_runs(module, feeds)
    for step in range(1, 4):
        before = _state(mine_module)

        with Oracle(step_oracle(mine_module, optimizer, feeds, loss_fn, make_opt, opt,
                                before)) as torch_oracle:
            ref = torch_oracle.ask(runs[:1])
            trainer.step(feeds, fetch_stats=False)
            trainer.to_torch()
            mine = _state(mine_module)
            errors, (err, own32, bad) = _judged_step(mine, before, ref, torch_oracle, runs,
                                                     f"{opt} step {step}")
            if bad and opt == "adamw":  # noise entries from every float32 run, judged again
                ref.update(torch_oracle.ask((WIDER, *runs)))
                errors, (err, own32, bad) = _judged_step(mine, before, ref, torch_oracle, runs,
                                                         f"{opt} step {step}")
            noise, ref64 = ref["noise"], ref["ref64"]
        own = largest_of_runs(ref["runs"])
        worst, own_worst = max(worst, err), max(own_worst, own32)
        tight = spread(errors, ref["runs"], step)
        if tight["default_ratio"] >= out.get(f"{opt}_spread", tight)["default_ratio"]:
            out[f"{opt}_spread"] = tight
        if bad:
            scale = scales(ref64, before)
            sign = _kink_sign(bad, errors, ref["runs"]["default"],
                              lambda n: (np.where(noise.get(n, False), ref64[n], mine[n]),
                                         ref64[n], scale[n]))  # (noise is not compared)
            raise StageError(f"{opt} step {step}: {bad} {errors[bad]:.2e} from float64 (torch "
                             f"float32: {own[bad]:.1e}){sign}")
        del ref, noise, ref64
        release_freed_memory()  # the oracle's freed blocks, so the cap measures the model
    out[f"{opt}_err"], out[f"{opt}_torch32_err"] = worst, own_worst
    return trainer


def _judged_step(mine: dict[str, np.ndarray], before: dict[str, np.ndarray],
                 ref: dict[str, Any], oracle: Oracle, runs: tuple[str, ...], where: str
                 ) -> tuple[dict[str, float], tuple[float, float, str | None]]:
    """ngdist's state after a step (``mine``, from ``before``) against the step oracle's
    answer ``ref``: each tensor's error and ``judge_over_runs``'s verdict. Noise entries
    (AdamW's) may move up to twice the model's largest update, no more."""
    noise, ref64 = ref["noise"], ref["ref64"]
    moved = max(max_off(ref64[k], before[k], finite=True) for k in ref64)
    for k, mask in noise.items():
        if max_off(mine[k], before[k], mask) > 2 * moved + 1e-12:
            raise StageError(f"{where}: {k} entries with a zero gradient moved more than "
                             "twice the model's largest update")
    errors = state_errors(mine, ref64, before, noise)
    return errors, judge_over_runs(errors, state_errors(mine, ref["ref32"], before, noise),
                                   ref["runs"], oracle, runs)


def time_steps(trainer: Any, module: Any, feeds: dict, loss_fn: Any,
               out: dict[str, Any], steps: int = 3, rounds: int = 2) -> None:
    import torch

    out["stage"] = "timing"
    eager = copy.deepcopy(module)
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-4, weight_decay=0.1)
    tensors = _tensors(feeds)

    def torch_step() -> None:
        opt.zero_grad()
        loss_of(eager, loss_fn, tensors).backward()
        opt.step()

    def timed(fn) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - start) / steps

    torch_step()
    best_ng = best_pt = float("inf")
    for _ in range(rounds):
        best_ng = min(best_ng, timed(lambda: trainer.step(feeds, fetch_stats=False)))
        best_pt = min(best_pt, timed(torch_step))
    out.update(ngdist_ms=best_ng * 1e3, torch_ms=best_pt * 1e3, ratio=best_ng / best_pt)


def check(case: Any) -> dict[str, Any]:
    """Every stage of ``case``; the first that fails ends it (``status`` "fail", ``stage``,
    ``error``)."""
    import torch

    from ngdist.runtime.state import release_freed_memory

    torch.set_num_threads(1)
    out: dict[str, Any] = {"name": case.name, "family": case.family, "source": case.source,
                           "status": "fail", "stage": "build"}
    try:
        module, feeds, loss_fn = case.make()
        with torch.no_grad():  # a model that does not take the sweep's inputs, or does not
            # run in float64 (no oracle: fsmt fills float32's -inf), is not built
            float(loss_of(copy.deepcopy(module), loss_fn, _tensors(feeds)))
            float(loss_of(to_float64(copy.deepcopy(module)), loss_fn, _tensors(feeds, True)))
        release_freed_memory()
        trainer, feeds = stages_or_second_batch(module, feeds, loss_fn, out)
        time_steps(trainer, module, feeds, loss_fn, out)
    except Exception as exc:  # noqa: BLE001 - every failure is a row of the table
        out.update(describe(exc))
        if out["stage"] == "build" and isinstance(exc, ImportError):
            out["error"] = f"not built: {missing_package(exc)}"
        return out
    out.update(status="pass", stage="")
    return out
