"""CPU seconds of ``ngdist.compile`` and of the first training steps of model sweep cases, by
phase: the two torch.onnx exports (training and eval mode), the shape folding of the exported
graphs (its probe sessions and runs), the check of a trace that converted tensors to Python
values, the compiler's passes, the Trainer's start (template
copies without data, the step plan), onnxruntime's session creation, and the steps.

    python benchmarks/compile_time.py [hf/causal/bailing_hybrid ...] [--steps 3] [--reuse-plan]
        [--compiles 3] [--no-probe-cache]

Each case runs in a process of its own (cProfile with a CPU-time clock: a phase's CPU-s are
its cumulative time, so nested phases count in both; the profiler's own cost is in the
Python-heavy phases). AdamW, ``strategy="local"``, one onnxruntime thread, as the sweep's
trainers; the torch module, batch and loss come from the sweep's case (benchmarks/model_sweep.py).
``--reuse-plan``: every session with onnxruntime's memory-reuse plan, as before sessions of
large graphs were made without it (runtime/sessions.py, ``REUSE_PLAN_MAX_NODES``).
``--compiles N``: the case compiled N times in the process (a fresh copy of the module each, as
the sweep's gradient check, SGD and AdamW trainers), the steps after the last one;
``--no-probe-cache``: every shape probe run, none answered from kept results
(frontends/shape_probes.py, ``CACHED``).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

# phase -> (file suffix, function name) of the function whose cumulative CPU time it is
PHASES = {
    "torch.onnx.export": ("torch/onnx/__init__.py", "export"),
    "shape folding": ("ngdist/frontends/cleanup.py", "fold_static_shapes"),
    "its probe sessions": ("ngdist/frontends/shape_probes.py", "_run"),
    "traced-value check": ("ngdist/frontends/torch_trace_check.py", "traced_from_data"),
    "passes": ("ngdist/passes/pipeline.py", "run_passes"),
    "trainer start": ("ngdist/runtime/trainer.py", "__init__"),
    "onnxruntime sessions": ("onnxruntime_inference_collection.py", "_create_inference_session"),
}


def _phases(profile: cProfile.Profile) -> dict[str, float]:
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    out = {}
    for phase, (suffix, name) in PHASES.items():
        out[phase] = round(sum(v[3] for (path, _, fn), v in stats.items()
                               if path.endswith(suffix) and fn == name), 1)
    return out


def measure(name: str, steps: int, reuse_plan: bool = False, compiles: int = 1,
            probe_cache: bool = True) -> dict[str, Any]:
    """The case's compiles and its first ``steps`` steps, phase by phase (CPU-s)."""
    import copy

    import torch
    from model_sweep import find_case
    from sweep_check import _tensors, module_inputs

    import ngdist
    from ngdist.frontends import shape_probes
    from ngdist.runtime import sessions

    if not probe_cache:
        shape_probes.CACHED = 0
    if reuse_plan:
        sessions.REUSE_PLAN_MAX_NODES = sys.maxsize
    torch.set_num_threads(1)
    module, feeds, loss_fn = find_case(name, name).make()
    inputs = module_inputs(feeds, loss_fn)
    row: dict[str, Any] = {"model": name, "reuse_plan": "all" if reuse_plan else "small",
                           "probe_cache": probe_cache}
    for k in range(compiles):
        mine = copy.deepcopy(module)
        profile = cProfile.Profile(time.process_time)
        start = time.process_time()
        profile.enable()
        trainer = ngdist.compile(mine, _tensors(inputs), loss=loss_fn,
                                 optimizer=torch.optim.AdamW(mine.parameters(), lr=1e-4),
                                 strategy="local", intra_op_threads=1, input_names=list(inputs))
        profile.disable()
        row["compile" if compiles == 1 else f"compile {k + 1}"] = {
            "total": round(time.process_time() - start, 1), **_phases(profile)}
    for k in range(steps):
        profile = cProfile.Profile(time.process_time)
        start = time.process_time()
        profile.enable()
        trainer.step(feeds, fetch_stats=False)
        profile.disable()
        row[f"step {k + 1}"] = {"total": round(time.process_time() - start, 2),
                                **{p: s for p, s in _phases(profile).items() if s}}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", default=["hf/causal/bailing_hybrid"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--reuse-plan", action="store_true")
    p.add_argument("--compiles", type=int, default=1)
    p.add_argument("--no-probe-cache", action="store_true")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.steps, args.reuse_plan, args.compiles,
                                 not args.no_probe_cache)))
        return
    for name in args.models:  # a process each: one model's imports and caches not another's
        out = subprocess.run([sys.executable, __file__, "--one", name, "--steps",
                              str(args.steps), "--compiles", str(args.compiles),
                              *(["--reuse-plan"] if args.reuse_plan else []),
                              *(["--no-probe-cache"] if args.no_probe_cache else [])],
                             capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
