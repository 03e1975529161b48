"""``ngdist.compile(..., shard=...)``: the sharded step for this job's rank count, a trainer
for it, and each rank's shard of the optimizer state (passes/shard.py, runtime/sharding.py)."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

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
            for n in meta.names("state") if n in step.graph.initializers}
    # saved files hold the training model as given (before autodiff and comm), so they resume
    # under any strategy, shard= and rank count
    original = ir.from_proto(ir.to_proto(step))
    step = run_passes(step, chosen, gradients=gradients)
    trainer = Trainer(inference, step=step, group=group, write_back=write_back, **runtime)
    plan = layout(step)
    assert plan is not None
    ShardedState(plan, original).attach(trainer, full)
    return trainer
