"""Strategies as named pass pipelines, and the functions that run them.

``allreduce``: autodiff -> AllReduce insertion (gradients, then buffer averages) -> bucketing
-> optimizer lowering.
``allreduce`` with ``reproducible_micro_batch=M``: the same with ``all_reduce_alg="exact"`` and
the reproducible-mode pass (exact loss average, micro-batch size on the exact AllReduce nodes)
before bucketing.
``local``: autodiff -> optimizer lowering (one process, no communication).
Later strategies (``pushsum``, ``ps``, ``simple``) register themselves in ``STRATEGIES``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import onnx
import onnx_ir as ir

from ngdist.errors import NgdistError
from ngdist.ir.domain import ALLREDUCE_ALGORITHMS
from ngdist.ir.model import assemble_training_model, split_training_model
from ngdist.passes.allreduce import AllReduceInsertionPass
from ngdist.passes.autodiff import AutodiffPass
from ngdist.passes.bucketing import BucketingPass
from ngdist.passes.buffers import BufferAverageInsertionPass
from ngdist.passes.optimizers import OptimizerLoweringPass
from ngdist.passes.pushsum import PushSumPass
from ngdist.passes.reproducible import ReproducibleMicroBatchPass
from ngdist.passes.ps import PSPushPullPass
from ngdist.passes.simple import CentralReducePass

logger = logging.getLogger(__name__)

PipelineFactory = Callable[..., list[ir.passes.PassBase]]


def _allreduce(bucket_bytes: int = 25 << 20, all_reduce_alg: str = "mpi",
               reproducible_micro_batch: int = 0, **_: object) -> list[ir.passes.PassBase]:
    if all_reduce_alg not in ALLREDUCE_ALGORITHMS:
        raise NgdistError(f"unknown all_reduce_alg {all_reduce_alg!r}; choose one of "
                          f"{list(ALLREDUCE_ALGORITHMS)}")
    reproducible: list[ir.passes.PassBase] = []
    if reproducible_micro_batch:  # rank-count-independent training (passes/reproducible.py)
        if all_reduce_alg not in ("mpi", "exact"):  # "mpi": the default, i.e. not chosen
            raise NgdistError(f"reproducible_micro_batch needs all_reduce_alg='exact' (the "
                              f"only order-independent sum), not {all_reduce_alg!r}")
        all_reduce_alg = "exact"
        reproducible = [ReproducibleMicroBatchPass(reproducible_micro_batch)]
    return [AllReduceInsertionPass("mean", all_reduce_alg),
            BufferAverageInsertionPass(all_reduce_alg), *reproducible,
            BucketingPass(bucket_bytes)]


def _local(**_: object) -> list[ir.passes.PassBase]:
    return []


def _pushsum(graph: str = "exponential", peers_per_itr: int = 1, overlap: bool = False,
             synch_freq: int = 0, **_: object) -> list[ir.passes.PassBase]:
    return [PushSumPass(graph, peers_per_itr, overlap, synch_freq)]


STRATEGIES: dict[str, PipelineFactory] = {"allreduce": _allreduce, "local": _local,
                                          "pushsum": _pushsum}


def _simple(**_: object) -> list[ir.passes.PassBase]:
    # buffers (BatchNorm statistics) averaged like allreduce does, so that simple's results
    # equal allreduce's for models with buffers too
    return [CentralReducePass(root=0), BufferAverageInsertionPass()]


def _ps(grad_shard_bytes: int = 10_000_000, servers: int = 0,
        **_: object) -> list[ir.passes.PassBase]:
    return [PSPushPullPass(grad_shard_bytes, servers)]


STRATEGIES.update(simple=_simple, ps=_ps)  # Ray SGD's strategies (issue 6)


def run_passes(step: ir.Model, strategy: str = "allreduce", lower: bool = True,
               **options: object) -> ir.Model:
    """Autodiff, the strategy's comm passes, then optimizer lowering (if ``lower``)."""
    if strategy not in STRATEGIES:
        raise NgdistError(f"unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)}")
    if options.get("reproducible_micro_batch") and strategy != "allreduce":
        raise NgdistError(f"reproducible_micro_batch is an option of the allreduce strategy, "
                          f"not of {strategy!r}")
    passes: list[ir.passes.PassBase] = [AutodiffPass(), *STRATEGIES[strategy](**options)]
    if lower:
        passes.append(OptimizerLoweringPass())
    manager = ir.passes.PassManager(passes, steps=1)
    try:
        return manager(step).model
    except ir.passes.PassError as exc:
        cause = exc.__cause__
        while cause is not None and not isinstance(cause, NgdistError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        raise


def rewrite(model: onnx.ModelProto, strategy: str = "allreduce", **options: object
            ) -> onnx.ModelProto:
    """Training model -> training model with the strategy's comm ops, fully lowered."""
    inference, step = split_training_model(model)
    step = run_passes(step, strategy, **options)
    return assemble_training_model(inference, step)
