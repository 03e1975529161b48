"""The one protocol the Trainer runs a step through, and the choice of its implementation.

``Executor`` (runtime/executor.py) runs the step graph; ``ReplicatedExecutor``
(runtime/replicas.py: model replicas in this process) and ``MicroBatchExecutor``
(runtime/microbatch.py: reproducible mode) run their towers and then an ``Executor`` for the
rest. All three offer :class:`StepExecutor`, so the trainer never asks which one it holds.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import onnx
import onnxruntime as ort

from ngdist.comm.group import ProcessGroup
from ngdist.ir.model import StepMeta
from ngdist.kernels import CommNode
from ngdist.runtime.executor import Executor
from ngdist.runtime.microbatch import MicroBatchExecutor, micro_batch_size
from ngdist.runtime.replicas import ReplicatedExecutor
from ngdist.runtime.sessions import Placement
from ngdist.runtime.timing import StepTimes


class StepExecutor(Protocol):
    """What the Trainer asks of an executor."""

    comm_nodes: Mapping[int, CommNode]

    @property
    def segment_count(self) -> int: ...

    def set_timeline(self, timeline: Any) -> None: ...

    def run(self, feeds: dict[str, ort.OrtValue], times: StepTimes | None = None
            ) -> dict[str, ort.OrtValue]: ...

    def drain(self) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


def make_executor(step: onnx.ModelProto, group: ProcessGroup, meta: StepMeta,
                  placement: Placement, *, devices_per_worker: int, threads: int,
                  overlap: bool) -> StepExecutor:
    """The executor of ``step``: the tower once per micro-batch in reproducible mode, model
    replicas with ``devices_per_worker`` > 1, else an ``Executor`` that may write the update
    into the memory of the values it replaces (``meta.binding``)."""
    micro_batch = micro_batch_size(step)
    if micro_batch:
        return MicroBatchExecutor(
            step, group, micro_batch, data_inputs=meta.names("data"),
            sessions=devices_per_worker if devices_per_worker > 1 else threads,
            loss=meta.loss, params=meta.names("param"), placement=placement, overlap=overlap)
    if devices_per_worker > 1:
        return ReplicatedExecutor(
            step, group, devices_per_worker, data_inputs=meta.names("data"), loss=meta.loss,
            params=meta.names("param"), placement=placement, intra_op_threads=threads,
            overlap=overlap)
    return Executor(step, group, placement=placement, intra_op_threads=threads,
                    overlap=overlap, donate=meta.binding)
