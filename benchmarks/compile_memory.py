"""Where the memory of a torch model's compile goes: resident peak per stage.

Compiles one model of the sweep (benchmarks/model_sweep.py: its module, batch and loss) the way
the sweep's SGD stage does (``ngdist.compile(..., strategy="local")``, torch's SGD with
momentum, one thread) and reports, per stage, the resident size when it began, the resident peak
while it ran and the resident size when it ended (MiB). The peak comes from the kernel's own
high-water mark (``VmHWM``, reset between stages through ``/proc/self/clear_refs``), so a
spike between two samples is not missed. Stages nest: the export inside the training model,
each pass inside the passes, the executor inside the trainer.

``--oracle`` also measures what the sweep's own checks cost beside ngdist: one forward and
backward of the model in eager torch, float32 and float64 (the gradient oracle). ``--sweep``
runs the sweep's whole check of the model instead (benchmarks/sweep_check.py: gradients
against torch, 3 steps of SGD and of AdamW, timing), its stages measured too.

    python benchmarks/compile_memory.py tv/alexnet
    python benchmarks/compile_memory.py timm/beit_base_patch16_224 --oracle
    python benchmarks/compile_memory.py tv/maxvit_t --sweep
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent),
                str(Path(__file__).resolve().parents[1] / "tests")]

MIB = 1 << 20


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1)) << 10  # type: ignore[union-attr]


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


class Stages:
    """Nested stages, each with its resident size at the start and end and its peak."""

    current: Stages | None = None  # what a stop past the resident cap prints

    def __init__(self) -> None:
        self.stack: list[dict[str, Any]] = []
        self.rows: list[dict[str, Any]] = []
        Stages.current = self

    def _account(self) -> None:
        peak = _status("VmHWM")
        for frame in self.stack:
            frame["peak"] = max(frame["peak"], peak)

    @contextlib.contextmanager
    def stage(self, label: str) -> Iterator[None]:
        self._account()
        _reset_peak()
        start = _status("VmRSS")
        row = {"stage": label, "depth": len(self.stack), "start": start, "peak": start}
        self.rows.append(row)
        self.stack.append(row)
        try:
            yield
        finally:
            self._account()
            self.stack.pop()
            row["end"] = _status("VmRSS")

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        """``owner.attr`` (a function or class) measured as stage ``label`` at every call."""
        inner = getattr(owner, attr)

        @functools.wraps(inner)
        def measured(*args: Any, **kwargs: Any) -> Any:
            with self.stage(label):
                return inner(*args, **kwargs)

        setattr(owner, attr, measured)

    def table(self) -> str:
        lines = [f"{'stage':<44} {'start':>7} {'peak':>7} {'end':>7} {'peak-start':>10}"]
        for r in self.rows:
            r.setdefault("end", r["peak"])
            name = "  " * r["depth"] + r["stage"]
            lines.append(f"{name:<44} {r['start'] / MIB:7.0f} {r['peak'] / MIB:7.0f} "
                         f"{r['end'] / MIB:7.0f} {(r['peak'] - r['start']) / MIB:10.0f}")
        return "\n".join(lines)


def instrument(stages: Stages) -> None:
    """Every stage of the compile path wrapped (module attributes, looked up at call time)."""
    import onnx
    import onnx_ir as ir

    import ngdist.api as api
    from ngdist.frontends import cleanup, onnx as fonnx, torch as ftorch, torch_loss
    from ngdist.ir import model as irmodel
    from ngdist.runtime import state, step_executor, trainer

    for owner, attr, label in (
            (ftorch, "training_model", "frontend: training model"),
            (ftorch, "_export_with_loss", "export (both modes)"),
            (ftorch, "export_training", "torch.onnx export, training"),
            (torch_loss, "export_with_loss", "torch.onnx export, training + loss"),
            (ftorch, "export_graph", "torch.onnx export, eval"),
            (ftorch, "rename_initializers", "rename initializers"),
            (ftorch, "fold_static_shapes", "fold static shapes (export)"),
            (fonnx, "build_training_model", "build training model"),
            (fonnx, "normalize_forward", "normalize forward"),
            (fonnx, "fold_static_shapes", "fold static shapes (normalize)"),
            (onnx.shape_inference, "infer_shapes", "onnx shape inference"),
            (ftorch, "unbiased_running_var", "unbiased running var"),
            (fonnx, "use_inference_graph", "use inference graph"),
            (api, "split_training_model", "split training model"),
            (irmodel, "check_proto", "onnx checker (load)"),
            (api, "run_passes", "passes"),
            (api, "Trainer", "trainer"),
            (trainer, "make_executor", "executor (plan)"),
            (trainer.Trainer, "_start_state", "values placed"),
            (state.StateAccess, "_drop_template_data", "template data dropped"),
            (trainer.Trainer, "step", "step")):
        stages.wrap(owner, attr, label)
    del cleanup, step_executor
    original = ir.passes.PassBase.__call__

    def call(self: Any, model: Any) -> Any:
        with stages.stage(f"pass {type(self).__name__}"):
            return original(self, model)

    ir.passes.PassBase.__call__ = call  # type: ignore[method-assign]


def oracle(stages: Stages, module: Any, feeds: dict[str, Any], loss_fn: Any) -> None:
    """One forward and backward in eager torch, float32 then float64 (the sweep's oracle)."""
    from sweep_check import _tensors, loss_of, to_float64

    for label, float64 in (("torch float32 forward+backward", False),
                           ("torch float64 forward+backward", True)):
        with stages.stage(label):
            ref = copy.deepcopy(module)
            if float64:
                to_float64(ref)
            loss_of(ref, loss_fn, _tensors(feeds, float64)).backward()
            del ref


def instrument_sweep(stages: Stages) -> None:
    """The sweep check's own stages (benchmarks/sweep_check.py) wrapped too."""
    import step_probe
    import sweep_check
    import sweep_steps

    for owner, attr, label in (
            (sweep_check, "check_gradients", "sweep: gradients"),
            (step_probe, "run_step", "sweep: ngdist gradients (run_step)"),
            (sweep_check, "torch_grads", "sweep: torch gradients"),
            (sweep_check, "check_training", "sweep: 3 steps"),
            (sweep_steps, "torch_grads", "sweep: torch gradients of a step's noise entries"),
            (sweep_steps, "torch_step", "sweep: torch step"),
            (sweep_check, "time_steps", "sweep: timing"),
            (sweep_check.Oracle, "ask", "sweep: the oracle's answer received"),
            (sweep_check, "_state", "sweep: the state copied"),
            (sweep_check, "_judged_step", "sweep: a step judged")):
        stages.wrap(owner, attr, label)


def sweep(name: str) -> Stages:
    from model_sweep import find_case
    from sweep_check import check

    stages = Stages()
    instrument(stages)
    instrument_sweep(stages)
    with stages.stage("sweep check"):
        row = check(find_case(name, name))
    print(json.dumps(row, default=float))
    return stages


def run(name: str, with_oracle: bool, steps: int) -> Stages:
    import torch

    import ngdist
    from model_sweep import find_case
    from sweep_check import _tensors, module_inputs

    torch.set_num_threads(1)
    case = find_case(name, name)
    stages = Stages()
    with stages.stage("build case"):
        module, feeds, loss_fn = case.make()
    params = sum(p.numel() for p in module.parameters())
    print(f"{name}: {params / 1e6:.1f} M parameters ({params * 4 / MIB:.0f} MiB float32), "
          f"input {({k: v.shape for k, v in feeds.items()})}", flush=True)
    if with_oracle:
        oracle(stages, module, feeds, loss_fn)
    instrument(stages)
    inputs = module_inputs(feeds, loss_fn)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-2, momentum=0.9)
    with stages.stage("ngdist.compile"):
        trainer = ngdist.compile(module, _tensors(inputs), loss=loss_fn, optimizer=optimizer,
                                 strategy="local", intra_op_threads=1, input_names=list(inputs))
    for _ in range(steps):
        trainer.step(feeds, fetch_stats=False)
    return stages


