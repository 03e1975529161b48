"""``ngdist.compile(..., shard=...)``: the sharded step for this job's rank count, a trainer
for it, and each rank's shard of the optimizer state and (ZeRO-3) of the parameters
(passes/shard.py, runtime/sharding.py)."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import onnx
import onnx_ir as ir

from ngdist.comm.group import ProcessGroup
from ngdist.errors import OptionError
from ngdist.ir.model import get_meta, without_tensor_data
from ngdist.passes.options import AllReduceOptions
from ngdist.passes.pipeline import run_passes
from ngdist.passes.step_options import StepOptions
from ngdist.ir.shards import file_layout, layout, unpack
from ngdist.runtime.sharding import ShardedState
from ngdist.runtime.state import release_freed_memory, without_data
from ngdist.runtime.trainer import Trainer

logger = logging.getLogger(__name__)


def compile_sharded(inference: onnx.ModelProto, step: ir.Model, chosen: AllReduceOptions,
                    group: ProcessGroup, gradients: StepOptions, runtime: dict[str, Any],
                    write_back: Any) -> Trainer:
    """The Trainer of ``step`` under ``chosen`` (whose ``shard`` is set, or the step is of a
    file written by ``ngdist rewrite --shard``) on ``group``."""
    if runtime.get("checkpoint_dir") is not None:
        raise OptionError(f"shard={chosen.shard!r} cannot write periodic checkpoints yet (rank "
                          "0 writes them alone from its own values, and a sharded rank holds "
                          "only its slices); leave checkpoint_dir= out and call "
                          "trainer.save(path) on every rank (it gathers a standard model)")
    plan = file_layout(inference)
    if plan is not None and not isinstance(chosen, AllReduceOptions):
        raise OptionError(f"the file is sharded by ngdist rewrite --shard, which the "
                          f"allreduce strategy trains, not {chosen.strategy!r}; leave "
                          "strategy= out")
    if chosen.shard_ranks not in (0, group.size):
        raise OptionError(f"shard_ranks={chosen.shard_ranks} but this job has {group.size} "
                          "ranks; leave shard_ranks out")
    chosen = dataclasses.replace(chosen, shard_ranks=group.size)
    if plan is not None:
        return _compile_rewritten(inference, step, plan, chosen, group, gradients, runtime,
                                  write_back)
    meta = get_meta(step)
    # the tensors (no copy: each is read when this rank cuts its slices from it)
    full = {n: step.graph.initializers[n].const_value
            for n in (*meta.names("state"), *meta.names("param"))
            if n in step.graph.initializers}
    # saved files hold the training model as given (before autodiff and comm), so they resume
    # under any strategy, shard= and rank count
    # (without the values' data: filled from the values when saved)
    original = without_data(step, set(full), keep=True)
    step = run_passes(step, chosen, gradients=gradients)
    plan = layout(step)
    assert plan is not None
    state = ShardedState(plan, original)
    del original
    return _trainer(inference, step, state, full, group, runtime, write_back)


def _trainer(inference: onnx.ModelProto, step: ir.Model, state: ShardedState,
             full: dict[str, Any], group: ProcessGroup, runtime: dict[str, Any],
             write_back: Any) -> Trainer:
    """The trainer of the sharded ``step`` with this rank's slices of the per-parameter
    values ``full`` (arrays or tensors), cut (and ``full`` emptied) before the trainer is
    made: a rank holds the whole values only while it cuts its slices."""
    inits = step.graph.initializers
    slices = state.slices(full, group.rank,
                          lambda n: inits[n].const_value.dtype.numpy())  # type: ignore[union-attr]
    full.clear()
    # (nor does the inference model: the trainer fills it with its values when used)
    inference = without_tensor_data(inference, state.whole_names().__contains__)
    release_freed_memory()
    trainer = Trainer(inference, step=step, group=group, write_back=write_back, **runtime)
    state.attach(trainer, slices)
    del slices
    _drop_copies(trainer, state)
    return trainer


def _compile_rewritten(inference: onnx.ModelProto, step: ir.Model, plan: dict[str, Any],
                       chosen: AllReduceOptions, group: ProcessGroup, gradients: StepOptions,
                       runtime: dict[str, Any], write_back: Any) -> Trainer:
    """A sharded file's step as it is (its passes ran in ``ngdist rewrite``), each rank
    taking its slices of the whole flats the file holds."""
    if chosen.shard not in ("none", plan["level"]):
        raise OptionError(f"the file is sharded (shard={plan['level']!r} for {plan['ranks']} "
                          f"ranks by ngdist rewrite); leave shard= out, or rewrite the "
                          f"training model with --shard {chosen.shard}")
    if int(plan["ranks"]) != group.size:
        raise OptionError(f"the file is sharded for {plan['ranks']} ranks (ngdist rewrite "
                          f"--shard-ranks) but this job has {group.size}; run it on "
                          f"{plan['ranks']} ranks or rewrite it with --shard-ranks "
                          f"{group.size}")
    full = unpack(step, plan)
    step = run_passes(step, dataclasses.replace(chosen, shard="none"), gradients=gradients)
    return _trainer(inference, step, ShardedState(plan, None), full, group, runtime,
                    write_back)


def _drop_copies(trainer: Trainer, state: ShardedState) -> None:
    """The data of every tensor the trainer's values hold (or, ZeRO-3, gather) dropped from
    the models it keeps as templates (runtime/state.py), the step compiled from included."""
    names = set(trainer.values) | state.whole_names()
    trainer._drop_template_data(names)
    if state.plain_step is not None:
        state.plain_step = without_data(state.plain_step, names)
    release_freed_memory()
