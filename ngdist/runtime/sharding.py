"""A sharded trainer's optimizer state (ZeRO-1/2, passes/shard.py): each rank's shard of the
full state at start-up, and the full standard model gathered for ``trainer.save``.

The step graph's ``ngdist.shard_layout`` metadata says, per bucket, which flat state of ``S``
elements holds which parameters' state (in order, ``L`` elements, zero-padded to ``N * S``).
Rank r holds elements ``[r*S, r*S + S)`` of each.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnx_ir as ir

from ngdist.errors import NgdistError
from ngdist.ir.domain import SHARD_LAYOUT, SHARD_RANK
from ngdist.ir.model import assemble_training_model

if TYPE_CHECKING:
    from ngdist.runtime.trainer import Trainer

logger = logging.getLogger(__name__)


def layout(step: ir.Model) -> dict[str, Any] | None:
    """The shard layout of a step graph, None for an unsharded one."""
    text = step.graph.metadata_props.get(SHARD_LAYOUT)
    return json.loads(text) if text else None


class ShardedState:
    """Scatters and gathers the flat optimizer-state shards of one trainer."""

    def __init__(self, plan: dict[str, Any], plain_step: ir.Model) -> None:
        self.plan = plan
        self.ranks = int(plan["ranks"])
        self.plain_step = plain_step  # the training step as compiled from, for saved models

    def attach(self, trainer: Trainer, full: Mapping[str, np.ndarray]) -> None:
        """Sets the rank and this rank's shard of every flat state from ``full`` (the
        per-parameter states; missing ones start at zero)."""
        if trainer.group.size != self.ranks:
            raise NgdistError(f"the step graph is sharded for {self.ranks} ranks but this job "
                              f"has {trainer.group.size}; compile it in this job")
        rank = trainer.group.rank
        dtype = trainer.values[SHARD_RANK].numpy().dtype
        trainer.values[SHARD_RANK] = trainer.placement.value(np.array([rank], dtype))
        for group in self.plan["groups"]:
            size = int(group["size"])
            for kind, name in group["states"].items():
                dtype = trainer.values[name].numpy().dtype
                flat = np.zeros(size * self.ranks, dtype)
                offset = 0
                for p in group["params"]:
                    count = int(p["count"])
                    old = full.get(p["states"][kind])
                    if old is not None:
                        flat[offset:offset + count] = np.reshape(old, -1)
                    offset += count
                trainer.values[name] = trainer.placement.value(
                    np.ascontiguousarray(flat[rank * size:(rank + 1) * size]))
        trainer.sharding = self

    def gather(self, trainer: Trainer) -> dict[str, np.ndarray]:
        """Collective: every per-parameter state, whole, on every rank."""
        out: dict[str, np.ndarray] = {}
        for group in self.plan["groups"]:
            size = int(group["size"])
            for kind, name in group["states"].items():
                mine = np.ascontiguousarray(trainer.values[name].numpy())
                whole = np.empty(size * self.ranks, mine.dtype)
                trainer.group.allgather(mine, whole, f"gather {name}").wait()
                offset = 0
                for p in group["params"]:
                    count = int(p["count"])
                    out[p["states"][kind]] = whole[offset:offset + count].reshape(p["shape"])
                    offset += count
        return out

    def full_state(self, trainer: Trainer) -> dict[str, np.ndarray]:
        """Collective: ``trainer.state_dict()`` with per-parameter states for the flat
        shards (what a write-back into a framework optimizer reads)."""
        flat = {n for g in self.plan["groups"] for n in g["states"].values()}
        state = {n: v for n, v in trainer.state_dict().items()
                 if n not in flat and n != SHARD_RANK}
        state.update(self.gather(trainer))
        return state

    def full_model(self, trainer: Trainer) -> onnx.ModelProto:
        """Collective: the standard training model with the current values: the step as it
        was compiled from (optimizer node, no comm), so it resumes under any strategy."""
        values = {n: v for n, v in trainer._deployable().items() if n != SHARD_RANK}
        values.update(self.gather(trainer))
        logger.info("sharded state gathered: %d state tensors", len(values))
        return assemble_training_model(trainer.inference, self.plain_step, values)
