"""``ngdist.compile``: model in, distributed trainer out."""
from __future__ import annotations

import logging
import os
from typing import Any

import onnx

from ngdist import optim
from ngdist.errors import GraphError
from ngdist.frontends.onnx import build_training_model
from ngdist.ir.model import load_proto, split_training_model
from ngdist.passes.pipeline import run_passes
from ngdist.comm.mpi import Communicator, world_rank_size
from ngdist.runtime.trainer import Trainer

logger = logging.getLogger(__name__)

_UNSET: Any = object()


def rank() -> int:
    """This process's rank (0 when not launched by mpiexec)."""
    return world_rank_size()[0]


def size() -> int:
    """The number of ranks (1 when not launched by mpiexec)."""
    return world_rank_size()[1]


def to_training_model(model: onnx.ModelProto | str | os.PathLike, *, loss: Any = _UNSET,
                      labels: str = "y", optimizer: Any = _UNSET, params: list[str] | None = None,
                      frozen: list[str] | None = None, output: str | None = None
                      ) -> onnx.ModelProto:
    """A training model from a path or ModelProto: used as is if it already is one."""
    proto = model if isinstance(model, onnx.ModelProto) else load_proto(model)
    if proto.training_info:
        if loss is not _UNSET or optimizer is not _UNSET or params or frozen:
            raise GraphError("the model is already a training model (it has training_info); "
                             "do not pass loss=, optimizer=, params= or frozen=")
        return proto
    return build_training_model(
        proto, loss="softmax_cross_entropy" if loss is _UNSET else loss, labels=labels,
        optimizer=optim.SGD(lr=0.01) if optimizer is _UNSET else optimizer,
        params=params, frozen=frozen, output=output)


def _framework_frontend(model: Any) -> Any:
    """The frontend module for a torch.nn.Module or Keras model, None for ONNX input."""
    if isinstance(model, (onnx.ModelProto, str, os.PathLike)):
        return None
    from ngdist.frontends import keras as keras_frontend, torch as torch_frontend
    for frontend in (torch_frontend, keras_frontend):
        if frontend.is_module(model):
            return frontend
    return None


def compile(model: onnx.ModelProto | str | os.PathLike | Any,  # noqa: A001
            example_inputs: Any = None, *, loss: Any = _UNSET, labels: str = "y",
            optimizer: Any = _UNSET, strategy: str = "allreduce",
            bucket_bytes: int = 25 << 20, params: list[str] | None = None,
            frozen: list[str] | None = None, output: str | None = None,
            timeout: float | None = None, intra_op_threads: int | None = None,
            providers: list[str] | None = None, overlap: bool | None = None,
            kvstore: Any = None, **strategy_options: Any) -> Trainer:
    """Build (if needed) and rewrite a training model, and return a Trainer for this rank.

    ``model``: a forward-only ONNX model (path or ModelProto), trained with ``loss`` against
    the input named ``labels`` and updated by ``optimizer``; or a training model (from
    ``trainer.save`` or ``ngdist rewrite``), used as it is. ``overlap``: communication
    overlaps computation (default on in the executor); when given, it is also passed to the
    strategy (``pushsum``'s gossip overlap, off by default there).
    A ``torch.nn.Module`` or Keras model (with ``example_inputs``) goes through its frontend
    (ngdist.frontends.torch / .keras), whose trainer can write the weights back.
    ``kvstore``: a store from ``ngdist.kvstore.create``; its type picks the strategy
    (dist_sync/dist_allreduce: allreduce, pushsum: pushsum, local: local) and its ngdist
    optimizer is used when ``optimizer`` is not given.
    ``reproducible_micro_batch=M`` (allreduce): reproducible mode, every rank's batch is cut
    into micro-batches of ``M`` samples whose gradients, buffer averages and loss are summed
    exactly (``all_reduce_alg="exact"``), so training gives the same bits on any number of
    ranks that are fed the same global batches (passes/reproducible.py).
    """
    if kvstore is not None:
        from ngdist.compat.kvstore import compile_options
        strategy, optimizer = compile_options(kvstore, strategy, optimizer, _UNSET)
    frontend = _framework_frontend(model)
    if frontend is not None:
        if params is not None or output is not None:
            raise GraphError("params= and output= apply to ONNX models; for a framework model "
                             "choose the trained parameters with the optimizer or frozen=")
        given = {k: v for k, v in (("loss", loss), ("optimizer", optimizer)) if v is not _UNSET}
        return frontend.compile(model, example_inputs, labels=labels, frozen=frozen, **given,
                                strategy=strategy, bucket_bytes=bucket_bytes, timeout=timeout,
                                intra_op_threads=intra_op_threads, providers=providers,
                                overlap=overlap, **strategy_options)
    if example_inputs is not None:
        raise GraphError("example_inputs is for torch and Keras models; an ONNX model "
                         "declares its inputs")
    proto = to_training_model(model, loss=loss, labels=labels, optimizer=optimizer,
                              params=params, frozen=frozen, output=output)
    comm = Communicator(timeout=timeout)
    inference, step = split_training_model(proto)
    if overlap is not None:
        strategy_options["overlap"] = overlap
    devices = int(strategy_options.pop("devices_per_worker", 1))  # replicas in this process
    serve = bool(strategy_options.pop("ps_serve", True))  # False: DistributedSGD's lockstep
    step = run_passes(step, strategy, bucket_bytes=bucket_bytes, **strategy_options)
    trainer = Trainer(inference, step=step, comm=comm, intra_op_threads=intra_op_threads,
                      providers=providers, overlap=overlap is not False,
                      devices_per_worker=devices)
    from ngdist.runtime.ps_server import setup as ps_setup
    ps_setup(trainer, serve)  # ps: shard owners; a dedicated server serves until workers stop
    return trainer
