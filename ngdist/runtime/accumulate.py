"""Running gradient accumulation (passes/accumulate.py builds the graphs).

With ``accumulate=k`` every ``trainer.step(batch)`` is a micro-step: the first k-1 of a window
run the micro-step graph (forward, backward, ``acc += g``: no communication, no update, no bytes
sent), the k-th runs the step graph, which averages ``acc + g`` over the window, communicates
once and updates (a mean over counted tokens still reduces its one-scalar count on every
micro-step: passes/accumulate.py). ``trainer.step(batch, sync=False)`` makes a step a micro-step and
``sync=True`` an update whatever the count (DDP's ``no_sync``): the update averages over the
micro-steps since the last one. ``trainer.steps_done`` counts updates; a micro-step's stats
carry its own loss, ``bytes_sent`` 0 and ``lr`` None.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import onnx_ir as ir

from ngdist.errors import GraphError, OptionError
from ngdist.ir.domain import ACCUMULATE_SCALE as SCALE, MICRO_STEP
from ngdist.ir.model import get_meta
from ngdist.runtime.executor import Executor
from ngdist.runtime.timing import StepTimes

logger = logging.getLogger(__name__)



class Accumulation:
    """The micro-step executor and the count of micro-steps in the current window."""

    def __init__(self, trainer: Any, micro: ir.Model, threads: int, stats: type) -> None:
        self.trainer, self.stats = trainer, stats  # stats: the trainer's StepStats
        self.meta = get_meta(micro)
        self.executor = Executor(ir.to_proto(micro), trainer.group, placement=trainer.placement,
                                 intra_op_threads=threads, overlap=False,
                                 donate=self.meta.binding)
        self.every = int(round(1.0 / float(trainer.values[SCALE].numpy())))
        self.pending = 0  # micro-steps run since the last update

    def inner(self, sync: bool | None) -> bool:
        """Whether this step is a micro-step (no update)."""
        return not sync if sync is not None else self.pending + 1 < self.every

    def micro_step(self, batch: Any, fetch_stats: bool) -> Any:
        """One micro-step: gradients added to the accumulators, nothing sent."""
        trainer = self.trainer
        start = time.perf_counter()
        feeds, samples = trainer._feeds(batch)
        feeds.update(trainer.values)
        times = StepTimes()
        outputs = self.executor.run(feeds, times)
        for name, out in self.meta.binding.items():
            trainer.values[name] = outputs[out]
        self.pending += 1
        if not fetch_stats:
            return None
        loss = float(outputs[self.meta.loss].numpy())
        return self.stats(loss, time.perf_counter() - start, times.compute, 0.0, 0.0, samples, 0)

    def before_update(self) -> None:
        """The update averages over the window's micro-steps and this one."""
        trainer = self.trainer
        dtype = trainer.values[SCALE].numpy().dtype
        trainer.values[SCALE] = trainer.placement.value(np.array(1.0 / (self.pending + 1),
                                                                 dtype))
        self.pending = 0

    def close(self) -> None:
        self.executor.close()


def attach(trainer: Any, step: ir.Model, threads: int, stats: type) -> Accumulation | None:
    """The trainer's accumulation, when its step graph was built with ``accumulate=k``."""
    micro = step.meta.get(MICRO_STEP)
    if micro is None:
        if SCALE in trainer.values:  # a saved step keeps its accumulators, not the micro-step
            raise GraphError("this step graph was built with accumulate=k, whose micro-step "
                             "graph is not saved with it: compile the forward model again "
                             "with accumulate=")
        return None
    if trainer.executor.__class__ is not Executor:
        raise OptionError("accumulate cannot run with devices_per_worker > 1 (model replicas "
                          "in one process): pass one of the two")
    return Accumulation(trainer, micro, threads, stats)


def refuse_sync(sync: bool | None) -> None:
    """``sync=`` needs a trainer compiled with ``accumulate``."""
    if sync is not None:
        raise OptionError("step(sync=...) needs a trainer compiled with accumulate=k (the "
                          "gradient accumulators); pass accumulate= to ngdist.compile")
