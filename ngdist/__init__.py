"""ngdist: a graph compiler for distributed deep-learning training.

``ngdist.compile(model, loss=..., optimizer=..., strategy="allreduce")`` turns a forward ONNX
model into a data-parallel trainer; the rewritten graph is an ordinary .onnx file.
"""
from __future__ import annotations

import sys

from ngdist import optim
from ngdist.api import allreduce_mean, barrier, compile, rank, size, to_training_model  # noqa: A004
from ngdist.errors import (CheckpointError, CommError, CommTimeoutError, ExecutionError,
                           GradientError, GraphError, InputError, LaunchError, ModelLoadError,
                           NgdistError, OptionError)
from ngdist.runtime.trainer import StepStats, Trainer
from ngdist.compat import backend, kvstore
from ngdist.compat.ray import DistributedSGD  # Ray SGD's entry point
from ngdist.launcher import launch  # run a function on N ranks (a notebook's too)

# the framework-compatibility surfaces keep their public names: ngdist.kvstore, ngdist.backend
sys.modules[__name__ + ".kvstore"] = kvstore
sys.modules[__name__ + ".backend"] = backend

__version__ = "0.1.0"

__all__ = ["CheckpointError", "CommError", "CommTimeoutError", "DistributedSGD", "ExecutionError",
           "GradientError", "GraphError", "InputError", "LaunchError", "ModelLoadError", "NgdistError", "OptionError",
           "StepStats", "Trainer", "allreduce_mean", "backend", "barrier", "compile", "kvstore", "launch", "optim", "rank", "size", "to_training_model"]
