"""Uneven inputs: ``with trainer.join():`` (DDP's ``Join``, Horovod's ``hvd.join()``).

Ranks rarely hold the same number of batches. Inside the block every step starts with a
one-integer AllReduce of the ranks still stepping (on a group of its own, so it never meets
the step's messages): a rank that steps sends 1, a rank that has left its loop (it is in the
block's ``__exit__``) sends 0. While the count is positive the ranks that left answer each
step with a *shadow step*: the step graph run on the last batch they had with
``ngdist.grad_scale`` = 0, so their gradients (and buffer averages) add exactly zero to the
AllReduce, and the update applies the reduced gradients to their copy of the parameters as
on the stepping ranks. The stepping ranks set ``ngdist.grad_scale`` = 1 / count, so the sum
is the mean over the ranks that contributed. Every rank leaves the block on the first count of
0; the parameters are then equal on every rank, and equal to training on the union of the
data: k steps on every rank's i-th batch together, then the steps of the ranks with more
batches alone.

Supported: the allreduce strategy whose gradients are prescaled by ``ngdist.grad_scale``
(every model built by autodiff), with plain AllReduce sums, also sharded (``shard=``: a rank
without data adds zero to the ReduceScatter and still updates its shard). Refused, with the reason: an
AllReduce that takes a mean over every rank (an explicit backward pass, a counted loss),
compression (a 16-bit zero is exact, but error feedback would send its residual),
``reproducible_micro_batch`` (it sums a fixed number of micro-batches per rank),
``accumulate=k``, several
devices per worker, parameter servers, push-sum, and ``log_dir`` metrics (their reductions
follow the steps of each rank). On one rank the block does nothing.
"""
from __future__ import annotations

import logging
from types import TracebackType
from typing import Any

import numpy as np
import onnx

from ngdist.comm import ProcessGroup
from ngdist.errors import OptionError
from ngdist.ir.domain import GRAD_SCALE
from ngdist.runtime import ps_server
from ngdist.runtime.executor import StepTimes

# runtime.trainer.Trainer, which imports this module (importing it here would be a cycle)
Trainer = Any

logger = logging.getLogger(__name__)

WHAT = "trainer.join(): the count of the ranks still stepping"


def lockstep(trainer: Trainer) -> bool:
    """Whether every rank takes every step of ``trainer`` together: its comm is AllReduce
    only (not push-sum's gossip, not parameter servers)."""
    return trainer.role == "worker" and ps_server.ps_node(trainer) is None and all(
        node.op_type == "AllReduce" for node in trainer.executor.comm_nodes.values())


def unsupported(trainer: Trainer) -> str | None:
    """Why ``trainer`` cannot step inside ``join()``, or None when it can."""
    if trainer.role != "worker" or ps_server.ps_node(trainer) is not None:
        return "parameter servers serve every worker's steps in turn"
    if trainer.micro_batch:
        return ("reproducible_micro_batch sums a fixed number of micro-batches per rank, "
                "which a rank without data cannot give")
    if getattr(trainer, "_accumulation", None) is not None:
        return ("accumulate=k: a rank that runs out mid-way would leave its micro-steps "
                "unmatched")
    if type(trainer.executor).__name__ != "Executor":
        return "several devices per worker run replicas that each take a share of a batch"
    for node in trainer.executor.comm_nodes.values():
        attrs = node.attributes
        if node.op_type in ("ReduceScatter", "AllGather"):  # shard=: a sum, then parameters
            continue
        if node.op_type != "AllReduce":
            return f"the step communicates with ngdist.{node.op_type} (strategy allreduce only)"
        if attrs.get("compression", "none") != "none":
            return ("compressed AllReduce: only plain sums (with error feedback a rank without "
                    "data would still send its residual)")
        if attrs.get("reduction", "mean") != "sum":
            return (f"ngdist.AllReduce '{node.name}' takes the mean over every rank (a "
                    "counted loss, or gradients that are not prescaled)")
    if GRAD_SCALE not in trainer.values:
        return ("the step's AllReduce takes the mean over every rank (a training model with "
                "its own backward pass), so a rank without data cannot be left out of it")
    if trainer.metrics is not None:
        return "log_dir metrics reduce each rank's own steps; train without log_dir"
    return None


class Join:
    """The context of ``trainer.join()``; see the module docstring."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.active = trainer.size > 1
        if self.active:
            why = unsupported(trainer)
            if why is not None:
                raise OptionError(f"trainer.join() cannot train on uneven inputs here: {why}")
        self.data: dict[str, Any] | None = None  # the last batch this rank fed (its feeds)
        self.shadow_steps = 0
        self._group: ProcessGroup | None = None

    # ------------------------------------------------------------------ the block
    def __enter__(self) -> Join:
        if not self.active:
            return self
        trainer = self.trainer
        if trainer._joining is not None:
            raise OptionError("trainer.join() is already open on this trainer")
        group = getattr(trainer, "_join_group", None)
        if group is None:  # collective: every rank enters the block
            group = trainer._join_group = trainer.group.dup("trainer.join() set-up")
        self._group = group
        trainer._joining = self
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.active:
            return
        trainer = self.trainer
        try:
            if exc_type is None:
                while self._count(0):
                    self._shadow_step()
        finally:
            trainer._joining = None
            self._set_scale(1.0 / trainer.num_workers)
        if self.shadow_steps:
            logger.info("trainer.join(): rank %d answered %d step(s) of the others after its "
                        "data ran out", trainer.rank, self.shadow_steps)

    # ------------------------------------------------------------------ the steps
    def before_step(self, data: dict[str, Any]) -> None:
        """A step of this rank (called by ``Trainer.step`` with its data feeds)."""
        self.data = {name: data[name] for name in self.trainer.data_inputs}
        self._set_scale(1.0 / self._count(1))

    def _count(self, stepping: int) -> int:
        assert self._group is not None
        buf = np.array([stepping], np.int64)
        self._group.allreduce(buf, WHAT).wait()
        return int(buf[0])

    def _set_scale(self, scale: float) -> None:
        trainer = self.trainer
        dtype = trainer.values[GRAD_SCALE].numpy().dtype
        trainer.values[GRAD_SCALE] = trainer.placement.value(np.array(scale, dtype))

    def _shadow_step(self) -> None:
        """The step graph on this rank's last batch with zero weight: its contributions are
        zeros, its update is the others' mean (module docstring)."""
        trainer = self.trainer
        self._set_scale(0.0)
        feeds = dict(self.data if self.data is not None else self._zero_batch())
        feeds.update(trainer.values)
        trainer._note_step(trainer.steps_done + 1)
        outputs = trainer.executor.run(feeds, StepTimes())
        for name, out in trainer.meta.binding.items():
            trainer.values[name] = outputs[out]
        trainer.steps_done += 1
        trainer._note_step(0)
        self.shadow_steps += 1
        if trainer.checkpoint_every and trainer.steps_done % trainer.checkpoint_every == 0:
            trainer.checkpoint()

    def _zero_batch(self) -> dict[str, Any]:
        """A batch of one sample of zeros, for a rank that never stepped inside the block."""
        feeds = {}
        for name, info in self.trainer.data_inputs.items():
            tt = info.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else 1 for d in tt.shape.dim]
            array = np.zeros(dims, onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
            feeds[name] = self.trainer.placement.value(array)
        return feeds
