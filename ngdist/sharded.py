"""``ngdist.compile(..., shard=...)``: the sharded step for this job's rank count, a trainer
for it, and each rank's shard of the optimizer state and (ZeRO-3) of the parameters
(passes/shard.py, runtime/sharding.py)."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from ngdist.comm.group import ProcessGroup
from ngdist.errors import OptionError
from ngdist.ir.model import get_meta
from ngdist.passes.options import AllReduceOptions
from ngdist.passes.pipeline import run_passes
from ngdist.passes.step_options import StepOptions
from ngdist.runtime.sharding import ShardedState, layout
from ngdist.runtime.trainer import Trainer

logger = logging.getLogger(__name__)


def compile_sharded(inference: onnx.ModelProto, step: ir.Model, chosen: AllReduceOptions,
                    group: ProcessGroup, gradients: StepOptions, runtime: dict[str, Any],
                    write_back: Any) -> Trainer:
    """The Trainer of ``step`` under ``chosen`` (whose ``shard`` is set) on ``group``."""
    if runtime.get("checkpoint_dir") is not None:
        raise OptionError(f"shard={chosen.shard!r} cannot write periodic checkpoints yet; "
                          "leave checkpoint_dir= out and call trainer.save(path) on every rank "
                          "(it gathers the optimizer state into a standard model)")
    if chosen.shard_ranks not in (0, group.size):
        raise OptionError(f"shard_ranks={chosen.shard_ranks} but this job has {group.size} "
                          "ranks; leave shard_ranks out")
    chosen = dataclasses.replace(chosen, shard_ranks=group.size)
    meta = get_meta(step)
    full = {n: step.graph.initializers[n].const_value.numpy()
            for n in (*meta.names("state"), *meta.names("param"))
            if n in step.graph.initializers}
    # saved files hold the training model as given (before autodiff and comm), so they resume
    # under any strategy, shard= and rank count
    original = ir.from_proto(ir.to_proto(step))
    step = run_passes(step, chosen, gradients=gradients)
    trainer = Trainer(inference, step=step, group=group, write_back=write_back, **runtime)
    plan = layout(step)
    assert plan is not None
    state = ShardedState(plan, original)
    state.attach(trainer, full)
    _drop_whole_parameters(trainer, state)
    return trainer


def _drop_whole_parameters(trainer: Trainer, state: ShardedState) -> None:
    """ZeRO-3: the whole parameters' data dropped from the models kept as templates (the
    inference model, the step compiled from), which are filled with the gathered values when
    used, so a rank holds 1/N of them between steps."""
    names = set(state.parameter_names)
    for t in trainer.inference.graph.initializer:
        if t.name in names:
            t.ClearField("raw_data")
            for f in ("float_data", "double_data", "int32_data", "int64_data"):
                t.ClearField(f)
    inits = state.plain_step.graph.initializers
    for n in names & set(inits):
        dtype = inits[n].const_value.dtype  # type: ignore[union-attr]
        inits[n].const_value = ir.tensor(np.zeros(0, dtype.numpy()), name=n)