def cap_resident(mb: int) -> None:
    """Ends the process (exit status 3) once it holds more than ``mb`` MiB resident (checked
    five times a second): the host is shared."""
    import os
    import threading
    import time

    def watch() -> None:
        while True:
            if _status("VmRSS") > mb * MIB:
                stages = Stages.current
                for frame in stages.stack if stages is not None else []:
                    frame["peak"] = max(frame["peak"], _status("VmHWM"))
                    frame["end"] = _status("VmRSS")
                print((stages.table() if stages is not None else "") +
                      f"\nmore than {mb} MiB resident: stopped", flush=True)
                os._exit(3)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", help="a sweep case name, e.g. tv/alexnet")
    ap.add_argument("--oracle", action="store_true", help="measure torch's own fwd+bwd too")
    ap.add_argument("--sweep", action="store_true", help="the sweep's whole check, measured")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--cap-mb", type=int, default=9216, help="stop past this many MiB resident")
    args = ap.parse_args(argv)
    cap_resident(args.cap_mb)
    stages = sweep(args.case) if args.sweep else run(args.case, args.oracle, args.steps)
    print(stages.table())
    print(f"process peak (VmHWM since the last stage): {_status('VmHWM') / MIB:.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps(stages.rows, indent=1))


if __name__ == "__main__":
    main()
