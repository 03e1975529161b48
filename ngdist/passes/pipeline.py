"""Strategies as named pass pipelines, and the functions that run them.

``allreduce``: autodiff -> AllReduce insertion (gradients, then buffer averages) -> bucketing
-> optimizer lowering.
``allreduce`` with ``reproducible_micro_batch=M``: the same with ``all_reduce_alg="exact"`` and
the reproducible-mode pass (exact loss average, micro-batch size on the exact AllReduce nodes)
before bucketing.
``allreduce`` with ``compression="fp16"|"bf16"``: the same, then the compression pass (each
AllReduce's input cast to 16 bits and its result back to float32).
``allreduce`` with ``shard="optimizer"|"gradients"``: the same, then the sharding pass (each
bucket ReduceScatter'ed, updated by shards, AllGather'ed; passes/shard.py).
``local``: autodiff -> optimizer lowering (one process, no communication).
``pushsum``, ``ps`` and ``simple``: their comm pass between autodiff and optimizer lowering.
A loss that is a mean over counted tokens (ignore_index, class weights, a mask) is divided by
the global batch's count under ``allreduce`` and ``simple`` (passes/losscount.py), refused
under ``ps`` and in reproducible mode, and left to each rank's own mean under ``pushsum``.
Each factory takes its strategy's typed options (passes/options.py); nothing is swallowed.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import onnx
import onnx_ir as ir

from ngdist.errors import NgdistError
from ngdist.ir.model import assemble_training_model, split_training_model
from ngdist.ir.shards import layout, pack
from ngdist.passes import accumulate, shard
from ngdist.passes.allreduce import AllReduceInsertionPass
from ngdist.passes.autodiff import AutodiffPass
from ngdist.passes.bucketing import BucketingPass
from ngdist.passes.clipping import GradientClippingPass, check_strategy
from ngdist.passes.compression import (COMPRESSED_ALGORITHMS, CompressionMarkingPass,
                                       GradientCompressionPass)
from ngdist.passes.buffers import BufferAverageInsertionPass
from ngdist.passes.gradscale import GradientPrescalePass
from ngdist.passes.losscount import CountedLossPass, GlobalCountPass
from ngdist.passes.manager import StepPassManager
from ngdist.passes.optimizers import OptimizerLoweringPass
from ngdist.passes.options import (AllReduceOptions, LocalOptions, OptionError, PSOptions,
                                   PushSumOptions, SimpleOptions, StrategyOptions,
                                   strategy_options, unknown_strategy)
from ngdist.passes.pushsum import PushSumPass
from ngdist.passes.reproducible import ReproducibleMicroBatchPass
from ngdist.passes.ps import PSPushPullPass
from ngdist.passes.simple import CentralReducePass
from ngdist.passes.step_options import StepOptions

logger = logging.getLogger(__name__)

PipelineFactory = Callable[[Any], list[ir.passes.PassBase]]
# passes that rewrite the loss, run before autodiff (in this order)
BEFORE_AUTODIFF = (CountedLossPass, GradientPrescalePass)
REPRODUCIBLE_COUNT = (
    "reproducible mode averages the losses of micro-batches, and a micro-batch's mean over its "
    "own counted tokens is not the global batch's: leave reproducible_micro_batch out, or "
    "write the loss as a sum divided by a fixed number")
PS_COUNT = (
    "the ps strategy cannot divide it by the count of the whole global batch (its shard owners "
    "may not run the forward pass): train with strategy='allreduce' or 'simple', or write the "
    "loss as a sum divided by a fixed number")


def _allreduce(o: AllReduceOptions) -> list[ir.passes.PassBase]:
    algorithm = o.all_reduce_alg
    reproducible: list[ir.passes.PassBase] = []
    if o.reproducible_micro_batch:  # rank-count-independent training (passes/reproducible.py)
        if algorithm not in ("mpi", "exact"):  # "mpi": the default, i.e. not chosen
            raise OptionError(f"reproducible_micro_batch needs all_reduce_alg='exact' (the "
                              f"only order-independent sum), not {algorithm!r}")
        algorithm = "exact"
        reproducible = [ReproducibleMicroBatchPass(o.reproducible_micro_batch)]
    # the mean as a sum of gradients prescaled by 1/N (passes/gradscale.py); reproducible
    # mode keeps the exact kernel's own mean
    prescale = [] if reproducible else [GradientPrescalePass()]
    marking: list[ir.passes.PassBase] = []
    compression: list[ir.passes.PassBase] = []
    if o.compression != "none":  # 16-bit copies on the wire (passes/compression.py)
        if reproducible:
            raise OptionError(f"compression={o.compression!r} cannot be combined with "
                              "reproducible_micro_batch: reproducible mode sums the float32 "
                              "gradients exactly, rounding them to 16 bits would undo it; "
                              "leave one of the two out")
        if algorithm not in COMPRESSED_ALGORITHMS:
            raise OptionError(f"compression={o.compression!r} cannot run with "
                              f"all_reduce_alg={algorithm!r} (16-bit buffers are summed by "
                              f"ngdist's ring or recursive doubling, 'mpi' picks the ring); "
                              f"choose one of {list(COMPRESSED_ALGORITHMS)}")
        marking = [CompressionMarkingPass(o.compression)]
        compression = [GradientCompressionPass(o.compression_error_feedback)]
    # a mean over counted tokens divided by the global count (passes/losscount.py), whose
    # AllReduce comes after bucketing and compression
    counted = [CountedLossPass(REPRODUCIBLE_COUNT if reproducible else None)]
    count = [] if reproducible else [GlobalCountPass()]
    sharding = shard.passes(o)  # ZeRO-1/2 after bucketing (passes/shard.py)
    return [*counted, *prescale, AllReduceInsertionPass("mean", algorithm),
            BufferAverageInsertionPass(algorithm), *reproducible, *marking,
            BucketingPass(o.bucket_bytes), *compression, *count, *sharding]


def _local(o: LocalOptions) -> list[ir.passes.PassBase]:
    return []


def _pushsum(o: PushSumOptions) -> list[ir.passes.PassBase]:
    return [PushSumPass(o.graph, o.peers_per_itr, o.overlap, o.synch_freq)]


def _simple(o: SimpleOptions) -> list[ir.passes.PassBase]:
    # buffers (BatchNorm statistics) averaged like allreduce does, so that simple's results
    # equal allreduce's for models with buffers too
    return [CountedLossPass(), CentralReducePass(root=0), BufferAverageInsertionPass(),
            GlobalCountPass()]


def _ps(o: PSOptions) -> list[ir.passes.PassBase]:
    return [CountedLossPass(PS_COUNT), PSPushPullPass(o.grad_shard_bytes, o.servers)]


# strategy name -> the pipeline built from its options (passes/options.py STRATEGY_OPTIONS)
STRATEGIES: dict[str, PipelineFactory] = {"allreduce": _allreduce, "local": _local,
                                          "pushsum": _pushsum, "simple": _simple, "ps": _ps}


def run_passes(step: ir.Model, strategy: str | StrategyOptions = "allreduce",
               lower: bool = True, gradients: StepOptions | None = None,
               **options: object) -> ir.Model:
    """Autodiff, the strategy's comm passes, gradient clipping, then optimizer lowering (if
    ``lower``).

    ``strategy`` is a name, whose options are then given as keywords (checked: an unknown one,
    or one of another strategy, is an OptionError), or a ``StrategyOptions`` instance.
    ``gradients``: clipping (passes/clipping.py) and accumulation (passes/accumulate.py,
    right after autodiff).
    """
    if isinstance(strategy, StrategyOptions):
        if options:
            raise OptionError(f"options are given twice: as {type(strategy).__name__} and as "
                              f"keywords {sorted(options)}")
        typed = strategy
    elif strategy not in STRATEGIES:
        raise unknown_strategy(strategy, STRATEGIES)
    else:
        typed = strategy_options(strategy, options)
    chosen = STRATEGIES[typed.strategy](typed)
    before = [p for p in chosen if isinstance(p, BEFORE_AUTODIFF)]  # act on the loss
    after: list[ir.passes.PassBase] = []
    shard.check_gradients(typed, gradients)
    if gradients is not None and gradients.accumulate > 1:
        accumulate.check_strategy(typed.strategy, gradients.accumulate,
                                  bool(getattr(typed, "reproducible_micro_batch", 0)))
        after = [accumulate.GradientAccumulationPass(gradients.accumulate)]
    passes: list[ir.passes.PassBase] = [*before, AutodiffPass(), *after,
                                        *(p for p in chosen if p not in before)]
    if gradients is not None and gradients.clipping:
        check_strategy(typed.strategy, gradients.clip_grad_norm)
        passes.append(GradientClippingPass(gradients.clip_grad_norm, gradients.clip_grad_value))
    if lower:
        passes.append(OptimizerLoweringPass())
    manager = StepPassManager(passes)  # a pass whose requirement is unmet is left out
    try:
        return manager(step).model
    except ir.passes.PassError as exc:
        cause = exc.__cause__
        while cause is not None and not isinstance(cause, NgdistError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        raise


def rewrite(model: onnx.ModelProto, strategy: str | StrategyOptions = "allreduce",
            **options: object) -> onnx.ModelProto:
    """Training model -> training model with the strategy's comm ops, fully lowered.

    ``strategy`` and ``options`` as for :func:`run_passes`; with ``shard`` (and
    ``shard_ranks``) a sharded file (ngdist/ir/shards.py), which trains on that many ranks."""
    level = options.get("shard", getattr(strategy, "shard", "none"))
    inference, step = split_training_model(model)
    full = shard.initial_values(step, level)
    step = run_passes(step, strategy, **options)
    out = assemble_training_model(inference, step)
    plan = layout(step)
    if plan is not None:
        pack(out, plan, full)
    return out
