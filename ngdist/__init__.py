"""ngdist: a graph compiler for distributed deep-learning training.

``ngdist.compile(model, loss=..., optimizer=..., strategy="allreduce")`` turns a forward ONNX
model into a data-parallel trainer; the rewritten graph is an ordinary .onnx file.
"""
from __future__ import annotations

from ngdist import optim
from ngdist.api import compile, rank, size, to_training_model  # noqa: A004
from ngdist.errors import (CommError, CommTimeoutError, ExecutionError, GradientError,
                           GraphError, InputError, ModelLoadError, NgdistError)
from ngdist.runtime.trainer import StepStats, Trainer
from ngdist.ray_compat import DistributedSGD  # noqa: E402  (Ray SGD's entry point)

__version__ = "0.1.0"

__all__ = ["CommError", "CommTimeoutError", "DistributedSGD", "ExecutionError",
           "GradientError", "GraphError", "InputError", "ModelLoadError", "NgdistError",
           "StepStats", "Trainer", "compile", "optim", "rank", "size", "to_training_model"]
